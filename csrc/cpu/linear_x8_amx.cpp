// The x8 layouts on Intel AMX tiles (Isa::kAmx): Q8_0's (quant_kernel.h; linear_q8_0x8_amx) and
// Q4_0's / Q4_1's (quant4_kernel.h; linear_q4x8_amx), each bit for bit the x8 kernels' floats
// (x8_body.h, built as linear_x8_avx2.cpp and linear_x8_vnni.cpp). The row-layout AMX kernels are
// linear_amx.cpp's; the tile plumbing both files use is amx_tiles.h.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

// Headers first: inline functions they define must keep the baseline ISA.
#include "amx_tiles.h"
#include "quant4_kernel.h"
#include "quant_kernel.h"
#include "team_kernel.h"
#include "x86_target.h"

// GCC 12's own intrinsic headers trip -Wmaybe-uninitialized (the _mm512_undefined_* idiom).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
PAGEWIRE_TARGET_PUSH("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx2,fma,f16c")

namespace pagewire::cpu {
namespace {

using amx::compiler_barrier;
using amx::kGroups;
using amx::kRows;
using amx::my_slice;
using amx::TileConfig;

// Q8_0 in the x8 layout (quant_kernel.h), the layout every x86 family keeps Q8_0 weights in. Here
// the roles swap: the activations are the A tile (src1: up to 16 rows of xq, one block's 32 bytes
// each, loaded straight from xq with the row stride K, no transpose), and the weight is the B tile
// (src2): a group's block is eight 32-byte chunks, chunk c holding bytes 4c..4c+3 of each of its
// eight rows, which is AMX's B layout for eight columns (K/4 = 8 rows of 32 bytes). Two groups'
// chunks side by side (copied into a scratch buffer, as the 4-bit codes are unpacked into one)
// make a B tile of 16 columns. TDPBSSD into a zeroed C [mc][16] gives each row's exact dot with
// the block, the same integer the x8 kernels' maddubs / vpdpbusd sums give; the fp32 step is
// theirs too, acc = fma(wd, float(dot) * xd, acc) per block in K order, then + bias: so the floats
// are linear_q8_0x8_vnni's (and _avx2's) bit for bit, whatever M, and batch-invariant mode may use
// it as well. One group per 8-column tile, the tile read back right after its store, was this
// kernel until session 23 (see x8_pair_step for what the pairs bought).

// One call of either kernel: the weight (group_bytes per x8 group), bias, output and the Q8
// activations; xc only for the 4-bit kernel (per row and block: Q4_0 -8 * xs, Q4_1 xs).
struct X8Call {
  const uint8_t* w;
  const float* bias;
  float* out;
  int64_t ldo, K, nb, group_bytes;
  const int8_t* xq;
  const float* xd;
  const float* xc = nullptr;
};

constexpr int kX8Rows = 8;                    // weight rows per x8 group (quant_kernel.h kQ8Interleave)

// The tile shapes for mc activation rows and n weight rows per C tile (8: one x8 group, 16: two);
// loaded once per thread and shape.
class X8Tiles {
 public:
  ~X8Tiles() {
    if (loaded_) _tile_release();
  }
  void shape(int mc, int n = kX8Rows) {
    if (loaded_ && mc == mc_ && n == n_) return;
    TileConfig cfg;
    for (int t = 0; t < kGroups; ++t) {
      cfg.rows[t] = static_cast<uint8_t>(mc);
      cfg.colsb[t] = static_cast<uint16_t>(n * 4);
    }
    cfg.rows[4] = static_cast<uint8_t>(mc);
    cfg.colsb[4] = static_cast<uint16_t>(kQ8Block);
    for (int t = 5; t <= 6; ++t) {
      cfg.rows[t] = static_cast<uint8_t>(kQ8Block / 4);
      cfg.colsb[t] = static_cast<uint16_t>(n * 4);
    }
    compiler_barrier();
    _tile_loadconfig(&cfg);
    loaded_ = true;
    mc_ = mc;
    n_ = n;
  }

