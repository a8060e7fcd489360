// The torch-free interface of the 4-bit quantised-weight linear kernels (linear_q4.cpp portable,
// linear_q4_avx2.cpp, linear_q4_avx512.cpp). Weight layouts are GGUF's, byte for byte, so tensors
// read from a GGUF file ([N rows][blocks of one row]) are used as they are:
//   Q4_0: 32 values in 18 bytes {fp16 d, 16 bytes q}: value = d * (q - 8)
//   Q4_1: 32 values in 20 bytes {fp16 d, fp16 m, 16 bytes q}: value = d * q + m
//     (Q4_0/Q4_1: byte j holds value j in its low nibble and value j + 16 in its high nibble)
//   Q4_K: 256 values in 144 bytes {fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs,
//     128 bytes q}: sub-block s (32 values) is d * sc[s] * q - dmin * mn[s]; bytes 32c..32c+31
//     hold sub-block 2c in their low nibbles and sub-block 2c + 1 in their high nibbles.
//   Q5_K: 256 values in 176 bytes {fp16 d, fp16 dmin, 12 bytes of scales/mins as Q4_K's, 32 bytes
//     qh, 128 bytes q}: Q4_K's rule with 5-bit codes, bit s of qh[l] the fifth bit of value l of
//     sub-block s.
//   Q6_K: 256 values in 210 bytes {128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d}: value l of
//     sub-block j (32 values; half h = j / 4, t = j % 4) is d * sc[2j + l / 16] * (q - 32), q the
//     low (t < 2) or high nibble of ql[64h + 32(t % 2) + l] with bits 2t..2t+1 of qh[32h + l] on top.
//   Q5_0: 32 values in 22 bytes {fp16 d, 4 bytes qh, 16 bytes q}: value = d * (q5 - 16), q5 the
//     nibble (as Q4_0's) with bit j of the little-endian qh word on top for value j
//   Q5_1: 32 values in 24 bytes {fp16 d, fp16 m, 4 bytes qh, 16 bytes q}: value = d * q5 + m
//   IQ4_NL: 32 values in 18 bytes {fp16 d, 16 bytes q}: value = d * kIq4nlValues[q] (nibbles as
//     Q4_0's), a non-linear table of int8 levels. (These three are also the types llama.cpp's
//     quantiser falls back to for rows that are not whole 256-value super-blocks: Q5_0 for Q4_K,
//     Q5_1 for Q5_K, IQ4_NL for Q2_K / Q3_K and the IQ types.)
//   Q2_K: 256 values in 84 bytes {16 bytes scales, 64 bytes qs, fp16 d, fp16 dmin}: 16-value
//     sub-block s is d * (scales[s] & 15) * q - dmin * (scales[s] >> 4), q 2 bits: value 32j + l of
//     half n (128 values) is bits 2j..2j+1 of qs[32n + l] (j = 0..3, l = 0..31), in sub-block
//     8n + 2j + l / 16.
//   Q3_K: 256 values in 110 bytes {32 bytes hmask, 64 bytes qs, 12 bytes of sixteen 6-bit scales,
//     fp16 d}: 16-value sub-block s is d * (sc[s] - 32) * (q - 4), q = q2 + 4 h in 0..7: q2 placed
//     as Q2_K's (bits 2j..2j+1 of qs[32n + l] for value 32j + l of half n) and h bit 4n + j of
//     hmask[l]; sc[s]'s low four bits are byte s's low nibble (s < 8) or byte s - 8's high nibble,
//     its top two bits bits 2 (s / 4)..2 (s / 4) + 1 of byte 8 + s % 4 (q3_k_scale).
//   IQ4_XS: 256 values in 136 bytes {fp16 d, u16 scales_h, 4 bytes scales_l, 128 bytes q}: sub-block
//     s (32 values) is d * (ls - 32) * kIq4nlValues[q], ls the 6-bit scale whose low four bits are
//     nibble s of the little-endian scales_l word and top two bits bits 2s..2s+1 of scales_h; its
//     16 code bytes q[16 s..16 s + 15] hold value j low and j + 16 high, as IQ4_NL's block.
//   IQ3_XXS, IQ3_S, IQ2_XXS, IQ1_S: held in IQ4_XS's layout, 136 bytes per 256 values, with their
//     own sixteen levels (q_levels) and level scale f (q_level_scale): value = d * (ls - 32) * f *
//     levels[q]. GGUF stores them as indices into lattice grids (98, 110, 66 and 50 bytes per 256
//     values) that no kernel here reads; the loader rewrites each block into this form
//     (server/models/gguf_transcode.py), exactly: a sub-block's values are its scale rule's odd
//     multiplier 2 l + 1 (stored as ls = 2 l + 33) times a power of two (IQ3_XXS 1/4, IQ2_XXS and
//     IQ1_S 1/8 -- IQ1_S's levels are eight times grid + delta -- IQ3_S 1) times one of at most
//     sixteen signed grid values, and d is the block's own fp16 d.
//   IQ2_XS, IQ2_S, IQ1_M: the same with a scale per 16 values, in 138 bytes per 256 ("x16" layout):
//     {fp16 d, 8 bytes of sixteen 4-bit l (16-value half h of sub-block s: nibble h of byte 2 + s),
//     128 bytes of codes as IQ4_XS's}: value = d * (2 l + 1) / 8 * levels[q], IQ2_XXS's levels
//     (GGUF: 74 and 82 bytes of grid indices, signs and those same 4-bit l) or IQ1_S's (IQ1_M, whose
//     delta is per 8 values and whose d is spread over its 3-bit scales' top bits: 56 bytes).
//   MXFP4: 32 values in 17 bytes {u8 E8M0 exponent e, 16 bytes q} (gpt-oss's experts, GGML type
//     MXFP4): value = E2M1(q) * 2^(e - 127) = kMxfp4Values[q] * 2^(e - 128), byte j holding value j
//     low and j + 16 high as in Q4_0. The kernels read each code as kMxfp4Values[q] + 12 (unsigned
//     0..24, a byte shuffle of the nibble) with the block's offset -12 * 2^(e - 128), so the same
//     unsigned x signed dot products and offset FMAs as Q4_0 compute it exactly. (e = 255, the
//     spec's NaN, is read as 2^127, as llama.cpp does.)
// (Q5_0, Q5_1, IQ4_NL, IQ4_XS and the types held in its layout, Q2_K, Q3_K, Q5_K, Q6_K and MXFP4 share this interface and its op, pagewire::linear_q4, with the 4-bit types.)
// Every kernel works on activations quantised per row to Q8 blocks of 32 (quant_kernel.h), so a
// 4-bit weight block times an activation block is one integer dot product of 32 pairs plus the
// block's offset term (q's offset or min) times the activation block's sum.
#pragma once

