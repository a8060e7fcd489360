// Small-batch bf16 and Q8_0 linear kernels on Intel AMX (Isa::kAmx: Sapphire Rapids and later),
// x [M, K] @ w[N, K]^T, same contracts as linear_bf16_avx512 and linear_q8_0_portable. (Q8_0 in the x8
// layout has its own AMX kernel, as have Q4_0 and Q4_1: linear_x8_amx.cpp; the tile plumbing they
// share is amx_tiles.h.)
//
// Both compute the transpose, C^T[n][m] = W X^T, so the weight is read where it lies: a weight
// tile ("A", src1) is 16 weight rows x 64 bytes loaded straight from w with the row stride, which
// is exactly AMX's A layout (row n, pairs / quads of consecutive k). The activation tile ("B",
// src2) must hold x transposed in k-pairs (bf16) or k-quads (int8): B row r = for each m the 4
// bytes of x[m] at k = 2r (bf16) or 4r (int8). That transpose of x is made once per call by the
// calling thread, before the parallel region, and shared by every thread and weight tile; it costs
// M * K elements against the N * K of the weight. An output tile C is 16 weight rows x up to 16
// activation rows; M > 16 runs in chunks of 16 rows, each weight block (4 x 16 rows) being
// reused from L2 by every chunk before the next block is read.
//
// Tiles (palette 1): C 0..3 (four groups of 16 weight rows per step, so one B load serves four
// tile products), B 4, A 5 and 6 alternating. Tile numbers are literals because GCC's intrinsics
// paste them into the instruction text. N % 16: the last group of the call runs under a config with
// fewer rows. K % 32 (bf16): the last, partial k-step copies its weight bytes into a zero-padded
// 16 x 64-byte scratch, and the transposed x is zero-padded to a whole step, so no load reads past
// a row and the config never changes in the middle of an accumulation. Q8_0 needs no tail: a
// block is exactly one 32-byte A tile row.
//
// bf16: C accumulates across all of K in the tile (TDPBF16PS, fp32), stored once per (group,
// chunk), + bias in fp32, rounded to bf16 (nearest even). Each C element is one fp32 chain over k
// in order, two fused steps per k-pair.
// Q8_0: per block, TDPBSSD into a zeroed C gives the exact int32 dot of the signed weight and
// activation bytes; it is stored, converted to fp32 and accumulated with AVX-512 as
// acc += float(dot) * (wd * xd), a separate multiply and add, block by block in K order: the
// portable kernel's arithmetic, operation for operation. Accumulators are one zmm per weight row
// with the (up to 16) activation rows in its lanes, the C tile's own layout, so nothing is gathered.
//
// Batch invariance (docs/determinism.md): every output (m, n) is computed by its own C element and
// accumulator lane with the same sequence of operations whatever M is, which rows share its tile,
// which chunk or thread it falls in, or whether its weight row is in a tail group. M only decides
// how many lanes of a tile are live.
//
// Every thread that runs tile code loads its own config (tile state is per thread) and releases it
// before leaving the parallel region. The OS permission is requested in cpu_features.cpp.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// Headers first: inline functions they define must keep the baseline ISA.
#include "amx_tiles.h"
#include "linear_kernel.h"
#include "quant_kernel.h"
#include "x86_target.h"

// GCC 12's own intrinsic headers trip -Wmaybe-uninitialized (the _mm256_undefined_* idiom).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
PAGEWIRE_TARGET_PUSH("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")

namespace pagewire::cpu {
namespace {

using amx::compiler_barrier;
using amx::kGroups;
using amx::kRows;
using amx::my_slice;
using amx::TileConfig;

constexpr int kBf16Step = 32;     // k per bf16 A tile (64 bytes)
constexpr int kPrefetchBytes = 512;  // how far ahead along each weight row (untuned)

// One thread's current tile shape: C tiles r x mc, B tile b_rows x mc, A tiles r x a_colsb.
class Tiles {
 public:
  Tiles(int b_rows, int a_colsb) : b_rows_(b_rows), a_colsb_(a_colsb) {}
  ~Tiles() {
    if (loaded_) _tile_release();
  }
  void shape(int r, int mc) {
    if (loaded_ && r == r_ && mc == mc_) return;
    TileConfig cfg;
    for (int t = 0; t < kGroups; ++t) {
      cfg.rows[t] = static_cast<uint8_t>(r);
      cfg.colsb[t] = static_cast<uint16_t>(mc * 4);
    }
    cfg.rows[4] = static_cast<uint8_t>(b_rows_);
    cfg.colsb[4] = static_cast<uint16_t>(mc * 4);
    for (int t = 5; t <= 6; ++t) {
      cfg.rows[t] = static_cast<uint8_t>(r);
      cfg.colsb[t] = static_cast<uint16_t>(a_colsb_);
    }
    compiler_barrier();
    _tile_loadconfig(&cfg);
    loaded_ = true;
    r_ = r;
    mc_ = mc;
  }

