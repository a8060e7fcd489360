// Small-batch bf16 GEMV/GEMM on AVX2+FMA over the interleaved x8 layout (linear_kernel.h): eight
// weight rows per group, each 16-value chunk of the eight rows stored together (256 bytes), so a
// thread's share of the weight is one sequential stream. The row-layout kernel (linear_avx2.cpp)
// reads eight rows side by side, eight streams of K * 2 bytes each, which on a 576-wide model
// (1,152-byte rows) end before the hardware prefetcher is up to speed: at M = 1 with two threads this
// kernel moved 1.0-1.6x its bytes per second there (the 49152-row lm_head 1.57x); from K = 1536 the
// eight streams keep up and the row layout stays (BF16_X8_MAX_K, bench/RESULTS.md, session 18).
//
// Arithmetic: exactly the row-layout kernel's per output (bf16_avx2.h): x widened in even/odd
// order, acc = fma(x_even, w_even, acc); acc = fma(x_odd, w_odd, acc) per chunk in K order,
// avx2::hsum, the bias, one round-to-nearest-even. The tiles differ (eight rows against one x row;
// four rows against two x rows) but never a row's arithmetic, so the result is bitwise the
// row-layout kernel's, whatever M, the tile or the thread count (deterministic mode relies on it).
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

// Headers first: inline functions they define must keep the baseline ISA.
#include "bf16z_layout.h"
#include "linear_kernel.h"
#include "team_kernel.h"  // (before the target switch: std headers)
#include "x86_target.h"

PAGEWIRE_TARGET_PUSH("avx2,fma,f16c")

#include "avx2_util.h"
#include "bf16_avx2.h"

namespace pagewire::cpu {
namespace {

constexpr int64_t kRows = kBf16Interleave;         // rows per group
constexpr int64_t kChunkBytes = 16 * 2 * kRows;     // one chunk of a group: 256 bytes, four lines
// How far ahead of its loads the stream prefetches (four chunks): a one-core prototype moved
// 15.4-18.9 GB/s at 1 KB ahead, 13.2-16.7 with none, 13.2-17.8 at 2 KB and 4 KB (3072 x 576, M = 1).
constexpr int64_t kPrefetchBytes = 1024;

inline __m256 even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 odd(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline __m256i load(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline uint16_t finish(__m256 acc, const uint16_t* bias, int64_t r) {
  float s = avx2::hsum(acc);
  if (bias != nullptr) s += bf16_to_float(bias[r]);
  return float_to_bf16(s);
}

// The group's eight rows against one x row: eight accumulators, the group read front to back.
inline void group_x1(const float* xf, const uint16_t* g, int64_t K, const uint16_t* bias, uint16_t* out,
                     bool prefetch) {
  __m256 acc[kRows];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const uint16_t* c = g + k * kRows;
    if (prefetch) {
      for (int64_t l = 0; l < kChunkBytes; l += 64) avx2::prefetch(reinterpret_cast<const uint8_t*>(c) + kPrefetchBytes + l);
    }
    const __m256 xe = _mm256_loadu_ps(xf + k), xo = _mm256_loadu_ps(xf + k + 8);
    for (int r = 0; r < kRows; ++r) {
      const __m256i v = load(c + 16 * r);
      acc[r] = _mm256_fmadd_ps(xe, even(v), acc[r]);
      acc[r] = _mm256_fmadd_ps(xo, odd(v), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = finish(acc[r], bias, r);
}

// Rows 4h..4h+3 of the group against two x rows: 8 accumulators + 4 x + the weight vector.
inline void group_x2(const float* xf, int64_t K, const uint16_t* g, int h, const uint16_t* bias, uint16_t* out,
                     int64_t ldo) {
  __m256 acc[2][4];
  for (auto& row : acc) {
    for (auto& a : row) a = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += 16) {
    const uint16_t* c = g + k * kRows + 64 * h;
    const __m256 xe0 = _mm256_loadu_ps(xf + k), xo0 = _mm256_loadu_ps(xf + k + 8);
    const __m256 xe1 = _mm256_loadu_ps(xf + K + k), xo1 = _mm256_loadu_ps(xf + K + k + 8);
    for (int r = 0; r < 4; ++r) {
      const __m256i v = load(c + 16 * r);
      const __m256 we = even(v), wo = odd(v);
      acc[0][r] = _mm256_fmadd_ps(xe0, we, acc[0][r]);
      acc[0][r] = _mm256_fmadd_ps(xo0, wo, acc[0][r]);
      acc[1][r] = _mm256_fmadd_ps(xe1, we, acc[1][r]);
      acc[1][r] = _mm256_fmadd_ps(xo1, wo, acc[1][r]);
    }
  }
  for (int m = 0; m < 2; ++m) {
    for (int r = 0; r < 4; ++r) out[m * ldo + 4 * h + r] = finish(acc[m][r], bias, 4 * h + r);
  }
}

// One row-layout row (the last N % 8 rows) against one x row, the same arithmetic.
inline uint16_t row_x1(const float* xf, const uint16_t* w, int64_t K, const uint16_t* bias, int64_t r) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m256i v = load(w + k);
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k), even(v), acc);
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(xf + k + 8), odd(v), acc);
  }
  return finish(acc, bias, r);
}

// x's rows in fp32, even/odd order per chunk (prepare_x), in the calling thread's buffer (the engine
// thread's, reused across calls: no allocation per decode step).
inline const float* widened_x(const uint16_t* x, int64_t ldx, int64_t M, int64_t K) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < M * K) scratch.resize(M * K);
  prepare_x(x, ldx, M, K, scratch.data());
  return scratch.data();
}

