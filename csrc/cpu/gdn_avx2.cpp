// AVX2+FMA vector primitives of the Gated DeltaNet bodies (gdn_body.h): 8 floats per step, scalar
// tails. gdn_ops.cpp calls these when cpu::active_isa() is at least Isa::kAvx2.
#include <cmath>
#include <cstdint>

#include "gdn_kernel.h"
#include "x86_target.h"

PAGEWIRE_TARGET_PUSH("avx2,fma")

namespace pagewire::cpu {
namespace {

struct Avx2 {
  static float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  }
  static float dot(const float* a, const float* b, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float s = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  static void axpy(float a, const float* x, float* y, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * x[i];
  }
  static void axpy2(float a, float b, const float* x, float* y, float* z, int64_t n) {
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 vx = _mm256_loadu_ps(x + i);
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, vx, _mm256_loadu_ps(y + i)));
      _mm256_storeu_ps(z + i, _mm256_fmadd_ps(vb, vx, _mm256_loadu_ps(z + i)));
    }
    for (; i < n; ++i) {
      y[i] += a * x[i];
      z[i] += b * x[i];
    }
  }
  static void scale(float a, float* y, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] *= a;
  }
  static void axpby_acc(float a, float* y, float b, const float* x, float c, float* z, int64_t n) {
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b), vc = _mm256_set1_ps(c);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 vy = _mm256_fmadd_ps(vb, _mm256_loadu_ps(x + i), _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
      _mm256_storeu_ps(y + i, vy);
      _mm256_storeu_ps(z + i, _mm256_fmadd_ps(vc, vy, _mm256_loadu_ps(z + i)));
    }
    for (; i < n; ++i) {
      y[i] = a * y[i] + b * x[i];
      z[i] += c * y[i];
    }
  }
  static void muladd(const float* w, const float* x, float* y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += w[i] * x[i];
  }
};

}  // namespace
}  // namespace pagewire::cpu

#include "gdn_body.h"

namespace pagewire::cpu {
void gdn_chunk_avx2(const GdnChunk& c) { chunk_body<Avx2>(c); }
void gdn_step_avx2(const GdnChunk& c) { step_body<Avx2>(c); }
void gdn_conv_row_avx2(const float* const* rows, const float* wt, float* out, int64_t K, int64_t C) {
  conv_row_body<Avx2>(rows, wt, out, K, C);
}
}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