 private:
  int b_rows_, a_colsb_, r_ = 0, mc_ = 0;
  bool loaded_ = false;
};

// Stops GCC contracting a multiply and the add that uses it into one FMA (it does so across
// intrinsics under its default -ffp-contract=fast once the target has FMA): the Q8 arithmetic must
// round as the portable kernel's. The emulated build has no FMA target, so nothing to stop there.
inline __m512 rounded(__m512 v) {
#ifndef PAGEWIRE_X86_EMULATE
  asm("" : "+v"(v));
#endif
  return v;
}

inline void prefetch_rows(const uint8_t* p, int64_t stride, int rows) {
  for (int i = 0; i < rows; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + i * stride), _MM_HINT_T0);
}

// ---------------------------------------------------------------------------------------------
// bf16

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN (torch's rule)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

struct Bf16Call {
  const uint16_t* w;
  const uint16_t* bias;
  uint16_t* out;
  int64_t ldo, M, K;
  const uint32_t* xt;  // x transposed in k-pairs, chunk c at xt + c * kpairs * 16: [kpairs][mc]
  int64_t kpairs;      // K rounded up to a whole step, over 2
};

// G groups of r weight rows from n0 (r < 16 only for the call's last group, G = 1 then) against
// activation rows [m0, m0 + mc).
template <int G>
void bf16_step(const Bf16Call& c, Tiles& tiles, int64_t n0, int r, int64_t m0, int mc) {
  tiles.shape(r, mc);
  const int64_t K = c.K, lda = K * 2, full = K / kBf16Step, tail = K % kBf16Step;
  const uint16_t* w = c.w + n0 * K;
  const uint32_t* xt = c.xt + (m0 / kRows) * c.kpairs * kRows;
  const int64_t ldb = mc * 4;
  if constexpr (G > 0) _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  if constexpr (G > 3) _tile_zero(3);
  // Group g's A tile at k: rows n0 + 16 g .., prefetched kPrefetchBytes ahead along each row.
#define PW_BF16_GROUP(g, a)                                                                 \
  if constexpr (G > g) {                                                                    \
    const uint16_t* wa = w + g * kRows * K + k;                                             \
    prefetch_rows(reinterpret_cast<const uint8_t*>(wa) + kPrefetchBytes, lda, r);           \
    _tile_loadd(a, wa, lda);                                                                \
    _tile_dpbf16ps(g, a, 4);                                                                \
  }
  for (int64_t s = 0; s < full; ++s) {
    const int64_t k = s * kBf16Step;
    _tile_loadd(4, xt + s * kRows * mc, ldb);
    PW_BF16_GROUP(0, 5)
    PW_BF16_GROUP(1, 6)
    PW_BF16_GROUP(2, 5)
    PW_BF16_GROUP(3, 6)
  }
#undef PW_BF16_GROUP
  if (tail != 0) {
    // The partial step: each group's last K % 32 values per row, zero-padded to 64 bytes (the
    // transposed x is zero there too, so the padding adds exact zeros).
    alignas(64) uint16_t scratch[G][kRows][kBf16Step];
    std::memset(scratch, 0, sizeof scratch);
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < r; ++i) std::memcpy(scratch[g][i], w + (g * kRows + i) * K + full * kBf16Step, tail * 2);
    }
    compiler_barrier();
    _tile_loadd(4, xt + full * kRows * mc, ldb);
#define PW_BF16_TAIL(g, a)             \
  if constexpr (G > g) {               \
    _tile_loadd(a, scratch[g], 64);    \
    _tile_dpbf16ps(g, a, 4);           \
  }
    PW_BF16_TAIL(0, 5)
    PW_BF16_TAIL(1, 6)
    PW_BF16_TAIL(2, 5)
    PW_BF16_TAIL(3, 6)
#undef PW_BF16_TAIL
  }
  alignas(64) float acc[G][kRows][kRows];
  if constexpr (G > 0) _tile_stored(0, acc[0], 64);
  if constexpr (G > 1) _tile_stored(1, acc[1], 64);
  if constexpr (G > 2) _tile_stored(2, acc[2], 64);
  if constexpr (G > 3) _tile_stored(3, acc[3], 64);
  compiler_barrier();
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < r; ++i) {
      const int64_t n = n0 + g * kRows + i;
      for (int m = 0; m < mc; ++m) {
        const float v = acc[g][i][m];
        c.out[(m0 + m) * c.ldo + n] = float_to_bf16(c.bias != nullptr ? v + bf16_to_float(c.bias[n]) : v);
      }
    }
  }
}