 private:
  int mc_ = 0, n_ = 0;
  bool loaded_ = false;
};

// Q4_0 and Q4_1 in the x8 layout (quant4_kernel.h): per block of eight weight rows, four 32-byte
// chunks whose low nibbles are values 4c..4c+3 and high nibbles 16+4c..16+4c+3 of each row, row r
// at bytes 4r..4r+3. Unpacked to bytes (0..15), chunk c's low nibbles are exactly AMX's B row for
// K quad c over eight columns, and its high nibbles the row for quad 4 + c. Two groups side by
// side make a B tile of 16 columns (8 rows of 64 bytes; a lone last group gets zero codes beside
// it), built in a scratch buffer; TDPBSSD (codes 0..15 are the same signed or unsigned) against
// the block's activation rows gives the integers the x8 kernels' vpdpbusd sums (u8 codes x s8
// activations), and a C row holds both groups' 16 dots, so the fp32 step runs on 512-bit vectors:
// per row and block in K order, group4's arithmetic lane for lane -- Q4_0 acc = fma(wd, fma(dot,
// xd, xc), acc) with xc = -8 * xs; Q4_1 acc = fma(wd, dot * xd, acc), then acc = fma(wm, xs, acc)
// -- so the floats are the x8 kernels' bit for bit. Eight-column tiles (one group each) ran at
// 0.56-0.86x the VNNI kernel at 4-8 rows: TDPBSSD costs about the same whatever the tile's size.
// Tiles: C 0..3 (four pairs of groups), A 4, B 5 and 6 alternating. Q8_0 (above) runs the same
// step with its chunks copied where the 4-bit codes are unpacked (x8_pair_step).

constexpr int kPairCols = 2 * kX8Rows;  // weight rows (C columns) per tile: two groups

// The block formats x8_pair_step runs.
enum class X8Fmt { kQ4_0, kQ4_1, kQ8_0 };

// One block of two groups' codes (128 bytes each at p0, p1; p1 null: zeros) -> the pair's B tile
// bytes at dst: row q (K quad q) = group 0's eight columns, then group 1's.
inline void unpack_q4x8_pair(const uint8_t* p0, const uint8_t* p1, int8_t* dst) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + 32 * c));
    const __m256i hi = p1 != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + 32 * c))
                                     : _mm256_setzero_si256();
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    _mm512_store_si512(dst + 64 * c, _mm512_and_si512(v, mask));
    _mm512_store_si512(dst + 64 * (4 + c), _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
  }
}

// One block of two Q8_0 groups (eight 32-byte chunks each at p0, p1; p1 null: zeros) -> the pair's
// B tile bytes at dst: row c (K quad c) = group 0's chunk c, then group 1's.
inline void copy_q8x8_pair(const uint8_t* p0, const uint8_t* p1, int8_t* dst) {
  for (int c = 0; c < 8; ++c) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + 32 * c));
    const __m256i hi = p1 != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + 32 * c))
                                     : _mm256_setzero_si256();
    _mm512_store_si512(dst + 64 * c, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
  }
}

// The eight fp16 at p0 and the eight at p1 (p1 null: zeros) as 16 floats.
inline __m512 fp16_pair(const uint8_t* p0, const uint8_t* p1) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0));
  const __m128i b = p1 != nullptr ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)) : _mm_setzero_si128();
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
}

