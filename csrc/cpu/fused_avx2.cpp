// AVX2+FMA bodies of the fused silu_and_mul and gelu_tanh_and_mul ops (fused_ops.cpp calls them
// when cpu::active_isa() is at least Isa::kAvx2): 8 values per step with a vectorised exp, where
// the portable loop pays one libm expf (or tanhf) call per value and loses to torch's own
// vectorised activations.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

// Headers first: inline functions they define must keep the baseline ISA.
#include "fused_kernel.h"
#include "maybe_parallel.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

#include "bf16_lanes_avx2.h"

namespace pagewire::cpu {
namespace {

// e^x to ~1e-7 relative for x in [-87, 88] (clamped outside): x log2(e) = n + f, n the nearest
// integer, 2^f = e^(f ln 2) by its Taylor series to degree 7 (|f ln 2| <= 0.35, remainder below
// 1e-8), 2^n built in the exponent bits.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The activations, 8 lanes (vec) and one value (one) at a time, as torch computes them in fp32.
struct SiluOp {
  static __m256 vec(__m256 g) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  }
  static float one(float g) { return g / (1.0f + std::exp(-g)); }
};

struct GeluTanhOp {  // 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), torch's formula
  static constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  static __m256 vec(__m256 g) {
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 z = _mm256_mul_ps(_mm256_set1_ps(kBeta), _mm256_fmadd_ps(_mm256_set1_ps(kKappa), g3, g));
    // tanh|z| = (1 - e) / (1 + e), e = exp(-2|z|) in (0, 1]: no overflow, and 1 + tanh keeps an
    // absolute error of ~1e-7, so the product keeps fp32's relative precision.
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 e = exp_ps(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign, z)));
    const __m256 t = _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)),
                                  _mm256_and_ps(sign, z));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t));
  }
  static float one(float g) { return 0.5f * g * (1.0f + std::tanh(kBeta * (g + kKappa * g * g * g))); }
};

inline float scalar_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t scalar_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace

namespace {

template <class Act>
void gated_bf16(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t T, int64_t I) {
  maybe_parallel_for(T, T * I >= kFusedParallelElems, [&](int64_t t) {
    const uint16_t* g = x + t * ldx;
    const uint16_t* u = g + I;
    uint16_t* o = out + t * I;
    int64_t j = 0;
    for (; j + 8 <= I; j += 8) {
      // act(gate) is a bf16 tensor in transformers before it multiplies up.
      const __m256 s = round_bf16(Act::vec(load_bf16(g + j)));
      store_bf16(o + j, _mm256_mul_ps(s, load_bf16(u + j)));
    }
    for (; j < I; ++j) {
      const float s = scalar_bf16(scalar_to_bf16(Act::one(scalar_bf16(g[j]))));
      o[j] = scalar_to_bf16(s * scalar_bf16(u[j]));
    }
  });
}

template <class Act>
void gated_f32(const float* x, int64_t ldx, float* out, int64_t T, int64_t I) {
  maybe_parallel_for(T, T * I >= kFusedParallelElems, [&](int64_t t) {
    const float* g = x + t * ldx;
    const float* u = g + I;
    float* o = out + t * I;
    int64_t j = 0;
    for (; j + 8 <= I; j += 8) {
      _mm256_storeu_ps(o + j, _mm256_mul_ps(Act::vec(_mm256_loadu_ps(g + j)), _mm256_loadu_ps(u + j)));
    }
    for (; j < I; ++j) o[j] = Act::one(g[j]) * u[j];
  });
}

}  // namespace

void silu_and_mul_bf16_avx2(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t T, int64_t I) {
  gated_bf16<SiluOp>(x, ldx, out, T, I);
}
void silu_and_mul_f32_avx2(const float* x, int64_t ldx, float* out, int64_t T, int64_t I) {
  gated_f32<SiluOp>(x, ldx, out, T, I);
}
void gelu_tanh_and_mul_bf16_avx2(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t T, int64_t I) {
  gated_bf16<GeluTanhOp>(x, ldx, out, T, I);
}
void gelu_tanh_and_mul_f32_avx2(const float* x, int64_t ldx, float* out, int64_t T, int64_t I) {
  gated_f32<GeluTanhOp>(x, ldx, out, T, I);
}

}  // namespace pagewire::cpu

#pragma GCC pop_options
