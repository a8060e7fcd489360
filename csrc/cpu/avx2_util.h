// Small AVX2 helpers shared by the AVX2 kernel files (linear_avx2.cpp, linear_q8_avx2.cpp,
// linear_q4_avx2.cpp). Include it after the file's `#pragma GCC target("avx2,fma,f16c")`.
#pragma once

#include <immintrin.h>

namespace pagewire::cpu::avx2 {

// The sum of v's eight lanes, in one fixed order: deterministic mode (docs/determinism.md) relies
// on every kernel reducing an output the same way for every row count.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace pagewire::cpu::avx2
