// Small-batch bf16 GEMV/GEMM for CPU decode on AVX2+FMA (x [M, K] @ w[N, K]^T, M up to ~16),
// for CPUs without AVX512-BF16 (Zen 2/3, Haswell to Alder Lake). Bandwidth-bound by design: each
// weight cache line is read from memory once and reused by every row of x from L1.
//
// bf16 -> fp32 costs one integer op per 8 weights: a 256-bit load of 16 bf16 values gives the
// even-indexed ones by a 16-bit left shift and the odd-indexed ones by masking off the low half.
// x is converted to fp32 once per call in the same even/odd order, so every FMA pairs matching
// elements; the dot product doesn't care about the order in which it sums.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// Headers first: inline functions they define must keep the baseline ISA.
#include "linear_kernel.h"
#include "team_kernel.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "avx2_util.h"
#include "bf16_avx2.h"

namespace pagewire::cpu {
namespace {

constexpr int kPrefetchRows = 8;  // weight rows ahead of the loads (a couple of blocks)

using avx2::hsum;

// MB rows of x (fp32, prepared) against NR weight rows: MB * NR fp32 accumulators; each weight
// vector is widened once and used by all MB rows, each x vector is loaded once per 16 k and used
// by all NR weight rows. MB = 2, NR = 4 needs 8 accumulators + 4 x + 2 weight registers of 16.
template <int MB, int NR>
inline void block(const float* xf, const uint16_t* w, int64_t K, const uint16_t* bias, uint16_t* out, int64_t ldo,
                  bool prefetch) {
  const int64_t K16 = K & ~int64_t{15};
  const __m256i lo_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) acc[m][i] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K16; k += 16) {
    __m256 xe[MB], xo[MB];
    for (int m = 0; m < MB; ++m) {
      xe[m] = _mm256_loadu_ps(xf + m * K + k);
      xo[m] = _mm256_loadu_ps(xf + m * K + k + 8);
    }
    for (int i = 0; i < NR; ++i) {
      const uint16_t* wr = w + i * K + k;
      // One prefetch per 64-byte line, kPrefetchRows rows ahead: the hardware prefetcher tracks
      // only so many streams, and NR rows are NR streams.
      if (prefetch && (k & 31) == 0) _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchRows * K), _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, lo_mask));
      for (int m = 0; m < MB; ++m) {
        acc[m][i] = _mm256_fmadd_ps(xe[m], we, acc[m][i]);
        acc[m][i] = _mm256_fmadd_ps(xo[m], wo, acc[m][i]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) {
      float s = hsum(acc[m][i]);
      for (int64_t k = K16; k < K; ++k) s += xf[m * K + k] * bf16_to_float(w[i * K + k]);
      if (bias != nullptr) s += bf16_to_float(bias[i]);
      out[m * ldo + i] = float_to_bf16(s);
    }
  }
}

// All M rows of x against NR weight rows: pairs of x rows (the weight rows stay in L1 between
// passes), then a last single row when M is odd.
template <int NR>
inline void rows_block(const float* xf, const uint16_t* w, int64_t K, const uint16_t* bias, uint16_t* out,
                       int64_t ldo, int64_t M) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) block<2, NR>(xf + m * K, w, K, bias, out + m * ldo, ldo, m == 0);
  if (m < M) block<1, NR>(xf + m * K, w, K, bias, out + m * ldo, ldo, m == 0);
}

template <int NR>
void run_blocks(const float* xf, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t M,
                int64_t N, int64_t K) {
  const int64_t blocks = N / NR;
  // Static schedule: each thread streams one contiguous slice of the weight, which the hardware
  // prefetcher follows; blocks cost the same, so nothing is gained by dynamic scheduling.
  // Threads from 64 K multiply-adds (every linear kernel uses this rule, counted in elements, not
  // blocks): one core alone streams about 8 GB/s here, two about 15, and waking the second costs a
  // few microseconds, so even a 576 x 576 bf16 projection (0.66 MB) gains 1.7x (81 -> 47 us,
  // bench/RESULTS.md).
  // (team_for: on a decode step's crew, crew.h, the crew takes the shares: a sparse layer's router.)
  team_for(blocks, N * K * M >= 65536, [&](int64_t b) {
    const int64_t n = b * NR;
    rows_block<NR>(xf, w + n * K, K, bias ? bias + n : nullptr, out + n, ldo, M);
  });
  for (int64_t n = blocks * NR; n < N; ++n) {  // the last N % NR rows
    rows_block<1>(xf, w + n * K, K, bias ? bias + n : nullptr, out + n, ldo, M);
  }
}

