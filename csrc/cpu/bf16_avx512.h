// The AVX512-BF16 kernels' epilogue (linear_avx512.cpp: row layout; linear_bf16x8_avx512.cpp: the
// interleaved x8 layout). Both accumulate each output in 16 fp32 lanes, lane i holding the
// vdpbf16ps pair sums of values 32t + 2i and 32t + 2i + 1 in t order, and finish four outputs at a
// time through store4's one shuffle tree, so the two layouts give the same bits. Include it after
// the file's target switch to "avx512f,avx512bw,avx512vl,avx512bf16,fma".
#pragma once

#include <cstdint>

namespace pagewire::cpu {
namespace {

// out[0..3] = bf16(horizontal sums of a[0..3] + bias[0..3]): one shuffle tree for four sums
// instead of four separate reductions (the epilogue matters once M grows). The tree never mixes
// lanes of different accumulators, so a sum does not depend on its three neighbours.
inline void store4(const __m512 (&a)[4], const uint16_t* bias, uint16_t* out) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  // Each 128-bit lane now holds partial sums of a0, a1, a2, a3 in that order.
  __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, 0x4E));
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, 0xB1));
  __m128 sum = _mm512_castps512_ps128(s);
  if (bias != nullptr) {
    const __m128i b = _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bias)));
    sum = _mm_add_ps(sum, _mm_castsi128_ps(_mm_slli_epi32(b, 16)));
  }
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), (__m128i)_mm_cvtneps_pbh(sum));
}

}  // namespace
}  // namespace pagewire::cpu
