// AVX-512 micro-kernels for CPU paged attention (16 fp32 lanes per vector), compiled for that
// ISA via a target pragma and chosen at runtime, so the .so still loads on CPUs without it.
#include <immintrin.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <vector>

// Library headers come before the pragma: inline functions from them must keep the baseline ISA,
// or the linker could pick an AVX-512 copy for code that runs on older CPUs.
#include "attention_kernel.h"
#include "elem.h"

namespace pagewire::cpu {
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
         __builtin_cpu_supports("fma");
}
}  // namespace pagewire::cpu

// GCC 12's own intrinsic headers trip -Wmaybe-uninitialized (the _mm256_undefined_* idiom).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma")

#include "attention_tile.h"

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

// s[r][16i:16i+16] = sum_d q[r][d] * kt[d][16i:16i+16] for RB rows and NV column vectors:
// RB * NV accumulators, and each K vector loaded once per d is shared by all RB rows.
template <int RB, int NV>
inline void qk_rows(const float* q, int64_t D, const float* kt, float* s) {
  __m512 acc[RB][NV];
  const float* qr[RB];
  for (int r = 0; r < RB; ++r) {
    qr[r] = q + r * D;
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < D; ++d) {
    __m512 k[NV];
    for (int i = 0; i < NV; ++i) k[i] = _mm512_load_ps(kt + d * kSpan + 16 * i);
    for (int r = 0; r < RB; ++r) {
      const __m512 qv = _mm512_set1_ps(qr[r][d]);
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_fmadd_ps(qv, k[i], acc[r][i]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int i = 0; i < NV; ++i) _mm512_store_ps(s + r * kSpan + 16 * i, acc[r][i]);
  }
}

// Row blocks as large as the register file allows (about 24 accumulators), then one smaller
// block for the remainder, so a 4-row decode tile is a single block.
template <int NV, int RB = 24 / NV>
inline void qk_all(const float* q, int rows, int64_t D, const float* kt, float* s) {
  if constexpr (RB > 0) {
    int r = 0;
    if (rows >= RB) {
      for (; r + RB <= rows; r += RB) qk_rows<RB, NV>(q + r * D, D, kt, s + r * kSpan);
      if (r < rows) qk_all<NV, RB - 1>(q + r * D, rows - r, D, kt, s + r * kSpan);
    } else {
      qk_all<NV, RB - 1>(q, rows, D, kt, s);
    }
  }
}

// acc[r][16i..] = alpha[r] * acc[r][16i..] + sum_{j<n} p[r][j] * v[j][16i..] for RB rows and NV
// vectors of D.
template <int RB, int NV>
inline void pv_block(const float* p, const float* alpha, int64_t D, const float* v, int n, float* acc) {
  __m512 a[RB][NV];
  for (int r = 0; r < RB; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int i = 0; i < NV; ++i) a[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * i), al);
  }
  for (int j = 0; j < n; ++j) {
    __m512 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = _mm512_loadu_ps(v + j * D + 16 * i);
    for (int r = 0; r < RB; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r * kSpan + j]);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_fmadd_ps(pj, vv[i], a[r][i]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + r * D + 16 * i, a[r][i]);
  }
}

template <int RB>
inline void pv_rows(const float* p, const float* alpha, int64_t D, const float* v, int n, float* acc) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) pv_block<RB, 4>(p, alpha, D, v + d0, n, acc + d0);
  switch ((D - d0) / 16) {
    case 3:
      pv_block<RB, 3>(p, alpha, D, v + d0, n, acc + d0);
      break;
    case 2:
      pv_block<RB, 2>(p, alpha, D, v + d0, n, acc + d0);
      break;
    case 1:
      pv_block<RB, 1>(p, alpha, D, v + d0, n, acc + d0);
      break;
    default:
      break;
  }
}

template <int RB = 6>
inline void pv_all(const float* p, const float* alpha, int rows, int64_t D, const float* v, int n, float* acc) {
  if constexpr (RB > 0) {
    int r = 0;
    if (rows >= RB) {
      for (; r + RB <= rows; r += RB) pv_rows<RB>(p + r * kSpan, alpha + r, D, v, n, acc + r * D);
      if (r < rows) pv_all<RB - 1>(p + r * kSpan, alpha + r, rows - r, D, v, n, acc + r * D);
    } else {
      pv_all<RB - 1>(p, alpha, rows, D, v, n, acc);
    }
  }
}

