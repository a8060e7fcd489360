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

  // kt[d][j] = K[j][d] for j in [j_lo, j_hi), zero elsewhere.
  template <class E>
  static void load_k(const E* k, int j_lo, int j_hi, int D, float* kt) {
    for (int d = 0; d < D; ++d) {
      for (int j = 0; j < kChunk; ++j) {
        kt[d * kChunk + j] = (j >= j_lo && j < j_hi) ? to_float(k[static_cast<int64_t>(j) * D + d]) : 0.f;
      }
    }
  }

  // v[j][d] = V[j][d] for j in [j_lo, j_hi), zero rows elsewhere.
  template <class E>
  static void load_v(const E* v, int j_lo, int j_hi, int D, float* dst) {
    for (int j = 0; j < kChunk; ++j) {
      const bool valid = j >= j_lo && j < j_hi;
      for (int d = 0; d < D; ++d) dst[j * D + d] = valid ? to_float(v[static_cast<int64_t>(j) * D + d]) : 0.f;
    }
  }

  // s[r][j] = sum_d q[r][d] * kt[d][j]
  static void qk(const float* q, int rows, int D, const float* kt, float* s) {
    for (int r = 0; r < rows; ++r) {
      float acc[kChunk] = {};
      const float* qr = q + static_cast<int64_t>(r) * D;
      for (int d = 0; d < D; ++d) {
        for (int j = 0; j < kChunk; ++j) acc[j] += qr[d] * kt[d * kChunk + j];
      }
      for (int j = 0; j < kChunk; ++j) s[r * kChunk + j] = acc[j];
    }
  }

  // Online-softmax update of one row: scores become probabilities relative to the new running
  // max; *alpha is the factor that moves the row's accumulator to that max (applied in pv).
  static void softmax_step(float* srow, float* m, float* l, float* alpha) {
    float mx = *m;
    for (int j = 0; j < kChunk; ++j) mx = std::max(mx, srow[j]);
    if (mx == -std::numeric_limits<float>::infinity()) {  // nothing visible yet in this row
      for (int j = 0; j < kChunk; ++j) srow[j] = 0.f;
      *alpha = 1.f;
      return;
    }
    float sum = 0.f;
    for (int j = 0; j < kChunk; ++j) {
      srow[j] = std::exp(srow[j] - mx);
      sum += srow[j];
    }
    *alpha = std::exp(*m - mx);
    *l = *l * *alpha + sum;
    *m = mx;
  }

  // acc[r][d] = alpha[r] * acc[r][d] + sum_j p[r][j] * v[j][d]
  static void pv(const float* p, const float* alpha, int rows, int D, const float* v, float* acc) {
    for (int r = 0; r < rows; ++r) {
      float* ar = acc + static_cast<int64_t>(r) * D;
      if (alpha[r] != 1.f) {
        for (int d = 0; d < D; ++d) ar[d] *= alpha[r];
      }
      for (int j = 0; j < kChunk; ++j) {
        const float pj = p[r * kChunk + j];
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