// x rows 1 .. M - 1 against a group in the x8 layout that the first row's pass brought into L1/L2:
// pairs of rows reuse each weight vector twice, then a last single row.
inline void later_rows(const float* xf, int64_t K, const uint16_t* g, const uint16_t* b, uint16_t* o, int64_t ldo,
                       int64_t M) {
  int64_t m = 1;
  for (; m + 2 <= M; m += 2) {
    group_x2(xf + m * K, K, g, 0, b, o + m * ldo, ldo);
    group_x2(xf + m * K, K, g, 1, b, o + m * ldo, ldo);
  }
  if (m < M) group_x1(xf + m * K, g, K, b, o + m * ldo, false);
}

// The last N % 8 rows (rows done .. N - 1, in row layout from w), against every x row.
inline void tail_rows(const float* xf, const uint16_t* w, int64_t done, int64_t N, int64_t M, int64_t K,
                      const uint16_t* bias, uint16_t* out, int64_t ldo) {
  for (int64_t n = done; n < N; ++n) {
    for (int64_t m = 0; m < M; ++m) out[m * ldo + n] = row_x1(xf + m * K, w + (n - done) * K, K, bias, n);
  }
}

// ---- The packed layout (bf16z_layout.h) ----

// Row pair q of the packed step at p as four x8 chunk vectors: v[0] row 2q's first chunk, v[1] its
// second, v[2] and v[3] row 2q + 1's. vpshufb and vpunpck work within 128-bit lanes, so the 512-bit
// kernel's lanes 0-1 (row 2q) are one ymm here and lanes 2-3 (row 2q + 1) another: the same bytes.
inline void unpack_pair(const uint8_t* p, int q, __m256i t_even, __m256i t_odd, __m256i (&v)[4]) {
  const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + bf16z::kCodesAt + q * 32));
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i hi0 = _mm256_shuffle_epi8(t_even, _mm256_and_si256(codes, nib));
  const __m256i hi1 = _mm256_shuffle_epi8(t_odd, _mm256_and_si256(_mm256_srli_epi16(codes, 4), nib));
  const __m256i lo0 = load(reinterpret_cast<const uint16_t*>(p + q * 64));
  const __m256i lo1 = load(reinterpret_cast<const uint16_t*>(p + q * 64 + 32));
  v[0] = _mm256_unpacklo_epi8(lo0, hi0);
  v[1] = _mm256_unpackhi_epi8(lo0, hi0);
  v[2] = _mm256_unpacklo_epi8(lo1, hi1);
  v[3] = _mm256_unpackhi_epi8(lo1, hi1);
}

