// The batched LoRA kernel (lora_kernel.h) on AVX2 + FMA + F16C: eight fp32 lanes per register,
// bf16 widened by a shift and fp16 by F16C on load, rounded to nearest even on store.
#include <cmath>
#include <cstdint>
#include <cstring>

// Headers first: inline functions they define must keep the baseline ISA.
#include "elem.h"
#include "lora_kernel.h"
#include "x86_target.h"

PAGEWIRE_TARGET_PUSH("avx2,fma,f16c")
// Only the explicit fma()s fuse: GCC would otherwise contract a product and a sum (the scaling and
// the add to out, in fp32) into one fma here but not in the portable body, and the bits would differ.
#pragma GCC optimize("fp-contract=off")

#include "avx2_util.h"
#include "lora_body.h"

namespace pagewire::cpu {
namespace {

struct V8 {
  using Reg = __m256;
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float f) { return _mm256_set1_ps(f); }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg load(const Bf16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static Reg load(const Fp16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // bf16 bits (round to nearest even; NaN kept NaN) in the low half of each 32-bit lane.
  static __m256i bf16_bits(Reg v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), is_nan);  // elem.h's NaN
  }
  static __m128i half_bits(Reg v) { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static void store(Bf16* p, Reg v) {
    const __m256i b = bf16_bits(v);
    // Lanes < 65536, so the unsigned saturating pack keeps them exactly.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
  }
  static void store(Fp16* p, Reg v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), half_bits(v)); }
  static Reg round(Reg v, const float*) { return v; }
  static Reg round(Reg v, const Bf16*) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
  static Reg round(Reg v, const Fp16*) { return _mm256_cvtph_ps(half_bits(v)); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static float hsum(Reg v) { return avx2::hsum(v); }
};

}  // namespace

void lora_shrink_avx2(const LoraProblem& pb, int64_t g, int64_t col) { lora_detail::shrink_any<V8>(pb, g, col); }

void lora_expand_avx2(const LoraProblem& pb, int64_t p, int64_t j0, int64_t j1, int64_t ngroups) {
  lora_detail::expand_any<V8>(pb, p, j0, j1, ngroups);
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