#include <cstdint>
#include <string>

namespace pagewire::cpu {

enum class Q4Type : int { kQ4_0 = 0, kQ4_1 = 1, kQ4_K = 2, kQ5_K = 3, kQ6_K = 4, kMXFP4 = 5, kQ5_0 = 6, kQ5_1 = 7,
                          kIQ4_NL = 8, kIQ4_XS = 9, kQ2_K = 10, kQ3_K = 11, kIQ3_XXS = 12, kIQ3_S = 13,
                          kIQ2_XXS = 14, kIQ1_S = 15, kIQ2_XS = 16, kIQ2_S = 17, kIQ1_M = 18 };

constexpr int kQ4_0BlockBytes = 18;   // per 32 values
constexpr int kQ4_1BlockBytes = 20;   // per 32 values
constexpr int kQ4_KBlock = 256;       // values per super-block
constexpr int kQ4_KBlockBytes = 144;  // per 256 values
constexpr int kQ5_KBlockBytes = 176;  // per 256 values
constexpr int kQ6_KBlockBytes = 210;  // per 256 values
constexpr int kMxfp4BlockBytes = 17;  // per 32 values
constexpr int kQ5_0BlockBytes = 22;   // per 32 values
constexpr int kQ5_1BlockBytes = 24;   // per 32 values
constexpr int kIq4nlBlockBytes = 18;  // per 32 values
constexpr int kIq4xsBlockBytes = 136; // per 256 values
constexpr int kQ2_KBlockBytes = 84;   // per 256 values
constexpr int kQ3_KBlockBytes = 110;  // per 256 values
constexpr int kIq4x16BlockBytes = 138; // per 256 values (IQ2_XS, IQ2_S, IQ1_M held)

// IQ4_NL's sixteen levels (GGML's kvalues_iq4nl), int8.
constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// The levels of the types held in IQ4_XS's layout (see above), by code; codes no level uses are 0.
constexpr int8_t kIq3xxsValues[16] = {-62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62};
constexpr int8_t kIq3sValues[16] = {-15, -13, -11, -9, -7, -5, -3, -1, 1, 3, 5, 7, 9, 11, 13, 15};
constexpr int8_t kIq2xxsValues[16] = {-43, -25, -8, 8, 25, 43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
constexpr int8_t kIq1sValues[16] = {-9, -7, -1, 1, 7, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

// Twice the E2M1 values (OCP MX table 4), integers; the kernels add kMxfp4Offset to make them unsigned.
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int kMxfp4Offset = 12;

// 2^(e - 128), the scale of kMxfp4Values for exponent byte e, built from its bits (exact; e < 2
// gives the subnormals 2^-128 and 2^-127).
inline float mxfp4_scale(uint8_t e) {
  const uint32_t bits = e >= 2 ? static_cast<uint32_t>(e - 1) << 23 : 0x00200000u << e;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// Whether t is a K-quant (256-value super-blocks).
inline bool q_is_k(Q4Type t) {
  return t == Q4Type::kQ4_K || t == Q4Type::kQ5_K || t == Q4Type::kQ6_K || t == Q4Type::kQ2_K ||
         t == Q4Type::kQ3_K;
}
// Whether t is held in the x16 layout (a 4-bit l per 16 values; IQ2_XS, IQ2_S and IQ1_M rewritten into it).
inline bool q_is_x16(Q4Type t) { return t == Q4Type::kIQ2_XS || t == Q4Type::kIQ2_S || t == Q4Type::kIQ1_M; }
// The multiplier 2 l + 1 of 16-value half h (0..15) of an x16 block.
inline int iq_x16_scale(const uint8_t* blk, int h) { return 2 * ((blk[2 + h / 2] >> (4 * (h % 2))) & 0xF) + 1; }
// Whether t is held in IQ4_XS's layout (IQ4_XS itself and the grid types rewritten into it).
inline bool q_is_xs(Q4Type t) {
  return t == Q4Type::kIQ4_XS || t == Q4Type::kIQ3_XXS || t == Q4Type::kIQ3_S || t == Q4Type::kIQ2_XXS ||
         t == Q4Type::kIQ1_S;
}
// The sixteen signed levels of an IQ4_NL- or IQ4_XS-layout type's codes.
inline const int8_t* q_levels(Q4Type t) {
  switch (t) {
    case Q4Type::kIQ3_XXS: return kIq3xxsValues;
    case Q4Type::kIQ3_S: return kIq3sValues;
    case Q4Type::kIQ2_XXS:
    case Q4Type::kIQ2_XS:
    case Q4Type::kIQ2_S: return kIq2xxsValues;
    case Q4Type::kIQ1_S:
    case Q4Type::kIQ1_M: return kIq1sValues;
    default: return kIq4nlValues;
  }
}
// The power of two an IQ4_XS-layout type's d * (ls - 32) is multiplied by (exact in fp32).
inline float q_level_scale(Q4Type t) {
  return t == Q4Type::kIQ3_XXS ? 0.25f : t == Q4Type::kIQ2_XXS || t == Q4Type::kIQ1_S || q_is_x16(t) ? 0.125f : 1.f;
}
// Values per block and bytes per block of a type (the IQ4_XS layout: 256-value super-blocks too).
inline int q4_block_values(Q4Type t) { return q_is_k(t) || q_is_xs(t) || q_is_x16(t) ? kQ4_KBlock : 32; }
inline int q4_block_bytes(Q4Type t) {
  switch (t) {
    case Q4Type::kQ4_0: return kQ4_0BlockBytes;
    case Q4Type::kQ4_1: return kQ4_1BlockBytes;
    case Q4Type::kQ4_K: return kQ4_KBlockBytes;
    case Q4Type::kQ5_K: return kQ5_KBlockBytes;
    case Q4Type::kQ6_K: return kQ6_KBlockBytes;
    case Q4Type::kMXFP4: return kMxfp4BlockBytes;
    case Q4Type::kQ5_0: return kQ5_0BlockBytes;
    case Q4Type::kQ5_1: return kQ5_1BlockBytes;
    case Q4Type::kIQ4_NL: return kIq4nlBlockBytes;
    case Q4Type::kIQ4_XS:
    case Q4Type::kIQ3_XXS:
    case Q4Type::kIQ3_S:
    case Q4Type::kIQ2_XXS:
    case Q4Type::kIQ1_S: return kIq4xsBlockBytes;
    case Q4Type::kIQ2_XS:
    case Q4Type::kIQ2_S:
    case Q4Type::kIQ1_M: return kIq4x16BlockBytes;
    case Q4Type::kQ2_K: return kQ2_KBlockBytes;
    case Q4Type::kQ3_K: return kQ3_KBlockBytes;
  }
  return 0;
}
// Whether t is Q5_0 or Q5_1 (a fifth bit per value in a 32-bit qh word).
inline bool q_is_5(Q4Type t) { return t == Q4Type::kQ5_0 || t == Q4Type::kQ5_1; }

// The op-level names of the formats ("q4_0", ..., "iq4_nl"; server/kernels/kinds.py's Qtype), and a
// name's type and layout ("x8" suffix: interleaved). Every op that takes a qtype string parses it here.
inline const char* q4_type_name(Q4Type t) {
  switch (t) {
    case Q4Type::kQ4_0: return "q4_0";
    case Q4Type::kQ4_1: return "q4_1";
    case Q4Type::kQ4_K: return "q4_k";
    case Q4Type::kQ5_K: return "q5_k";
    case Q4Type::kQ6_K: return "q6_k";
    case Q4Type::kMXFP4: return "mxfp4";
    case Q4Type::kQ5_0: return "q5_0";
    case Q4Type::kQ5_1: return "q5_1";
    case Q4Type::kIQ4_NL: return "iq4_nl";
    case Q4Type::kIQ4_XS: return "iq4_xs";
    case Q4Type::kQ2_K: return "q2_k";
    case Q4Type::kQ3_K: return "q3_k";
    case Q4Type::kIQ3_XXS: return "iq3_xxs";
    case Q4Type::kIQ3_S: return "iq3_s";
    case Q4Type::kIQ2_XXS: return "iq2_xxs";
    case Q4Type::kIQ1_S: return "iq1_s";
    case Q4Type::kIQ2_XS: return "iq2_xs";
    case Q4Type::kIQ2_S: return "iq2_s";
    case Q4Type::kIQ1_M: return "iq1_m";
  }
  return "";
}
constexpr Q4Type kQ4Types[] = {Q4Type::kQ4_0, Q4Type::kQ4_1, Q4Type::kQ4_K, Q4Type::kQ5_K, Q4Type::kQ6_K,
                               Q4Type::kMXFP4, Q4Type::kQ5_0, Q4Type::kQ5_1, Q4Type::kIQ4_NL, Q4Type::kIQ4_XS,
                               Q4Type::kQ2_K, Q4Type::kQ3_K, Q4Type::kIQ3_XXS, Q4Type::kIQ3_S, Q4Type::kIQ2_XXS,
                               Q4Type::kIQ1_S, Q4Type::kIQ2_XS, Q4Type::kIQ2_S, Q4Type::kIQ1_M};

// IQ4_XS's 6-bit scale of sub-block s (0..7) of one super-block, less 32: [-32, 31].
inline int iq4_xs_scale(const uint8_t* blk, int s) {
  const int lo = (blk[4 + s / 2] >> (4 * (s % 2))) & 0xF;
  const int hi = ((blk[2] | blk[3] << 8) >> (2 * s)) & 3;
  return (lo | hi << 4) - 32;
}

// Q3_K's 6-bit scale of 16-value sub-block s (0..15) from a block's 12 scale bytes, less 32: [-32, 31].
inline int q3_k_scale(const uint8_t* sc, int s) {
  const int lo = s < 8 ? sc[s] & 0xF : sc[s - 8] >> 4;
  const int hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
  return (lo | hi << 4) - 32;
}

// Activations quantised per row in blocks of 32: x ~= d[b] * q[32 b + j]; s[b] = d[b] * sum_j q.
struct Q8SumActivations {
  const int8_t* q;  // [M, K]
  const float* d;   // [M, K / 32]
  const float* s;   // [M, K / 32]
  int64_t M, K;
};

// Q4_K's packed 6-bit scale and min of sub-block j (0..7), GGUF's get_scale_min_k4.
inline void q4_k_scale_min(int j, const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Dequantises one row of K values (K a multiple of the type's block) to fp32.
void dequantize_q4_row(Q4Type t, const uint8_t* w, float* out, int64_t K);

// The interleaved ("x8") layout of Q4_0, Q4_1, Q4_K and Q6_K, which the AVX2 kernel reads fastest
// (linear_x8_avx2.cpp). Rows 8g..8g+7 are rearranged within their own bytes so that one 32-byte
// load holds four code bytes (eight values) of each of the eight rows, one row per 32-bit lane:
//   per block b of 32 values: the eight rows' fp16 d (16 bytes), for Q4_1 then their eight fp16 m
//   (16 bytes), then four 32-byte chunks; chunk c holds bytes 4c..4c+3 of each row's 16 code bytes,
//   row r at bytes 4r..4r+3 (so low nibbles are values 4c..4c+3, high nibbles 16+4c..16+4c+3).
// Q5_0 / Q5_1 add, after the scales, their fifth bits as one 32-byte vector (row r's four bytes at
// 4r), rearranged so that a chunk's bits are two shifts away: byte i of row r's word has at bit c
// the fifth bit of value 4c + i and at bit 4 + c that of value 16 + 4c + i (c = 0..3). IQ4_NL's
// x8 layout is Q4_0's.
// A group occupies exactly its eight rows' bytes (8 * row bytes); the last N % 8 rows of a weight
// stay in GGUF's row layout. Nothing is dequantised: the codes and scales are the same bytes.
// Q4_K's x8 layout (linear_x8k_avx2.cpp), per super-block of the eight rows (8 * 144 bytes): their
// fp16 d (16 bytes), their fp16 dmin (16 bytes), the 12 packed scale bytes as three 32-byte
// vectors (word w of row r at 32w + 4r), then 32 chunks of codes: chunk 8c + j holds bytes
// 32c + 4j..32c + 4j + 3 of each row's 128 code bytes, row r at 4r (low nibbles: values 4j..4j+3
// of sub-block 2c; high nibbles: of sub-block 2c + 1).
// Q5_K's x8 layout (x8k_body.h) is Q4_K's (its 1,152 bytes in the same places, the codes from each
// block's byte 48) followed by the eight rows' qh as eight 32-byte chunks (chunk j: bytes 4j..4j+3
// of each row's 32, row r at 4r; byte i's bit s the fifth bit of value 4j + i of sub-block s).
// IQ4_XS's x8 layout (x8_q5nl_body.h), per super-block of the eight rows (8 * 136 bytes): their
// fp16 d (16 bytes), their scales_l words (32 bytes, row r's at 16 + 4r), their scales_h (16 bytes,
// row r's at 48 + 2r), then per sub-block s (at 64 + 128 s) IQ4_NL's four x8 chunks of its codes
// (chunk c: bytes 4c..4c+3 of each row's sub-block s, row r at 4r).
// IQ3_XXS, IQ3_S, IQ2_XXS and IQ1_S (held in IQ4_XS's bytes) have IQ4_XS's x8 layout too.
// The x16 layout's x8 form (IQ2_XS, IQ2_S, IQ1_M; x8_q5nl_body.h group_x16), per super-block of the eight rows
// (8 * 138 bytes): their fp16 d (16 bytes), their 8 scale bytes as two 32-byte vectors (bytes
// 4v..4v+3 of row r at 16 + 32v + 4r), then IQ4_XS's chunks of codes from 80 (sub-block s at 80 + 128 s).
// Q2_K's x8 layout (x8k_q2_body.h), per super-block of the eight rows (8 * 84 bytes): their fp16 d
// (16 bytes), their fp16 dmin (16 bytes), their 16 scale bytes as four 32-byte vectors (bytes
// 4v..4v+3 of row r at 32 + 32v + 4r), then 16 chunks of codes (chunk c: qs bytes 4c..4c+3 of each
// row, row r at 160 + 32c + 4r).
// Q3_K's x8 layout (x8k_q3_body.h), per super-block of the eight rows (8 * 110 bytes): their fp16 d
// (16 bytes), their 12 scale bytes as three 32-byte vectors (bytes 4v..4v+3 of row r at 16 + 32v +
// 4r), then each row's 96 bytes of hmask and qs repacked as three planes A, B, C of 8 chunks each
// (plane k at 112 + 256k; chunk c: value positions 4c..4c+3 of each row, row r at 4r): a position
// l (0..31) has eight 3-bit codes (n, j), n = 0, 1, j = 0..3, the code of value 128n + 32j + l;
// A holds codes (0, 0) and (0, 1) at bits 0-2 and 4-6, B codes (0, 2) and (0, 3), C codes (1, 0)
// and (1, 1), and code (1, 2)'s bits 0, 1, 2 are bit 3 of A, B and C, code (1, 3)'s their bit 7.
// Q6_K's x8 layout (x8k_body.h), per super-block of the eight rows (8 * 210 bytes): their
// fp16 d (16 bytes), their 16 int8 scales as four 32-byte vectors (scales 4v..4v+3 of row r at
// 32v + 4r), then 32 ql chunks (chunk c: bytes 4c..4c+3 of each row's 128 ql bytes, row r at 4r)
// and 16 qh chunks (chunk c: bytes 4c..4c+3 of each row's 64 qh bytes).
constexpr int kQ4Interleave = 8;
inline bool q4_interleavable(Q4Type t) { return t != Q4Type::kMXFP4; }
// The type and layout a qtype name says ("q4_0", "q4_0x8", ...: the row layout, or "x8" for the
// interleaved one where the type has it); false for any other name.
inline bool parse_q4_name(const std::string& name, Q4Type* t, bool* interleaved) {
  const bool x8 = name.size() > 2 && name.compare(name.size() - 2, 2, "x8") == 0;
  const std::string base = x8 ? name.substr(0, name.size() - 2) : name;
  for (Q4Type c : kQ4Types) {
    if (base == q4_type_name(c) && (!x8 || q4_interleavable(c))) {
      *t = c;
      *interleaved = x8;
      return true;
    }
  }
  return false;
}
// Every name parse_q4_name takes, for error messages: "'q4_0', 'q4_1', ..., 'q6_kx8'".
inline std::string q4_names() {
  std::string out;
  for (int x8 = 0; x8 < 2; ++x8) {
    for (Q4Type c : kQ4Types) {
      if (x8 && !q4_interleavable(c)) continue;
      out += std::string(out.empty() ? "'" : ", '") + q4_type_name(c) + (x8 ? "x8'" : "'");
    }
  }
  return out;
}
// One group: eight GGUF rows (src, row stride row_bytes) -> the group's interleaved bytes, and back
// (x8_layouts.cpp).
void interleave_q4_group(Q4Type t, const uint8_t* src, int64_t row_bytes, uint8_t* dst, int64_t K);
void deinterleave_q4_group(Q4Type t, const uint8_t* src, uint8_t* dst, int64_t row_bytes, int64_t K);
// out[m][n] for the first N / 8 * 8 rows of an interleaved weight (the caller runs the remaining
// N % 8 rows, in row layout, through linear_q4_avx2); same arguments as linear_q4_avx2.
void linear_q4x8_avx2(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                      int64_t ldo, int64_t N);  // Isa::kAvx2 or better
// The same with AVX-512 VNNI (linear_x8_vnni.cpp; Isa::kAvx512 or better): the same floats, bit for bit.
void linear_q4x8_vnni(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                      int64_t ldo, int64_t N);
// (Q5_0, Q5_1, IQ4_NL and IQ4_XS: x8_q5nl_body.h, in the same two builds.)
// Q4_0 and Q4_1 with AMX tiles (linear_x8_amx.cpp; Isa::kAmx): the same floats, bit for bit. Only
// those two types (the caller picks it from kAmxMinRowsQ4x8 rows, dispatch_mode.h).
void linear_q4x8_amx(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                     int64_t ldo, int64_t N);
// Q4_K's and Q6_K's x8 kernels (x8k_body.h), called by linear_q4x8_avx2 for kQ4_K / kQ6_K
// (linear_x8k_avx2.cpp) and by linear_q4x8_vnni (linear_x8k_vnni.cpp; Isa::kAvx512 or better): the
// same floats, bit for bit.
void linear_q4kx8_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N);
void linear_q6kx8_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N);
void linear_q5kx8_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N);
void linear_q5kx8_vnni(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N);
void linear_q4kx8_vnni(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N);
void linear_q6kx8_vnni(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N);
// Q2_K's x8 kernels (x8k_q2_body.h), the same floats in both builds, and its row layout
// (linear_q2k_avx2.cpp; called by linear_q4_avx2 and linear_q4_avx512).
void linear_q2kx8_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N);
void linear_q2kx8_vnni(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N);
void linear_q2k_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                     int64_t N);
// Q3_K's x8 kernels (x8k_q3_body.h), the same floats in both builds, and its row layout
// (linear_q3k_avx2.cpp; called by linear_q4_avx2 and linear_q4_avx512).
void linear_q3kx8_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N);
void linear_q3kx8_vnni(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N);
void linear_q3k_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                     int64_t N);
// Q5_0, Q5_1, IQ4_NL and IQ4_XS in row layout (linear_q5nl_avx2.cpp), called by linear_q4_avx2 and
// linear_q4_avx512 for those types (the same AVX2 code: their row layout only serves a weight's
// last N % 8 rows on x86, the x8 kernels the rest).
void linear_q5nl_avx2(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                      int64_t ldo, int64_t N);
// Q5_K and Q6_K in row layout (linear_k56_avx2.cpp, linear_k56_avx512.cpp), called by
// linear_q4_avx2 / linear_q4_avx512 for those types.
void linear_k56_avx2(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                     int64_t ldo, int64_t N);
void linear_k56_avx512(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                       int64_t ldo, int64_t N);

// out[m][n] = sum over blocks (+ bias[n]), fp32 out [M, N] with row stride ldo; bias fp32 [N] or
// nullptr; w: [N, K / block * block_bytes] bytes of type t.
void linear_q4_portable(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                        int64_t ldo, int64_t N);
void linear_q4_avx2(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                    int64_t ldo, int64_t N);  // Isa::kAvx2 or better
void linear_q4_avx512(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                      int64_t ldo, int64_t N);  // Isa::kAvx512 or better

}  // namespace pagewire::cpu