// fp32 weights: MB rows of x against NR weight rows, x and w both fp32 in natural order. The
// same accumulation as the bf16 block above (one 8-lane accumulator per output, two FMAs per 16
// k, hsum, then the scalar tail), so a row's result never depends on MB, NR or the other rows:
// this is the batch-invariant fp32 path of deterministic mode (server/kernels/ops.py).
template <int MB, int NR>
inline void block_f32(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* out,
                      int64_t ldo, bool prefetch) {
  const int64_t K16 = K & ~int64_t{15};
  __m256 acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) acc[m][i] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K16; k += 16) {
    __m256 xa[MB], xb[MB];
    for (int m = 0; m < MB; ++m) {
      xa[m] = _mm256_loadu_ps(x + m * ldx + k);
      xb[m] = _mm256_loadu_ps(x + m * ldx + k + 8);
    }
    for (int i = 0; i < NR; ++i) {
      const float* wr = w + i * K + k;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchRows * K), _MM_HINT_T0);
      const __m256 wa = _mm256_loadu_ps(wr);
      const __m256 wb = _mm256_loadu_ps(wr + 8);
      for (int m = 0; m < MB; ++m) {
        acc[m][i] = _mm256_fmadd_ps(xa[m], wa, acc[m][i]);
        acc[m][i] = _mm256_fmadd_ps(xb[m], wb, acc[m][i]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) {
      float s = hsum(acc[m][i]);
      for (int64_t k = K16; k < K; ++k) s += x[m * ldx + k] * w[i * K + k];
      if (bias != nullptr) s += bias[i];
      out[m * ldo + i] = s;
    }
  }
}

template <int NR>
inline void rows_block_f32(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* out,
                           int64_t ldo, int64_t M) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) block_f32<2, NR>(x + m * ldx, ldx, w, K, bias, out + m * ldo, ldo, m == 0);
  if (m < M) block_f32<1, NR>(x + m * ldx, ldx, w, K, bias, out + m * ldo, ldo, m == 0);
}

// Rows of x per pass over the weight: 64 fp32 rows of K <= 4096 stay in L2 while every weight
// block streams past them once, so prefill-sized M costs M / 64 passes over the weight.
constexpr int64_t kF32RowTile = 64;

}  // namespace

void linear_f32_avx2(const float* x, int64_t ldx, const float* w, const float* bias, float* out, int64_t ldo,
                     int64_t M, int64_t N, int64_t K) {
  constexpr int NR = 4;
  const int64_t blocks = N / NR;
  for (int64_t m0 = 0; m0 < M; m0 += kF32RowTile) {
    const int64_t rows = std::min(kF32RowTile, M - m0);
    const float* xt = x + m0 * ldx;
    float* ot = out + m0 * ldo;
#pragma omp parallel for schedule(static) if (N * K * rows >= 65536)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n = b * NR;
      rows_block_f32<NR>(xt, ldx, w + n * K, K, bias ? bias + n : nullptr, ot + n, ldo, rows);
    }
    for (int64_t n = blocks * NR; n < N; ++n) {
      rows_block_f32<1>(xt, ldx, w + n * K, K, bias ? bias + n : nullptr, ot + n, ldo, rows);
    }
  }
}

void linear_bf16_avx2(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                      int64_t ldo, int64_t M, int64_t N, int64_t K) {
  // Per calling thread (the engine thread), reused across calls: no allocation per decode step.
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < M * K) scratch.resize(M * K);
  prepare_x(x, ldx, M, K, scratch.data());
  // One row of x has few FMAs per weight vector: 8 weight rows per block keep more loads in flight.
  if (M == 1) {
    run_blocks<8>(scratch.data(), w, bias, out, ldo, M, N, K);
  } else {
    run_blocks<4>(scratch.data(), w, bias, out, ldo, M, N, K);
  }
}

}  // namespace pagewire::cpu

#pragma GCC pop_options
