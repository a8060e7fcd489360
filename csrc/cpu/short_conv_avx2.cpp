// The short causal convolution (short_conv_kernel.h) on AVX2 + FMA: eight channels per register,
// the K - 1 previous inputs kept in registers across the sequence's rows.
#include <cstdint>
#include <cstring>

#include "short_conv_kernel.h"
#include "x86_target.h"

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
PAGEWIRE_TARGET_PUSH("avx2,fma,f16c")

#include "short_conv_body.h"

namespace pagewire::cpu {
namespace {

struct V8 {
  using Reg = __m256;
  static constexpr int64_t kWidth = 8;
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg load(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static __m128i to_bf16(Reg v) {  // round to nearest even; NaN stays NaN
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                              _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, nan, is_nan);
    // Pack the low 16 bits of the eight lanes (values < 65536, so unsigned saturation is exact).
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  static void store(uint16_t* p, Reg v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(v)); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg round(Reg v, const float*) { return v; }
  static Reg round(Reg v, const uint16_t*) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16(v)), 16));
  }
};

}  // namespace

void short_conv_f32_avx2(const float* bcx, int64_t ldx, float* state, const float* w, const float* bias,
                         float* out, int64_t ldo, int64_t T, int64_t C, int64_t K, int64_t c0, int64_t c1) {
  short_conv_detail::conv_range<V8>(bcx, ldx, state, w, bias, out, ldo, T, C, K, c0, c1);
}

void short_conv_bf16_avx2(const uint16_t* bcx, int64_t ldx, uint16_t* state, const float* w, const float* bias,
                          uint16_t* out, int64_t ldo, int64_t T, int64_t C, int64_t K, int64_t c0, int64_t c1) {
  short_conv_detail::conv_range<V8>(bcx, ldx, state, w, bias, out, ldo, T, C, K, c0, c1);
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
