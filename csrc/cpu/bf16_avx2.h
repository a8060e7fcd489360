// The bf16 helpers of the AVX2 bf16 kernels (linear_avx2.cpp: row layout; linear_bf16x8_avx2.cpp:
// the interleaved x8 layout). Both compute each output the same way (x widened once per call in
// even/odd order, one 8-lane FMA chain per output over 16-value chunks, avx2::hsum, a scalar tail,
// the bias, one rounding), so the two layouts give the same bits. Include it after the file's
// target switch to "avx2,fma,f16c".
#pragma once

#include <cstdint>
#include <cstring>

#include "avx2_util.h"

namespace pagewire::cpu {
namespace {

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
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// x rows converted to fp32: the first K16 = K & ~15 values of each row in even/odd order per
// 16-chunk (x[0], x[2], .., x[14], x[1], x[3], .., x[15]), the K - K16 tail values as they are.
inline void prepare_x(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, float* xf) {
  const int64_t K16 = K & ~int64_t{15};
  const __m256i lo_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xr = x + m * ldx;
    float* out = xf + m * K;
    for (int64_t k = 0; k < K16; k += 16) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + k));
      _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      _mm256_storeu_ps(out + k + 8, _mm256_castsi256_ps(_mm256_and_si256(v, lo_mask)));
    }
    for (int64_t k = K16; k < K; ++k) out[k] = bf16_to_float(xr[k]);
  }
}

}  // namespace
}  // namespace pagewire::cpu