// P pairs of groups from group g0 (the last pair a lone group when `lone`) against activation
// rows [m0, m0 + mc).
template <X8Fmt F, int P>
void x8_pair_step(const X8Call& c, X8Tiles& tiles, int64_t g0, int64_t m0, int mc, bool lone) {
  constexpr bool kQ8 = F == X8Fmt::kQ8_0;
  constexpr int kScaleBytes = F == X8Fmt::kQ4_1 ? 32 : 16;  // eight fp16 d (and Q4_1's eight fp16 m)
  constexpr int kBlockBytes = kScaleBytes + (kQ8 ? 256 : 128);
  // Eight streams at once: about 1.1-1.2 KB ahead (eight 4-bit blocks, four Q8_0 ones) keeps each
  // stream's lines in flight.
  constexpr int64_t kAhead = (kQ8 ? 4 : 8) * kBlockBytes;
  tiles.shape(mc, kPairCols);
  const uint8_t* w = c.w + g0 * c.group_bytes;
  const int8_t* xq = c.xq + m0 * c.K;
  const float* xd = c.xd + m0 * c.nb;
  const float* xc = kQ8 ? nullptr : c.xc + m0 * c.nb;
  // Group j of the step (2p, 2p + 1), its block b's bytes; null for the lone pair's missing one.
  const auto block = [&](int j, int64_t b) -> const uint8_t* {
    if (lone && j == 2 * P - 1) return nullptr;
    return w + j * c.group_bytes + b * kBlockBytes;
  };
  __m512 acc[P][kRows];
  for (int p = 0; p < P; ++p) {
    for (int m = 0; m < kRows; ++m) acc[p][m] = _mm512_setzero_ps();
  }
  // Software-pipelined through two buffers of each: block b's codes are unpacked during block
  // b - 1, and block b's dots are read (the fp32 step) during block b + 1, so neither the tile
  // loads of just-stored bytes nor the vector loads of a just-stored tile wait on their stores.
  alignas(64) int8_t codes[2][P][kQ8Block * kPairCols];
  // Not cleared (8 KB a call, 5 % of this kernel's time at 8 rows): a tile store writes its mc
  // rows, and the fp32 step reads only those.
  alignas(64) int32_t dots[2][P][kRows][kPairCols];
  const auto unpack = [&](int64_t b) {
    for (int p = 0; p < P; ++p) {
      const uint8_t *b0 = block(2 * p, b), *b1 = block(2 * p + 1, b);
      for (int64_t line = 0; line < kBlockBytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(b0 + kAhead + line), _MM_HINT_T0);
        if (b1 != nullptr) _mm_prefetch(reinterpret_cast<const char*>(b1 + kAhead + line), _MM_HINT_T0);
      }
      if constexpr (kQ8) {
        copy_q8x8_pair(b0 + kScaleBytes, b1 != nullptr ? b1 + kScaleBytes : nullptr, codes[b & 1][p]);
      } else {
        unpack_q4x8_pair(b0 + kScaleBytes, b1 != nullptr ? b1 + kScaleBytes : nullptr, codes[b & 1][p]);
      }
    }
  };
  const auto fp32_step = [&](int64_t b) {
    __m512 wd[P], wm[P];
    for (int p = 0; p < P; ++p) {
      const uint8_t *b0 = block(2 * p, b), *b1 = block(2 * p + 1, b);
      wd[p] = fp16_pair(b0, b1);
      if constexpr (F == X8Fmt::kQ4_1) wm[p] = fp16_pair(b0 + 16, b1 != nullptr ? b1 + 16 : nullptr);
    }
    for (int m = 0; m < mc; ++m) {
      const __m512 xdm = _mm512_set1_ps(xd[m * c.nb + b]);
      const __m512 xcm = kQ8 ? _mm512_setzero_ps() : _mm512_set1_ps(xc[m * c.nb + b]);
      for (int p = 0; p < P; ++p) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots[b & 1][p][m]));
        if constexpr (F == X8Fmt::kQ4_0) {
          acc[p][m] = _mm512_fmadd_ps(wd[p], _mm512_fmadd_ps(dot, xdm, xcm), acc[p][m]);
        } else {
          acc[p][m] = _mm512_fmadd_ps(wd[p], _mm512_mul_ps(dot, xdm), acc[p][m]);
          if constexpr (F == X8Fmt::kQ4_1) acc[p][m] = _mm512_fmadd_ps(wm[p], xcm, acc[p][m]);
        }
      }
    }
  };
  unpack(0);
  for (int64_t b = 0; b < c.nb; ++b) {
    if (b + 1 < c.nb) unpack(b + 1);
    compiler_barrier();  // the stores above (and the last block's), then the tile loads that read them
    const int h = static_cast<int>(b & 1);
    _tile_loadd(4, xq + b * kQ8Block, c.K);
#define PW_Q4X8_PAIR(p, t)                              \
  if constexpr (P > p) {                                \
    _tile_zero(p);                                      \
    _tile_loadd(t, codes[h][p], kPairCols * 4);         \
    _tile_dpbssd(p, 4, t);                              \
    _tile_stored(p, dots[h][p], kPairCols * 4);         \
  }
    PW_Q4X8_PAIR(0, 5)
    PW_Q4X8_PAIR(1, 6)
    PW_Q4X8_PAIR(2, 5)
    PW_Q4X8_PAIR(3, 6)
#undef PW_Q4X8_PAIR
    compiler_barrier();
    if (b > 0) fp32_step(b - 1);
  }
  compiler_barrier();
  fp32_step(c.nb - 1);
  for (int p = 0; p < P; ++p) {
    const int64_t col = (g0 + 2 * p) * kX8Rows;
    const bool half = lone && p == P - 1;
    const __mmask16 keep = half ? 0x00FF : 0xFFFF;
    const __m512 bv = c.bias != nullptr ? _mm512_maskz_loadu_ps(keep, c.bias + col) : _mm512_setzero_ps();
    for (int m = 0; m < mc; ++m) {
      _mm512_mask_storeu_ps(c.out + (m0 + m) * c.ldo + col, keep, _mm512_add_ps(acc[p][m], bv));
    }
  }
}

