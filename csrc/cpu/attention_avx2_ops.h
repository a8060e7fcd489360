// The AVX2 paged-attention kernel's vector micro-kernels (attention_avx2.cpp holds its driver):
// 8-lane loads and stores of each cache type, exp, the fixed add trees of the batch-invariance
// contract (attention_avx2.cpp says why they hold it), and the QK, soft-cap, mask, online-softmax
// and PV steps on one span. Include only inside attention_avx2.cpp's "avx2,fma,f16c" target region;
// everything here has internal linkage.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "attention_kernel.h"
#include "elem.h"

namespace pagewire::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int round8(int n) { return (n + 7) & ~7; }

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const Fp16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(Bf16* p, __m256 v) {  // round to nearest even, NaN stays NaN (elem.h's rule)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(Fp16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp(x) for x <= 0 (scores minus their running max) to ~1 ulp; lanes below -87 (including -inf
// from masking) are exactly 0. Cody-Waite reduction x = n ln2 + r, degree-7 Taylor for e^r, 2^n
// built in the exponent bits (n >= -126, so 2^n is a normal number).
inline __m256 exp8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

// The fixed add tree of the invariance contract, for four 8-lane accumulators at once:
// lane i of the result = ((a_i[0]+a_i[1])+(a_i[2]+a_i[3])) + ((a_i[4]+a_i[5])+(a_i[6]+a_i[7])).
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

inline float reduce1(__m256 a) {
  const __m256 z = _mm256_setzero_ps();
  return _mm_cvtss_f32(reduce4(a, z, z, z));
}

inline float hmax(__m256 v) {  // max is exact, so its order does not matter
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// s[r][c0+i] = q[r] . k_rows[c0+i] for R rows and four columns: 4R accumulators, each key vector
// loaded (and widened, for a 16-bit S) once per 8 d and shared by the R rows.
template <int R, class S>
inline void qk_block(const float* q, int D, const S* const* k, float* s) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  }
  for (int d = 0; d < D; d += 8) {
    __m256 kv[4];
    for (int i = 0; i < 4; ++i) kv[i] = load8(k[i] + d);
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * D + d);
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_fmadd_ps(qv, kv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) _mm_storeu_ps(s + r * kSpan, reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

// Scores of `rows` rows against ncols (a multiple of 8) keys: blocks of three rows (12 of the 16
// registers accumulate), then a block of the remainder.
// Each block of four columns also takes `steps` steps of the next unit's prefetch (at).
template <class S>
inline void qk(const float* q, int rows, int D, const S* const* k_rows, int ncols, float* s,
               NextUnitPrefetch::Cursor& at, int steps) {
  for (int c = 0; c < ncols; c += 4) {
    for (int i = 0; i < steps; ++i) at.step();
    int r = 0;
    for (; r + 3 <= rows; r += 3) qk_block<3, S>(q + r * D, D, k_rows + c, s + r * kSpan + c);
    if (rows - r == 2) qk_block<2, S>(q + r * D, D, k_rows + c, s + r * kSpan + c);
    if (rows - r == 1) qk_block<1, S>(q + r * D, D, k_rows + c, s + r * kSpan + c);
  }
}

// s[r][c] = cap * tanh(s[r][c] / cap) for `rows` rows of ncols (a multiple of 8) scores: logit
// soft-capping. tanh|y| = (1 - e) / (1 + e) with e = exp(-2|y|) <= 1 (exp8's domain), the sign put
// back from y; absolute error ~1e-7 * cap. Elementwise, so it keeps the invariance contract.
inline void cap_scores(float* s, int rows, int ncols, float cap) {
  const __m256 c = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.f / cap);
  const __m256 one = _mm256_set1_ps(1.f), m2 = _mm256_set1_ps(-2.f), sign = _mm256_set1_ps(-0.f);
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < ncols; j += 8) {
      float* p = s + r * kSpan + j;
      const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(p), inv);
      const __m256 e = exp8(_mm256_mul_ps(m2, _mm256_andnot_ps(sign, y)));
      const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
      _mm256_storeu_ps(p, _mm256_mul_ps(c, _mm256_or_ps(t, _mm256_and_ps(sign, y))));
    }
  }
}

