// Eight bf16 values as fp32 lanes for the AVX2 fused-op bodies (fused_avx2.cpp, fused_rows_avx2.cpp):
// widen, round to nearest even (NaN stays NaN, torch's rule) and narrow, bit for bit what the
// portable from_f / to_f of fused_ops.cpp give. Include it after the file's target switch to
// "avx2,fma".
#pragma once

#include "x86_target.h"  // <immintrin.h>, or nothing in emulated builds

#include <cstdint>

namespace pagewire::cpu {
namespace {

inline __m256 load_bf16(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// Round to nearest even as 32-bit lanes holding the bf16 bits in their low half (NaN kept NaN).
inline __m256i round_bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, nan, is_nan);
}

inline __m256 round_bf16(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16_bits(v), 16)); }

inline void store_bf16(uint16_t* p, __m256 v) {
  const __m256i bits = round_bf16_bits(v);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

}  // namespace
}  // namespace pagewire::cpu