// This thread's groups of 16 weight rows [g0, g1), kGroups at a time, each against every chunk of
// activation rows; the call's N % 16 leftover rows go to whoever has the last group.
template <typename Step>
void for_my_groups(int64_t N, int64_t M, Step&& step) {
  const int64_t groups = N / kRows, tail = N % kRows;
  int64_t g0, g1;
  my_slice(groups, &g0, &g1);
  const bool last = omp_get_thread_num() == omp_get_num_threads() - 1;
  for (int64_t g = g0; g < g1; g += kGroups) {
    const int count = static_cast<int>(std::min<int64_t>(kGroups, g1 - g));
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      step(count, g * kRows, kRows, m0, static_cast<int>(std::min<int64_t>(kRows, M - m0)));
    }
  }
  if (last && tail != 0) {
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      step(1, groups * kRows, static_cast<int>(tail), m0, static_cast<int>(std::min<int64_t>(kRows, M - m0)));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Q8_0

struct Q8Call {
  const uint8_t* w;
  const float* bias;
  float* out;
  int64_t ldo, M, nb, row_bytes;
  const uint32_t* xt;  // per chunk: [nb * 8][mc] dwords of xq, at xt + c * nb * 8 * 16
  const float* xd;     // per chunk: [nb][16] activation scales (0 past mc), at xd + c * nb * 16
};

template <int G>
void q8_step(const Q8Call& c, Tiles& tiles, int64_t n0, int r, int64_t m0, int mc) {
  tiles.shape(r, mc);
  const int64_t chunk = m0 / kRows, rb = c.row_bytes, ldb = mc * 4;
  const uint8_t* w = c.w + n0 * rb;
  const uint32_t* xt = c.xt + chunk * c.nb * 8 * kRows;
  const float* xd = c.xd + chunk * c.nb * kRows;
  __m512 acc[G][kRows];
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < kRows; ++i) acc[g][i] = _mm512_setzero_ps();
  }
  // Columns past mc are never stored by the tiles: zero once, they then only add 0 * 0 to lanes
  // nobody reads.
  alignas(64) int32_t dots[G][kRows][kRows];
  std::memset(dots, 0, sizeof dots);
  compiler_barrier();
  for (int64_t b = 0; b < c.nb; ++b) {
    const int64_t off = b * kQ8BlockBytes;
    _tile_loadd(4, xt + b * 8 * mc, ldb);
#define PW_Q8_GROUP(g, a)                                                      \
  if constexpr (G > g) {                                                       \
    const uint8_t* wa = w + g * kRows * rb + off;                              \
    prefetch_rows(wa + kPrefetchBytes, rb, r);                                 \
    _tile_zero(g);                                                             \
    _tile_loadd(a, wa + 2, rb);                                                \
    _tile_dpbssd(g, a, 4);                                                     \
  }
    PW_Q8_GROUP(0, 5)
    PW_Q8_GROUP(1, 6)
    PW_Q8_GROUP(2, 5)
    PW_Q8_GROUP(3, 6)
#undef PW_Q8_GROUP
    if constexpr (G > 0) _tile_stored(0, dots[0], 64);
    if constexpr (G > 1) _tile_stored(1, dots[1], 64);
    if constexpr (G > 2) _tile_stored(2, dots[2], 64);
    if constexpr (G > 3) _tile_stored(3, dots[3], 64);
    compiler_barrier();
    const __m512 xs = _mm512_loadu_ps(xd + b * kRows);
    for (int g = 0; g < G; ++g) {
      const uint8_t* wb = w + g * kRows * rb + off;
      for (int i = 0; i < r; ++i) {
        uint16_t dh;
        std::memcpy(&dh, wb + i * rb, 2);
        // As the portable kernel: (wd * xd) rounded, times the dot rounded, added rounded.
        const __m512 s = rounded(_mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(dh)), xs));
        const __m512 d = _mm512_cvtepi32_ps(_mm512_load_si512(dots[g][i]));
        acc[g][i] = _mm512_add_ps(acc[g][i], rounded(_mm512_mul_ps(d, s)));
      }
    }
  }
  alignas(64) float res[kRows];
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < r; ++i) {
      const int64_t n = n0 + g * kRows + i;
      _mm512_store_ps(res, acc[g][i]);
      const float bn = c.bias != nullptr ? c.bias[n] : 0.f;
      for (int m = 0; m < mc; ++m) c.out[(m0 + m) * c.ldo + n] = res[m] + bn;
    }
  }
}

}  // namespace