// Each row's table in both 128-bit lanes (vpshufb looks up within a lane).
inline void load_tables(const bf16z::Group& G, __m256i (&table)[kRows]) {
  for (int r = 0; r < kRows; ++r) {
    table[r] = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(G.tables + r * 16)));
  }
}

// Row pair q of step s at p, packed or (rare) raw: the x8 layout's two chunks.
inline void step_pair(const uint8_t* p, bool raw, int q, const __m256i (&table)[kRows], __m256i (&v)[4]) {
  if (!raw) {
    unpack_pair(p, q, table[2 * q], table[2 * q + 1], v);
    return;
  }
  const uint16_t* c = reinterpret_cast<const uint16_t*>(p);
  v[0] = load(c + 32 * q);
  v[1] = load(c + 128 + 32 * q);
  v[2] = load(c + 32 * q + 16);
  v[3] = load(c + 128 + 32 * q + 16);
}

// The packed group's eight rows against one x row, group_x1's arithmetic step by step (each
// accumulator takes its row's chunks in K order); with `keep`, the unpacked group is also stored in
// the x8 layout there, for the other x rows' tiles.
inline void packed_x1(const float* xf, const bf16z::Group& G, int64_t K, const uint16_t* bias, uint16_t* out,
                      uint16_t* keep) {
  __m256 acc[kRows];
  for (auto& a : acc) a = _mm256_setzero_ps();
  __m256i table[kRows];
  load_tables(G, table);
  const uint8_t* p = G.steps;
  const int64_t chunks = K / 16;
  for (int64_t s = 0; s < chunks / 2; ++s) {
    const bool raw = G.is_raw(s);
    const int64_t bytes = G.step_bytes(s);
    for (int64_t l = 0; l < bytes; l += 64) avx2::prefetch(p + kPrefetchBytes + l);
    const int64_t k = 32 * s;
    const __m256 xe0 = _mm256_loadu_ps(xf + k), xo0 = _mm256_loadu_ps(xf + k + 8);
    const __m256 xe1 = _mm256_loadu_ps(xf + k + 16), xo1 = _mm256_loadu_ps(xf + k + 24);
    for (int q = 0; q < 4; ++q) {
      __m256i v[4];
      step_pair(p, raw, q, table, v);
      for (int h = 0; h < 2; ++h) {
        const int r = 2 * q + h;
        acc[r] = _mm256_fmadd_ps(xe0, even(v[2 * h]), acc[r]);
        acc[r] = _mm256_fmadd_ps(xo0, odd(v[2 * h]), acc[r]);
        acc[r] = _mm256_fmadd_ps(xe1, even(v[2 * h + 1]), acc[r]);
        acc[r] = _mm256_fmadd_ps(xo1, odd(v[2 * h + 1]), acc[r]);
        if (keep != nullptr) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(keep + (2 * s * kRows + r) * 16), v[2 * h]);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(keep + ((2 * s + 1) * kRows + r) * 16), v[2 * h + 1]);
        }
      }
    }
    p += bytes;
  }
  if (chunks % 2) {  // the last chunk, in the x8 layout
    const int64_t k = K - 16;
    const uint16_t* c = reinterpret_cast<const uint16_t*>(p);
    const __m256 xe = _mm256_loadu_ps(xf + k), xo = _mm256_loadu_ps(xf + k + 8);
    for (int r = 0; r < kRows; ++r) {
      const __m256i v = load(c + 16 * r);
      acc[r] = _mm256_fmadd_ps(xe, even(v), acc[r]);
      acc[r] = _mm256_fmadd_ps(xo, odd(v), acc[r]);
    }
    if (keep != nullptr) std::memcpy(keep + (chunks - 1) * 16 * kRows, c, kChunkBytes);
  }
  for (int r = 0; r < kRows; ++r) out[r] = finish(acc[r], bias, r);
}

}  // namespace

