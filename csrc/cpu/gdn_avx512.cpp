// AVX-512 vector primitives of the Gated DeltaNet bodies (gdn_body.h): 16 floats per step, tails
// through masked loads and stores. gdn_ops.cpp calls these when cpu::active_isa() is at least
// Isa::kAvx512; tests/kernels/test_emulated_gdn.py runs them through emulated intrinsics.
#include <cmath>
#include <cstdint>

#include "gdn_kernel.h"
#include "x86_target.h"

// GCC 12's own intrinsic headers trip -Wmaybe-uninitialized (the _mm256_undefined_* idiom).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
PAGEWIRE_TARGET_PUSH("avx512f,avx512bw,avx512vl,fma")

namespace pagewire::cpu {
namespace {

struct Avx512 {
  static __mmask16 tail(int64_t left) { return static_cast<__mmask16>((1u << left) - 1u); }
  static float dot(const float* a, const float* b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
      const __mmask16 m = tail(n - i);
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
  }
  static void axpy(float a, const float* x, float* y, int64_t n) {
    const __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
      const __mmask16 m = tail(n - i);
      _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
    }
  }
  static void axpy2(float a, float b, const float* x, float* y, float* z, int64_t n) {
    const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xffff) : tail(n - i);
      const __m512 vx = _mm512_maskz_loadu_ps(m, x + i);
      _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(va, vx, _mm512_maskz_loadu_ps(m, y + i)));
      _mm512_mask_storeu_ps(z + i, m, _mm512_fmadd_ps(vb, vx, _mm512_maskz_loadu_ps(m, z + i)));
    }
  }
  static void scale(float a, float* y, int64_t n) {
    const __m512 va = _mm512_set1_ps(a);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xffff) : tail(n - i);
      _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, y + i)));
    }
  }
  static void axpby_acc(float a, float* y, float b, const float* x, float c, float* z, int64_t n) {
    const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b), vc = _mm512_set1_ps(c);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xffff) : tail(n - i);
      const __m512 vy =
          _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m, x + i), _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, y + i)));
      _mm512_mask_storeu_ps(y + i, m, vy);
      _mm512_mask_storeu_ps(z + i, m, _mm512_fmadd_ps(vc, vy, _mm512_maskz_loadu_ps(m, z + i)));
    }
  }
  static void muladd(const float* w, const float* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xffff) : tail(n - i);
      _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + i), _mm512_maskz_loadu_ps(m, x + i),
                                                      _mm512_maskz_loadu_ps(m, y + i)));
    }
  }
};

}  // namespace
}  // namespace pagewire::cpu

#include "gdn_body.h"

namespace pagewire::cpu {
void gdn_chunk_avx512(const GdnChunk& c) { chunk_body<Avx512>(c); }
void gdn_step_avx512(const GdnChunk& c) { step_body<Avx512>(c); }
void gdn_conv_row_avx512(const float* const* rows, const float* wt, float* out, int64_t K, int64_t C) {
  conv_row_body<Avx512>(rows, wt, out, K, C);
}
}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
