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
#include <vector>

// Headers first: inline functions they define must keep the baseline ISA.
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

}  // namespace

void linear_bf16x8_avx2(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                        int64_t ldo, int64_t M, int64_t N, int64_t K) {
  // Per calling thread (the engine thread), reused across calls: no allocation per decode step.
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < M * K) scratch.resize(M * K);
  prepare_x(x, ldx, M, K, scratch.data());
  const float* xf = scratch.data();
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
    int64_t m = 1;
    for (; m + 2 <= M; m += 2) {
      group_x2(xf + m * K, K, g, 0, b, o + m * ldo, ldo);
      group_x2(xf + m * K, K, g, 1, b, o + m * ldo, ldo);
    }
    if (m < M) group_x1(xf + m * K, g, K, b, o + m * ldo, false);
  });
  for (int64_t n = groups * kRows; n < N; ++n) {
    for (int64_t m = 0; m < M; ++m) out[m * ldo + n] = row_x1(xf + m * K, w + n * K, K, bias, n);
  }
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
