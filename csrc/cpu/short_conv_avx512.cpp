// The short causal convolution (short_conv_kernel.h) on AVX-512 F/BW (family kAvx512 and up):
// sixteen channels per register, the K - 1 previous inputs kept in registers across the rows.
#include <cstdint>
#include <cstring>

#include "short_conv_kernel.h"
#include "x86_target.h"

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
PAGEWIRE_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

#include "short_conv_body.h"

namespace pagewire::cpu {
namespace {

struct V16 {
  using Reg = __m512;
  static constexpr int64_t kWidth = 16;
  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static Reg load(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static __m256i to_bf16(Reg v) {  // round to nearest even; NaN stays NaN (no AVX512-BF16 needed)
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                     _mm512_set1_epi32(0x7f800000));
    const __m512i h = _mm512_mask_blend_epi32(is_nan, r, nan);
    // Each lane < 65536: pack to 16 bits (per 128-bit lane, unsigned saturation is exact), then
    // gather the four lanes' low halves in order.
    const __m512i p = _mm512_packus_epi32(h, h);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), p));
  }
  static void store(uint16_t* p, Reg v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v)); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg round(Reg v, const float*) { return v; }
  static Reg round(Reg v, const uint16_t*) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
  }
};

}  // namespace

void short_conv_f32_avx512(const float* bcx, int64_t ldx, float* state, const float* w, const float* bias,
                           float* out, int64_t ldo, int64_t T, int64_t C, int64_t K, int64_t c0, int64_t c1) {
  short_conv_detail::conv_range<V16>(bcx, ldx, state, w, bias, out, ldo, T, C, K, c0, c1);
}

void short_conv_bf16_avx512(const uint16_t* bcx, int64_t ldx, uint16_t* state, const float* w, const float* bias,
                            uint16_t* out, int64_t ldo, int64_t T, int64_t C, int64_t K, int64_t c0, int64_t c1) {
  short_conv_detail::conv_range<V16>(bcx, ldx, state, w, bias, out, ldo, T, C, K, c0, c1);
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
