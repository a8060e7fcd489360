// Q8_0 weight x Q8 activation GEMV/GEMM on AVX2 (see quant_kernel.h for the layout): integer dot
// products of 32 int8 pairs with maddubs/madd, then one fp32 FMA per block with the product of
// the two scales. The weight streams from memory once (34 bytes per 32 values, 53% of bf16's
// bytes) and every block is reused by all M activation rows while it is in registers.
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>

// Headers first: inline functions they define must keep the baseline ISA.
#include "quant_kernel.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "avx2_util.h"

namespace pagewire::cpu {
namespace {

constexpr int kPrefetchRows = 8;

using avx2::hsum;

// Eight int32 partial sums of w . x over 32 int8 pairs. maddubs needs an unsigned operand: |w|
// (precomputed, at most 127) times x with w's sign moved onto it; pairs sum to at most 2 * 127 *
// 127, so the 16-bit intermediate never saturates.
inline __m256i dot32(__m256i abs_w, __m256i w, __m256i x) {
  const __m256i sx = _mm256_sign_epi8(x, w);
  const __m256i p16 = _mm256_maddubs_epi16(abs_w, sx);
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

template <int MB, int NR>
inline void block(const Q8Activations& x, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias,
                  float* out, int64_t ldo, bool prefetch) {
  const int64_t nb = x.K / kQ8Block;
  __m256 acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) acc[m][i] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i xq[MB];
    float xd[MB];
    for (int m = 0; m < MB; ++m) {
      xq[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (m0 + m) * x.K + b * kQ8Block));
      xd[m] = x.d[(m0 + m) * nb + b];
    }
    for (int i = 0; i < NR; ++i) {
      const uint8_t* blk = w + i * row_bytes + b * kQ8BlockBytes;
      if (prefetch && (b & 1) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchRows * row_bytes), _MM_HINT_T0);
      }
      uint16_t dh;
      std::memcpy(&dh, blk, 2);
      const float wd = _cvtsh_ss(dh);
      const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      const __m256i aw = _mm256_abs_epi8(wq);
      for (int m = 0; m < MB; ++m) {
        const __m256 p = _mm256_cvtepi32_ps(dot32(aw, wq, xq[m]));
        acc[m][i] = _mm256_fmadd_ps(p, _mm256_set1_ps(wd * xd[m]), acc[m][i]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) {
      out[(m0 + m) * ldo + i] = hsum(acc[m][i]) + (bias != nullptr ? bias[i] : 0.f);
    }
  }
}

template <int NR>
inline void rows_block(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, const float* bias, float* out,
                       int64_t ldo) {
  int64_t m = 0;
  for (; m + 2 <= x.M; m += 2) block<2, NR>(x, m, w, row_bytes, bias, out, ldo, m == 0);
  if (m < x.M) block<1, NR>(x, m, w, row_bytes, bias, out, ldo, m == 0);
}

}  // namespace

void linear_q8_0_avx2(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                      int64_t N) {
  constexpr int NR = 4;
  const int64_t row_bytes = x.K / kQ8Block * kQ8BlockBytes;
  const int64_t blocks = N / NR;
  // Static schedule: each thread streams one contiguous slice of the weight.
#pragma omp parallel for schedule(static) if (blocks * x.K * x.M >= 65536)
  for (int64_t bi = 0; bi < blocks; ++bi) {
    const int64_t n = bi * NR;
    rows_block<NR>(x, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr, out + n, ldo);
  }
  for (int64_t n = blocks * NR; n < N; ++n) {
    rows_block<1>(x, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr, out + n, ldo);
  }
}

}  // namespace pagewire::cpu

#pragma GCC pop_options
