// The interleaved x8 layouts of the 4-bit, 5-bit and K-quant types (quant4_kernel.h documents each
// one): interleave_q4_group moves eight GGUF rows into a group's bytes, deinterleave_q4_group moves
// them back. Nothing is converted: every byte of the rows lands somewhere in the group, except
// where a kernel reads bits faster in another order (the Q5_0 / Q5_1 fifth-bit words, qh_to_x8;
// Q3_K's codes, repacked into three bytes per value position, q3_k_codes_x8); a group is exactly
// its eight rows' size and the round trip gives the rows back byte for byte.
// Each super-block type's layout is written once, as a list of moves that runs in either direction
// (x8_block), so the two directions cannot disagree.
#include <cstdint>
#include <cstring>

#include "quant4_kernel.h"

namespace pagewire::cpu {

namespace {

// Where the x8 layout puts a 32-value block's pieces: the scales' bytes per block (d, and m for
// Q4_1 / Q5_1), and the offset of the nibbles in a GGUF block (after d, m and Q5's qh).
inline bool has_min(Q4Type t) { return t == Q4Type::kQ4_1 || t == Q4Type::kQ5_1; }
inline int x8_scale_bytes(Q4Type t) { return has_min(t) ? 32 : 16; }
inline int codes_offset(Q4Type t) { return (has_min(t) ? 4 : 2) + (q_is_5(t) ? 4 : 0); }

// Q5's fifth bits of one row and block: GGUF's qh word (bit j: value j) <-> the x8 layout's word
// (quant4_kernel.h: byte i, bit c: value 4c + i; bit 4 + c: value 16 + 4c + i).
inline uint32_t qh_to_x8(uint32_t qh) {
  uint32_t out = 0;
  for (int c = 0; c < 4; ++c) {
    for (int i = 0; i < 4; ++i) {
      out |= ((qh >> (4 * c + i)) & 1u) << (8 * i + c);
      out |= ((qh >> (16 + 4 * c + i)) & 1u) << (8 * i + 4 + c);
    }
  }
  return out;
}
inline uint32_t qh_from_x8(uint32_t v) {
  uint32_t out = 0;
  for (int c = 0; c < 4; ++c) {
    for (int i = 0; i < 4; ++i) {
      out |= ((v >> (8 * i + c)) & 1u) << (4 * c + i);
      out |= ((v >> (8 * i + 4 + c)) & 1u) << (16 + 4 * c + i);
    }
  }
  return out;
}

// Q3_K's codes of one row's block (hmask at blk, qs at blk + 32) <-> its bytes in the x8 layout's
// three code planes (quant4_kernel.h), planes 256 bytes apart from p: position l's bytes A, B, C at
// p + 32 (l / 4) + l % 4 (+ 256, + 512). Code (n, j) of position l (value 128 n + 32 j + l) is
// q2 | h << 2, q2 bits 2j..2j+1 of qs[32 n + l] and h bit 4n + j of hmask[l]; A holds codes (0, 0)
// and (0, 1) at bits 0-2 and 4-6, B codes (0, 2) and (0, 3), C codes (1, 0) and (1, 1), and code
// (1, 2)'s three bits are bit 3 of A, B and C, code (1, 3)'s bit 7 of each.
void q3_k_codes_x8(uint8_t* blk, uint8_t* p, bool to_x8) {
  for (int l = 0; l < 32; ++l) {
    uint8_t* at = p + 32 * (l / 4) + l % 4;
    int code[2][4];
    if (to_x8) {
      for (int n = 0; n < 2; ++n) {
        for (int j = 0; j < 4; ++j) code[n][j] = ((blk[32 + 32 * n + l] >> (2 * j)) & 3) | ((blk[l] >> (4 * n + j)) & 1) << 2;
      }
      for (int k = 0; k < 3; ++k) {  // plane k: A, B, C
        const int lo = k < 2 ? code[0][2 * k] : code[1][0], hi = k < 2 ? code[0][2 * k + 1] : code[1][1];
        at[256 * k] = static_cast<uint8_t>(lo | ((code[1][2] >> k) & 1) << 3 | hi << 4 | ((code[1][3] >> k) & 1) << 7);
      }
    } else {
      for (int k = 0; k < 3; ++k) {
        const int v = at[256 * k];
        (k < 2 ? code[0][2 * k] : code[1][0]) = v & 7;
        (k < 2 ? code[0][2 * k + 1] : code[1][1]) = (v >> 4) & 7;
      }
      code[1][2] = code[1][3] = 0;
      for (int k = 0; k < 3; ++k) {
        code[1][2] |= ((at[256 * k] >> 3) & 1) << k;
        code[1][3] |= ((at[256 * k] >> 7) & 1) << k;
      }
      uint8_t hm = 0;
      for (int n = 0; n < 2; ++n) {
        uint8_t qs = 0;
        for (int j = 0; j < 4; ++j) {
          qs = static_cast<uint8_t>(qs | (code[n][j] & 3) << (2 * j));
          hm = static_cast<uint8_t>(hm | (code[n][j] >> 2) << (4 * n + j));
        }
        blk[32 + 32 * n + l] = qs;
      }
      blk[l] = hm;
    }
  }
}

// One super-block of eight rows (row r's block at rows + r * row_bytes) <-> the group's bytes g:
// to the layout when to_x8, back to the rows otherwise. move(at, off, n) is n bytes between g + at
// and row r's block + off.
void x8_block(Q4Type t, uint8_t* rows, int64_t row_bytes, uint8_t* g, bool to_x8) {
  for (int r = 0; r < kQ4Interleave; ++r) {
    uint8_t* blk = rows + r * row_bytes;
    const auto move = [&](int at, int off, int n) {
      if (to_x8) {
        std::memcpy(g + at, blk + off, n);
      } else {
        std::memcpy(blk + off, g + at, n);
      }
    };
    switch (t) {
      case Q4Type::kQ4_K:
      case Q4Type::kQ5_K: {
        const bool five = t == Q4Type::kQ5_K;
        const int codes = five ? 48 : 16;  // where a block's nibbles start (Q5_K: after its 32 qh bytes)
        move(2 * r, 0, 2);                 // d
        move(16 + 2 * r, 2, 2);            // dmin
        for (int w = 0; w < 3; ++w) move(32 + 32 * w + 4 * r, 4 + 4 * w, 4);  // packed scales
        for (int c = 0; c < 32; ++c) move(128 + 32 * c + 4 * r, codes + 4 * c, 4);
        if (five) {  // qh: chunk j holds bytes 4j..4j+3 of each row's 32
          for (int j = 0; j < 8; ++j) move(1152 + 32 * j + 4 * r, 16 + 4 * j, 4);
        }
        break;
      }
      case Q4Type::kQ6_K:
        move(2 * r, 208, 2);                                                      // d
        for (int v = 0; v < 4; ++v) move(16 + 32 * v + 4 * r, 192 + 4 * v, 4);   // scales
        for (int c = 0; c < 32; ++c) move(144 + 32 * c + 4 * r, 4 * c, 4);        // ql
        for (int c = 0; c < 16; ++c) move(1168 + 32 * c + 4 * r, 128 + 4 * c, 4);  // qh
        break;
      case Q4Type::kQ2_K:
        move(2 * r, 80, 2);       // d
        move(16 + 2 * r, 82, 2);  // dmin
        for (int v = 0; v < 4; ++v) move(32 + 32 * v + 4 * r, 4 * v, 4);         // scales
        for (int c = 0; c < 16; ++c) move(160 + 32 * c + 4 * r, 16 + 4 * c, 4);  // qs
        break;
      case Q4Type::kQ3_K:
        move(2 * r, 108, 2);                                                    // d
        for (int v = 0; v < 3; ++v) move(16 + 32 * v + 4 * r, 96 + 4 * v, 4);  // packed scales
        q3_k_codes_x8(blk, g + 112 + 4 * r, to_x8);                             // hmask and qs, repacked
        break;
      case Q4Type::kIQ4_XS:
      case Q4Type::kIQ3_XXS:  // (the grid types, held in IQ4_XS's bytes)
      case Q4Type::kIQ3_S:
      case Q4Type::kIQ2_XXS:
      case Q4Type::kIQ1_S:
        move(2 * r, 0, 2);       // d
        move(48 + 2 * r, 2, 2);  // scales_h
        move(16 + 4 * r, 4, 4);  // scales_l
        for (int s = 0; s < 8; ++s) {
          for (int c = 0; c < 4; ++c) move(64 + 128 * s + 32 * c + 4 * r, 8 + 16 * s + 4 * c, 4);
        }
        break;
      case Q4Type::kIQ2_XS:  // (the x16 layout)
      case Q4Type::kIQ2_S:
      case Q4Type::kIQ1_M:
        move(2 * r, 0, 2);                                                     // d
        for (int v = 0; v < 2; ++v) move(16 + 32 * v + 4 * r, 2 + 4 * v, 4);  // the sixteen l
        for (int s = 0; s < 8; ++s) {
          for (int c = 0; c < 4; ++c) move(80 + 128 * s + 32 * c + 4 * r, 10 + 16 * s + 4 * c, 4);
        }
        break;
      default:
        break;
    }
  }
}

// Whether t's x8 layout is by 256-value super-block (x8_block) rather than by 32-value block.
inline bool by_superblock(Q4Type t) { return q_is_k(t) || q_is_xs(t) || q_is_x16(t); }

}  // namespace

void interleave_q4_group(Q4Type t, const uint8_t* src, int64_t row_bytes, uint8_t* dst, int64_t K) {
  const int bb = q4_block_bytes(t);
  if (by_superblock(t)) {
    for (int64_t s = 0; s < K / kQ4_KBlock; ++s) {
      x8_block(t, const_cast<uint8_t*>(src) + s * bb, row_bytes, dst + s * kQ4Interleave * bb, true);  // (src is only read)
    }
    return;
  }
  const int sb = x8_scale_bytes(t), qo = codes_offset(t);
  for (int64_t b = 0; b < K / 32; ++b) {
    uint8_t* o = dst + b * kQ4Interleave * bb;
    for (int r = 0; r < kQ4Interleave; ++r) {
      const uint8_t* blk = src + r * row_bytes + b * bb;
      std::memcpy(o + 2 * r, blk, 2);                            // d
      if (has_min(t)) std::memcpy(o + 16 + 2 * r, blk + 2, 2);  // m
      int at = sb;
      if (q_is_5(t)) {  // the fifth bits, rearranged (qh_to_x8)
        uint32_t qh;
        std::memcpy(&qh, blk + qo - 4, 4);
        qh = qh_to_x8(qh);
        std::memcpy(o + sb + 4 * r, &qh, 4);
        at += 32;
      }
      for (int c = 0; c < 4; ++c) std::memcpy(o + at + 32 * c + 4 * r, blk + qo + 4 * c, 4);
    }
  }
}

void deinterleave_q4_group(Q4Type t, const uint8_t* src, uint8_t* dst, int64_t row_bytes, int64_t K) {
  const int bb = q4_block_bytes(t);
  if (by_superblock(t)) {
    for (int64_t s = 0; s < K / kQ4_KBlock; ++s) {
      x8_block(t, dst + s * bb, row_bytes, const_cast<uint8_t*>(src) + s * kQ4Interleave * bb, false);  // (src is only read)
    }
    return;
  }
  const int sb = x8_scale_bytes(t), qo = codes_offset(t);
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* in = src + b * kQ4Interleave * bb;
    for (int r = 0; r < kQ4Interleave; ++r) {
      uint8_t* blk = dst + r * row_bytes + b * bb;
      std::memcpy(blk, in + 2 * r, 2);
      if (has_min(t)) std::memcpy(blk + 2, in + 16 + 2 * r, 2);
      int at = sb;
      if (q_is_5(t)) {
        uint32_t v;
        std::memcpy(&v, in + sb + 4 * r, 4);
        v = qh_from_x8(v);
        std::memcpy(blk + qo - 4, &v, 4);
        at += 32;
      }
      for (int c = 0; c < 4; ++c) std::memcpy(blk + qo + 4 * c, in + at + 32 * c + 4 * r, 4);
    }
  }
}

}  // namespace pagewire::cpu
