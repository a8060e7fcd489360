// AVX-512 helpers shared by the CPU attention kernels: fp32 <-> storage-type vector conversions,
// a vector exp and a 16x16 register transpose.
//
// Include only inside a `#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma")` region
// of a translation unit whose callers check cpu::active_isa() (cpu_features.h); everything here has internal linkage.
#pragma once

#include "x86_target.h"  // <immintrin.h>, or nothing in emulated builds

#include "elem.h"

namespace pagewire::cpu {
namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const Bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const Fp16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(Bf16* p, __m512 v) {  // round to nearest even, like the generic path
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store16(Fp16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp(x) for x <= 0 (scores minus their running max) to ~1 ulp; lanes below -87 (including -inf
// from masking) are exactly 0.
inline __m512 exp512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // Cody-Waite: r = x - n*ln2 in two parts keeps r exact enough for a short polynomial.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

// In-register transpose of a 16x16 fp32 tile: rows[i][j] -> rows[j][i].
inline void transpose16(__m512 (&x)[16]) {
  __m512 t[16], u[16], v[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]);
  }
  // u[4q + c], lane k = column 4k + c of rows 4q..4q+3
  for (int q = 0; q < 4; ++q) {
    const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * q + 1]), d = _mm512_castps_pd(t[4 * q + 3]);
    u[4 * q + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
    v[4 + c] = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    v[8 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    v[12 + c] = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
  }
  for (int c = 0; c < 4; ++c) {
    x[c] = _mm512_shuffle_f32x4(v[c], v[8 + c], 0x88);
    x[8 + c] = _mm512_shuffle_f32x4(v[c], v[8 + c], 0xDD);
    x[4 + c] = _mm512_shuffle_f32x4(v[4 + c], v[12 + c], 0x88);
    x[12 + c] = _mm512_shuffle_f32x4(v[4 + c], v[12 + c], 0xDD);
  }
}

}  // namespace
}  // namespace pagewire::cpu