// Every unit (an x8 group, or a pair of them) against every chunk of 16 activation rows, four
// units a step (one C tile each); a static split over the units (each thread streams one
// contiguous slice of the weight). step(tiles, count, u, m0, mc) runs `count` (1..4) units from
// u; unit_values (K times the unit's weight rows) sizes the parallel threshold.
// Called inside a team (float_rows.h fused_linear), each thread runs its own slice in that team.
template <class Step>
void for_x8_units(int64_t M, int64_t unit_values, int64_t units, const Step& step) {
  const auto slice = [&] {
    X8Tiles tiles;
    int64_t u0, u1;
    my_slice(units, &u0, &u1);
    for (int64_t u = u0; u < u1; u += kGroups) {
      const int count = static_cast<int>(std::min<int64_t>(kGroups, u1 - u));
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        step(tiles, count, u, m0, static_cast<int>(std::min<int64_t>(kRows, M - m0)));
      }
    }
  };
  if (in_team_kernel()) {
    slice();
    return;
  }
#pragma omp parallel if (units * unit_values * M >= 65536)
  slice();
}

template <X8Fmt F>
void run_x8_pairs(const X8Call& call, int64_t M, int64_t K, int64_t groups) {
  // Units of two groups (an odd count's last unit a lone group).
  const int64_t pairs = (groups + 1) / 2;
  for_x8_units(M, K * kPairCols, pairs, [&](X8Tiles& tiles, int count, int64_t p, int64_t m0, int mc) {
    const bool lone = p + count == pairs && groups % 2 == 1;
    switch (count) {
      case 4: x8_pair_step<F, 4>(call, tiles, 2 * p, m0, mc, lone); break;
      case 3: x8_pair_step<F, 3>(call, tiles, 2 * p, m0, mc, lone); break;
      case 2: x8_pair_step<F, 2>(call, tiles, 2 * p, m0, mc, lone); break;
      default: x8_pair_step<F, 1>(call, tiles, 2 * p, m0, mc, lone); break;
    }
  });
}

}  // namespace

void linear_q8_0x8_amx(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N) {
  const int64_t M = x.M, K = x.K, groups = N / kX8Rows;
  if (M <= 0 || groups <= 0) return;
  const int64_t nb = K / kQ8Block;
  const X8Call call{w, bias, out, ldo, K, nb, kX8Rows * nb * kQ8BlockBytes, x.q, x.d};
  run_x8_pairs<X8Fmt::kQ8_0>(call, M, K, groups);
}

void linear_q4x8_amx(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                     int64_t ldo, int64_t N) {
  const int64_t M = x.M, K = x.K, groups = N / kX8Rows;
  if (M <= 0 || groups <= 0) return;
  const int64_t nb = K / kQ8Block;
  const float* xc = x.s;
  if (t == Q4Type::kQ4_0) {
    // As run4 (x8_body.h): per calling thread, reused; the workers read it through the call.
    thread_local std::vector<float> offset;
    if (static_cast<int64_t>(offset.size()) < M * nb) offset.resize(M * nb);
    for (int64_t i = 0; i < M * nb; ++i) offset[i] = -8.f * x.s[i];  // exact: a power of two
    xc = offset.data();
  }
  const X8Call call{w, bias, out, ldo, K, nb, kX8Rows * nb * q4_block_bytes(t), x.q, x.d, xc};
  if (t == Q4Type::kQ4_0) {
    run_x8_pairs<X8Fmt::kQ4_0>(call, M, K, groups);
  } else {
    run_x8_pairs<X8Fmt::kQ4_1>(call, M, K, groups);
  }
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