template <int NV>
inline void softmax_row(float* srow, float* m, float* l, float* alpha) {
  __m512 sv[NV];
  __m512 mv = _mm512_set1_ps(*m);
  for (int i = 0; i < NV; ++i) {
    sv[i] = _mm512_load_ps(srow + 16 * i);
    mv = _mm512_max_ps(mv, sv[i]);
  }
  const float mx = _mm512_reduce_max_ps(mv);
  if (mx == -std::numeric_limits<float>::infinity()) {  // nothing visible yet in this row
    for (int i = 0; i < NV; ++i) _mm512_store_ps(srow + 16 * i, _mm512_setzero_ps());
    *alpha = 1.f;
    return;
  }
  const __m512 mb = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < NV; ++i) {
    const __m512 pv = exp512(_mm512_sub_ps(sv[i], mb));
    _mm512_store_ps(srow + 16 * i, pv);
    sum = _mm512_add_ps(sum, pv);
  }
  *alpha = std::exp(*m - mx);
  *l = *l * *alpha + _mm512_reduce_add_ps(sum);
  *m = mx;
}

struct Avx512Isa {
  template <class E>
  static void load_q(const E* src, int D, float scale, float* dst) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(load16(src + d), sc));
  }

  // kt[d][j] = K[j][d] for j < n (zero up to the next multiple of 16), via 16x16 register transposes.
  template <class E>
  static void load_k(const E* const* k_rows, int n, int D, float* kt) {
    for (int c = 0; c < n; c += 16) {
      for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 x[16];
        for (int j = 0; j < 16; ++j) x[j] = c + j < n ? load16(k_rows[c + j] + d0) : _mm512_setzero_ps();
        transpose16(x);
        for (int i = 0; i < 16; ++i) _mm512_store_ps(kt + (d0 + i) * kSpan + c, x[i]);
      }
    }
  }

  template <class E>
  static void load_v(const E* const* v_rows, int n, int D, float* v) {
    for (int j = 0; j < n; ++j) {
      for (int d = 0; d < D; d += 16) _mm512_storeu_ps(v + j * D + d, load16(v_rows[j] + d));
    }
  }

  static void qk(const float* q, int rows, int D, const float* kt, int nw, float* s) {
    switch (nw / 16) {
      case 4:
        return qk_all<4>(q, rows, D, kt, s);
      case 3:
        return qk_all<3>(q, rows, D, kt, s);
      case 2:
        return qk_all<2>(q, rows, D, kt, s);
      default:
        return qk_all<1>(q, rows, D, kt, s);
    }
  }

  static void mask_row(float* srow, int nw, int lo, int hi) {
    // Bit j set = column j visible.
    const uint64_t below_hi = hi >= 64 ? ~0ull : (hi <= 0 ? 0ull : (1ull << hi) - 1);
    const uint64_t below_lo = lo >= 64 ? ~0ull : (lo <= 0 ? 0ull : (1ull << lo) - 1);
    const uint64_t visible = below_hi & ~below_lo;
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int c = 0; c < nw; c += 16) {
      const __mmask16 k = static_cast<__mmask16>(visible >> c);
      _mm512_store_ps(srow + c, _mm512_mask_mov_ps(ninf, k, _mm512_load_ps(srow + c)));
    }
  }

  static void softmax_step(float* srow, int nw, float* m, float* l, float* alpha) {
    switch (nw / 16) {
      case 4:
        return softmax_row<4>(srow, m, l, alpha);
      case 3:
        return softmax_row<3>(srow, m, l, alpha);
      case 2:
        return softmax_row<2>(srow, m, l, alpha);
      default:
        return softmax_row<1>(srow, m, l, alpha);
    }
  }

  static void pv(const float* p, const float* alpha, int rows, int D, const float* v, int n, float* acc) {
    pv_all(p, alpha, rows, D, v, n, acc);
  }

  template <class E>
  static void store_o(const float* acc, float inv_l, int D, E* dst) {
    const __m512 s = _mm512_set1_ps(inv_l);
    for (int d = 0; d < D; d += 16) store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), s));
  }
};

}  // namespace

void paged_attention_avx512(const PagedAttentionArgs& args) { dispatch_paged_attention<Avx512Isa>(args); }

}  // namespace pagewire::cpu

#pragma GCC pop_options