void linear_bf16_amx(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                     int64_t ldo, int64_t M, int64_t N, int64_t K) {
  if (M <= 0 || N <= 0) return;
  const int64_t steps = (K + kBf16Step - 1) / kBf16Step, kpairs = steps * kBf16Step / 2;
  const int64_t chunks = (M + kRows - 1) / kRows;
  // x in AMX's B layout, chunk by chunk: dword (p, m) = x[m][2p] | x[m][2p + 1] << 16, zero past K.
  static thread_local std::vector<uint32_t> xt_buf;
  xt_buf.assign(static_cast<size_t>(chunks * kpairs * kRows), 0u);
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const int64_t m0 = ch * kRows, mc = std::min<int64_t>(kRows, M - m0);
    uint32_t* dst = xt_buf.data() + ch * kpairs * kRows;
    for (int64_t m = 0; m < mc; ++m) {
      const uint16_t* xr = x + (m0 + m) * ldx;
      for (int64_t p = 0; p < K / 2; ++p) dst[p * mc + m] = xr[2 * p] | static_cast<uint32_t>(xr[2 * p + 1]) << 16;
      if (K % 2 != 0) dst[(K / 2) * mc + m] = xr[K - 1];
    }
  }
  const Bf16Call call{w, bias, out, ldo, M, K, xt_buf.data(), kpairs};
  // Static split over N (each thread streams one contiguous slice of the weight).
#pragma omp parallel if (N * K * M >= 65536)
  {
    Tiles tiles(kBf16Step / 2, kBf16Step * 2);
    for_my_groups(N, M, [&](int count, int64_t n0, int r, int64_t m0, int mc) {
      switch (count) {
        case 4: bf16_step<4>(call, tiles, n0, r, m0, mc); break;
        case 3: bf16_step<3>(call, tiles, n0, r, m0, mc); break;
        case 2: bf16_step<2>(call, tiles, n0, r, m0, mc); break;
        default: bf16_step<1>(call, tiles, n0, r, m0, mc); break;
      }
    });
  }
}

void linear_q8_0_amx(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                     int64_t N) {
  const int64_t M = x.M, K = x.K;
  if (M <= 0 || N <= 0) return;
  const int64_t nb = K / kQ8Block, chunks = (M + kRows - 1) / kRows;
  // The activations in AMX's B layout (dword (8 b + r, m) = xq[m][32 b + 4 r .. + 3]) and their
  // scales with the activation rows in the lanes, chunk by chunk.
  static thread_local std::vector<uint32_t> xt_buf;
  static thread_local std::vector<float> xd_buf;
  xt_buf.assign(static_cast<size_t>(chunks * nb * 8 * kRows), 0u);
  xd_buf.assign(static_cast<size_t>(chunks * nb * kRows), 0.f);
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const int64_t m0 = ch * kRows, mc = std::min<int64_t>(kRows, M - m0);
    uint32_t* dst = xt_buf.data() + ch * nb * 8 * kRows;
    float* dd = xd_buf.data() + ch * nb * kRows;
    for (int64_t m = 0; m < mc; ++m) {
      const int8_t* xr = x.q + (m0 + m) * K;
      for (int64_t p = 0; p < nb * 8; ++p) std::memcpy(&dst[p * mc + m], xr + 4 * p, 4);
      for (int64_t b = 0; b < nb; ++b) dd[b * kRows + m] = x.d[(m0 + m) * nb + b];
    }
  }
  const Q8Call call{w, bias, out, ldo, M, nb, nb * kQ8BlockBytes, xt_buf.data(), xd_buf.data()};
#pragma omp parallel if (N * K * M >= 65536)
  {
    Tiles tiles(kQ8Block / 4, kQ8Block);
    for_my_groups(N, M, [&](int count, int64_t n0, int r, int64_t m0, int mc) {
      switch (count) {
        case 4: q8_step<4>(call, tiles, n0, r, m0, mc); break;
        case 3: q8_step<3>(call, tiles, n0, r, m0, mc); break;
        case 2: q8_step<2>(call, tiles, n0, r, m0, mc); break;
        default: q8_step<1>(call, tiles, n0, r, m0, mc); break;
      }
    });
  }
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