// Scores outside [lo, hi) become -inf.
inline void mask_row(float* srow, int ncols, int lo, int hi) {
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  const __m256i lo_v = _mm256_set1_epi32(lo), hi_v = _mm256_set1_epi32(hi);
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int c = 0; c < ncols; c += 8) {
    // visible = idx >= lo && idx < hi  <=>  !(lo > idx) && (hi > idx)
    const __m256i vis = _mm256_andnot_si256(_mm256_cmpgt_epi32(lo_v, idx), _mm256_cmpgt_epi32(hi_v, idx));
    _mm256_storeu_ps(srow + c, _mm256_blendv_ps(ninf, _mm256_loadu_ps(srow + c), _mm256_castsi256_ps(vis)));
    idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8));
  }
}

// Online-softmax update of one row: scores become probabilities relative to the new running max;
// *alpha moves the row's accumulator to that max (applied in pv). Sums run over the 8-lane vectors
// in column order, then the fixed tree: trailing all-masked vectors add exact zeros.
inline void softmax_row(float* srow, int ncols, float* m, float* l, float* alpha) {
  __m256 mv = _mm256_set1_ps(*m);
  for (int c = 0; c < ncols; c += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(srow + c));
  const float mx = hmax(mv);
  if (mx == kNegInf) {  // nothing visible to this row yet
    for (int c = 0; c < ncols; c += 8) _mm256_storeu_ps(srow + c, _mm256_setzero_ps());
    *alpha = 1.f;
    return;
  }
  const __m256 mb = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (int c = 0; c < ncols; c += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(srow + c), mb));
    _mm256_storeu_ps(srow + c, p);
    sum = _mm256_add_ps(sum, p);
  }
  *alpha = std::exp(*m - mx);
  *l = *l * *alpha + reduce1(sum);
  *m = mx;
}

// acc[r][d0 + 8i ..] = alpha[r] * acc + sum_{j0 <= j < j1} p[r][j] * v_rows[j][d0 + 8i ..], j in
// order, for R rows and NV 8-lane vectors of d.
template <int R, int NV, class S>
inline void pv_block(const float* p, const float* alpha, int D, const S* const* v, int j0, int j1, int d0,
                     float* acc) {
  __m256 a[R][NV];
  for (int r = 0; r < R; ++r) {
    const __m256 al = _mm256_set1_ps(alpha[r]);
    for (int i = 0; i < NV; ++i) a[r][i] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d0 + 8 * i), al);
  }
  for (int j = j0; j < j1; ++j) {
    __m256 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load8(v[j] + d0 + 8 * i);
    for (int r = 0; r < R; ++r) {
      const __m256 pj = _mm256_broadcast_ss(p + r * kSpan + j);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm256_fmadd_ps(pj, vv[i], a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + r * D + d0 + 8 * i, a[r][i]);
  }
}

template <int R, class S>
inline void pv_rows(const float* p, const float* alpha, int D, const S* const* v, int j0, int j1, float* acc) {
  int d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) pv_block<R, 4, S>(p, alpha, D, v, j0, j1, d0, acc);
  switch ((D - d0) / 8) {
    case 3:
      pv_block<R, 3, S>(p, alpha, D, v, j0, j1, d0, acc);
      break;
    case 2:
      pv_block<R, 2, S>(p, alpha, D, v, j0, j1, d0, acc);
      break;
    case 1:
      pv_block<R, 1, S>(p, alpha, D, v, j0, j1, d0, acc);
      break;
    default:
      break;
  }
}

template <class S>
inline void pv(const float* p, const float* alpha, int rows, int D, const S* const* v, int j0, int j1,
               float* acc) {
  int r = 0;
  for (; r + 2 <= rows; r += 2) pv_rows<2, S>(p + r * kSpan, alpha + r, D, v, j0, j1, acc + r * D);
  if (r < rows) pv_rows<1, S>(p + r * kSpan, alpha + r, D, v, j0, j1, acc + r * D);
}

}  // namespace
}  // namespace pagewire::cpu
