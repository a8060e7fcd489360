// AVX-512 micro-kernels for CPU paged attention (16 fp32 lanes per vector), compiled for that
// ISA via a target pragma and chosen at runtime, so the .so still loads on CPUs without it.
// Emulated builds (tests/kernels/emu_build.py) compile it unchanged with SIMDe's intrinsics.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

// Library headers come before the pragma: inline functions from them must keep the baseline ISA,
// or the linker could pick an AVX-512 copy for code that runs on older CPUs.
#include "attention_kernel.h"
#include "elem.h"
#include "x86_target.h"


// GCC 12's own intrinsic headers trip -Wmaybe-uninitialized (the _mm256_undefined_* idiom).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
PAGEWIRE_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx512bf16,fma")

#include "attention_tile.h"
#include "avx512_util.h"
#include "attention_avx512_bf16.h"

namespace pagewire::cpu {
namespace {

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

// bf16 runs QK and PV on AVX512-BF16 dot products (attention_avx512_bf16.h); fp32 and fp16 widen
// K and V to fp32 and use FMA kernels.
struct Avx512Isa {
  template <class E>
  static constexpr bool kBf16 = std::is_same_v<E, Bf16>;

  template <class E>
  static void load_q(const E* src, int D, float scale, float* dst) {
    if constexpr (kBf16<E>) {
      std::memcpy(dst, src, static_cast<size_t>(D) * sizeof(E));  // unscaled: qk applies the scale
    } else {
      const __m512 sc = _mm512_set1_ps(scale);
      for (int d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(load16(src + d), sc));
    }
  }

  // fp32/fp16: kt[d][j] = K[j][d] for j < n (zero up to the next multiple of 16), via 16x16
  // register transposes. Every load is paired with a prefetch of the same place in the next
  // span's rows (pf_rows), so the next span streams in while this one is computed.
  template <class E>
  static void load_k(const E* const* k_rows, int n, int D, float* kt, const E* const* pf_rows, int pf_n,
                     NextUnitPrefetch& next) {
    if constexpr (kBf16<E>) {
      load_k_bf16(k_rows, n, D, kt, pf_rows, pf_n, next);
    } else {
      NextUnitPrefetch::Cursor at = next.cursor();
      for (int c = 0; c < n; c += 16) {
        for (int d0 = 0; d0 < D; d0 += 16) {
          __m512 x[16];
          for (int j = 0; j < 16; ++j) {
            x[j] = c + j < n ? load16(k_rows[c + j] + d0) : _mm512_setzero_ps();
            if (c + j < pf_n) __builtin_prefetch(pf_rows[c + j] + d0, 0, 3);
            if (c + j < n && (d0 * static_cast<int>(sizeof(E))) % 64 == 0) at.step();
          }
          transpose16(x);
          for (int i = 0; i < 16; ++i) _mm512_store_ps(kt + (d0 + i) * kSpan + c, x[i]);
        }
      }
      next.resume(at);
    }
  }

  template <class E>
  static void load_v(const E* const* v_rows, int n, int D, float* v, const E* const* pf_rows, int pf_n,
                     NextUnitPrefetch& next) {
    if constexpr (kBf16<E>) {
      load_v_bf16(v_rows, n, D, v, pf_rows, pf_n, next);
    } else {
      NextUnitPrefetch::Cursor at = next.cursor();
      for (int j = 0; j < n; ++j) {
        for (int d = 0; d < D; d += 16) {
          _mm512_storeu_ps(v + j * D + d, load16(v_rows[j] + d));
          if (j < pf_n) __builtin_prefetch(pf_rows[j] + d, 0, 3);
          if ((d * static_cast<int>(sizeof(E))) % 64 == 0) at.step();
        }
      }
      next.resume(at);
    }
  }

  template <class E>
  static void qk(const float* q, int rows, int D, const float* kt, int nw, float* s, float scale) {
    switch (nw / 16) {
      case 4:
        return kBf16<E> ? qk_all_bf16<4>(q, rows, D, kt, s, scale) : qk_all<4>(q, rows, D, kt, s);
      case 3:
        return kBf16<E> ? qk_all_bf16<3>(q, rows, D, kt, s, scale) : qk_all<3>(q, rows, D, kt, s);
      case 2:
        return kBf16<E> ? qk_all_bf16<2>(q, rows, D, kt, s, scale) : qk_all<2>(q, rows, D, kt, s);
      default:
        return kBf16<E> ? qk_all_bf16<1>(q, rows, D, kt, s, scale) : qk_all<1>(q, rows, D, kt, s);
    }
  }

  // s[r][j] = cap * tanh(s[r][j] / cap) for j < nw (a multiple of 16): tanh|y| = (1 - e) / (1 + e)
  // with e = exp(-2|y|) <= 1, the sign put back from y; absolute error ~1e-7 * cap, which is what a
  // softmax input's error costs.
  static void cap_scores(float* s, int rows, int nw, float cap) {
    const __m512 c = _mm512_set1_ps(cap), inv = _mm512_set1_ps(1.f / cap);
    const __m512 one = _mm512_set1_ps(1.f), m2 = _mm512_set1_ps(-2.f);
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < nw; j += 16) {
        float* p = s + r * kSpan + j;
        const __m512 y = _mm512_mul_ps(_mm512_load_ps(p), inv);
        const __m512 e = exp512(_mm512_mul_ps(m2, _mm512_abs_ps(y)));
        const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
        const __m512i signed_t = _mm512_or_si512(_mm512_castps_si512(t),
                                                 _mm512_and_si512(_mm512_castps_si512(y), sign));
        _mm512_store_ps(p, _mm512_mul_ps(c, _mm512_castsi512_ps(signed_t)));
      }
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

  template <class E>
  static void pv(float* p, const float* alpha, int rows, int D, const float* v, int n, float* acc) {
    if constexpr (kBf16<E>) {
      const int np = (n + 1) / 2;
      probabilities_to_bf16(p, rows, np);
      pv_all_bf16(p, alpha, rows, D, v, np, acc);
    } else {
      pv_all(p, alpha, rows, D, v, n, acc);
    }
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

PAGEWIRE_TARGET_POP
