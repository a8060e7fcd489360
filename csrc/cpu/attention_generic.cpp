// Portable micro-kernels for CPU paged attention: plain loops the compiler auto-vectorises for the
// baseline ISA, used on CPUs without AVX-512 (and selectable for testing, see attention.cpp).
#include <cmath>

#include "attention_tile.h"

namespace pagewire::cpu {
namespace {

struct GenericIsa {
  template <class E>
  static void load_q(const E* src, int D, float scale, float* dst) {
    for (int d = 0; d < D; ++d) dst[d] = to_float(src[d]) * scale;
  }

  // kt[d][j] = K[j][d] for j < n, zero for the padding columns up to the next multiple of 16.
  // The next span's rows (pf_rows) are prefetched, one row per row loaded.
  template <class E>
  static void load_k(const E* const* k_rows, int n, int D, float* kt, const E* const* pf_rows, int pf_n,
                     NextUnitPrefetch& next) {
    for (int j = 0; j < pf_n; ++j) prefetch_bytes(pf_rows[j], static_cast<int64_t>(D) * sizeof(E));
    next.steps(n * ((static_cast<int64_t>(D) * static_cast<int64_t>(sizeof(E)) + 63) / 64));
    const int nw = round16(n);
    for (int j = 0; j < nw; ++j) {
      for (int d = 0; d < D; ++d) kt[d * kSpan + j] = j < n ? to_float(k_rows[j][d]) : 0.f;
    }
  }

  // v[j][d] = V[j][d] for j < n.
  template <class E>
  static void load_v(const E* const* v_rows, int n, int D, float* v, const E* const* pf_rows, int pf_n,
                     NextUnitPrefetch& next) {
    for (int j = 0; j < pf_n; ++j) prefetch_bytes(pf_rows[j], static_cast<int64_t>(D) * sizeof(E));
    next.steps(n * ((static_cast<int64_t>(D) * static_cast<int64_t>(sizeof(E)) + 63) / 64));
    for (int j = 0; j < n; ++j) {
      for (int d = 0; d < D; ++d) v[j * D + d] = to_float(v_rows[j][d]);
    }
  }

  // s[r][j] = sum_d q[r][d] * kt[d][j] for j < nw (q was scaled by load_q, so scale is unused)
  template <class E>
  static void qk(const float* q, int rows, int D, const float* kt, int nw, float* s, float /*scale*/) {
    for (int r = 0; r < rows; ++r) {
      float acc[kSpan] = {};
      const float* qr = q + static_cast<int64_t>(r) * D;
      for (int d = 0; d < D; ++d) {
        for (int j = 0; j < kSpan; ++j) acc[j] += qr[d] * kt[d * kSpan + j];
      }
      for (int j = 0; j < nw; ++j) s[r * kSpan + j] = acc[j];
    }
  }

  // s[r][j] = cap * tanh(s[r][j] / cap) for j < nw: logit soft-capping.
  static void cap_scores(float* s, int rows, int nw, float cap) {
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < nw; ++j) s[r * kSpan + j] = cap * std::tanh(s[r * kSpan + j] / cap);
    }
  }

  // Scores outside [lo, hi) become -inf.
  static void mask_row(float* srow, int nw, int lo, int hi) {
    for (int j = 0; j < nw; ++j) {
      if (j < lo || j >= hi) srow[j] = -std::numeric_limits<float>::infinity();
    }
  }

  // Online-softmax update of one row: scores become probabilities relative to the new running
  // max; *alpha is the factor that moves the row's accumulator to that max (applied in pv).
  static void softmax_step(float* srow, int nw, float* m, float* l, float* alpha) {
    float mx = *m;
    for (int j = 0; j < nw; ++j) mx = std::max(mx, srow[j]);
    if (mx == -std::numeric_limits<float>::infinity()) {  // nothing visible yet in this row
      for (int j = 0; j < nw; ++j) srow[j] = 0.f;
      *alpha = 1.f;
      return;
    }
    float sum = 0.f;
    for (int j = 0; j < nw; ++j) {
      srow[j] = std::exp(srow[j] - mx);
      sum += srow[j];
    }
    *alpha = std::exp(*m - mx);
    *l = *l * *alpha + sum;
    *m = mx;
  }

  // acc[r][d] = alpha[r] * acc[r][d] + sum_{j < n} p[r][j] * v[j][d]
  template <class E>
  static void pv(const float* p, const float* alpha, int rows, int D, const float* v, int n, float* acc) {
    for (int r = 0; r < rows; ++r) {
      float* ar = acc + static_cast<int64_t>(r) * D;
      if (alpha[r] != 1.f) {
        for (int d = 0; d < D; ++d) ar[d] *= alpha[r];
      }
      for (int j = 0; j < n; ++j) {
        const float pj = p[r * kSpan + j];
        if (pj == 0.f) continue;
        for (int d = 0; d < D; ++d) ar[d] += pj * v[j * D + d];
      }
    }
  }

  template <class E>
  static void store_o(const float* acc, float inv_l, int D, E* dst) {
    for (int d = 0; d < D; ++d) store_float(acc[d] * inv_l, dst + d);
  }
};

}  // namespace

void paged_attention_generic(const PagedAttentionArgs& args) { dispatch_paged_attention<GenericIsa>(args); }

}  // namespace pagewire::cpu