void linear_bf16x8_avx2(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                        int64_t ldo, int64_t M, int64_t N, int64_t K) {
  const float* xf = widened_x(x, ldx, M, K);
  const int64_t groups = N / kRows;
  // Static schedule: each thread streams one contiguous run of groups. Threads from 64 K
  // multiply-adds, as every linear kernel (linear_avx2.cpp says why).
  // (team_for: on a decode step's crew, crew.h, the crew takes the shares.)
  team_for(groups, N * K * M >= 65536, [&](int64_t gi) {
    const uint16_t* g = w + gi * kRows * K;
    const uint16_t* b = bias != nullptr ? bias + gi * kRows : nullptr;
    uint16_t* o = out + gi * kRows;
    // The first x row streams the group from memory front to back, prefetched (the pair tiles read
    // half of each chunk, a strided pattern the prefetchers follow badly); then pairs of rows reuse
    // each weight vector twice from L1/L2, and a last single row.
    group_x1(xf, g, K, b, o, true);
    later_rows(xf, K, g, b, o, ldo, M);
  });
  tail_rows(xf, w + groups * kRows * K, groups * kRows, N, M, K, bias, out, ldo);
}

namespace bf16z {

void linear_bf16z_avx2(const uint16_t* x, int64_t ldx, const uint8_t* packed, const uint16_t* bias, uint16_t* out,
                       int64_t ldo, int64_t M) {
  const Header& h = header(packed);
  const int64_t N = h.n, K = h.k, groups = h.groups;
  const float* xf = widened_x(x, ldx, M, K);
  team_for(groups, N * K * M >= 65536, [&](int64_t gi) {
    const Group G(packed, gi, K);
    const uint16_t* b = bias != nullptr ? bias + gi * kRows : nullptr;
    uint16_t* o = out + gi * kRows;
    // The first x row streams the packed group; with more rows it also leaves the group unpacked
    // in this thread's x8 copy (L1 / L2), which linear_bf16x8_avx2's tiles read for the others.
    uint16_t* group = M > 1 ? group_scratch(K) : nullptr;
    packed_x1(xf, G, K, b, o, group);
    later_rows(xf, K, group, b, o, ldo, M);
  });
  tail_rows(xf, reinterpret_cast<const uint16_t*>(packed + h.tail_at), groups * kRows, N, M, K, bias, out, ldo);
}

void unpack_bf16z_avx2(const uint8_t* packed, int64_t g0, int64_t g1, uint16_t* dst) {
  const int64_t K = header(packed).k, chunks = K / 16;
  for (int64_t g = g0; g < g1; ++g) {
    const Group G(packed, g, K);
    uint16_t* rows = dst + (g - g0) * kRows * K;
    auto put = [&](int r, int64_t c, __m256i v) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows + r * K + c * 16), v);
    };
    __m256i table[kRows];
    load_tables(G, table);
    const uint8_t* p = G.steps;
    for (int64_t s = 0; s < chunks / 2; ++s) {
      const bool raw = G.is_raw(s);
      for (int q = 0; q < 4; ++q) {
        __m256i v[4];
        step_pair(p, raw, q, table, v);
        for (int h = 0; h < 2; ++h) {
          put(2 * q + h, 2 * s, v[2 * h]);
          put(2 * q + h, 2 * s + 1, v[2 * h + 1]);
        }
      }
      p += G.step_bytes(s);
    }
    if (chunks % 2) {
      for (int r = 0; r < kRows; ++r) std::memcpy(rows + r * K + (chunks - 1) * 16, p + r * 32, 32);
    }
  }
}

}  // namespace bf16z
}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
