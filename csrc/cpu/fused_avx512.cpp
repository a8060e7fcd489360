// AVX-512 bodies of the fused silu_and_mul and gelu_tanh_and_mul ops (fused_ops.cpp calls them when
// cpu::active_isa() is at least Isa::kAvx512): gated_body.h's loops 16 lanes at a time, so the
// values are the AVX2 bodies' bit for bit (fused_avx2.cpp; tests/kernels/test_fused_ops.py and the
// emulated test compare them) at half the instructions. A batch-8 SmolLM2 step spent ~6.7 us a
// layer in the SiLU of 8 x 1536 values, half of it a division and a polynomial per 8 lanes
// (bench/RESULTS.md, session 28).
// Emulated builds (tests/kernels/emu_build.py) compile it unchanged with SIMDe's intrinsics.
#include "x86_target.h"  // <immintrin.h>, or nothing in emulated builds

#include <cstdint>

// Headers first: inline functions they define must keep the baseline ISA.
#include "fused_kernel.h"
#include "maybe_parallel.h"

PAGEWIRE_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")

#include "gated_body.h"

namespace pagewire::cpu {
namespace {

// gated_body.h's lanes struct for 16 fp32 lanes (AVX-512F/BW; the bitwise ops go through the integer
// forms, which need no AVX-512DQ). Every operation is Avx2Lanes' on each lane.
struct Avx512Lanes {
  using F = __m512;
  static constexpr int kLanes = 16;
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F zero() { return _mm512_setzero_ps(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F andnot(F a, F b) { return cast(_mm512_andnot_si512(bits(a), bits(b))); }
  static F and_(F a, F b) { return cast(_mm512_and_si512(bits(a), bits(b))); }
  static F or_(F a, F b) { return cast(_mm512_or_si512(bits(a), bits(b))); }
  static F round(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F n) {
    return cast(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return cast(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // bf16_lanes_avx2.h's round_bf16_bits on 16 lanes: nearest even, NaN kept NaN.
  static __m512i round_bf16_bits(F v) {
    const __m512i u = bits(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, nan);
  }
  static F round_bf16(F v) { return cast(_mm512_slli_epi32(round_bf16_bits(v), 16)); }
  static void store_bf16(uint16_t* p, F v) {  // every lane's bits fit 16: the narrowing truncates nothing
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(round_bf16_bits(v)));
  }

 private:
  static __m512i bits(F a) { return _mm512_castps_si512(a); }
  static F cast(__m512i a) { return _mm512_castsi512_ps(a); }
};

}  // namespace

void silu_and_mul_bf16_avx512(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t T, int64_t I) {
  gated_bf16_rows<SiluOp, Avx512Lanes>(x, ldx, out, T, I);
}
void silu_and_mul_f32_avx512(const float* x, int64_t ldx, float* out, int64_t T, int64_t I) {
  gated_f32_rows<SiluOp, Avx512Lanes>(x, ldx, out, T, I);
}
void gelu_tanh_and_mul_bf16_avx512(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t T, int64_t I) {
  gated_bf16_rows<GeluTanhOp, Avx512Lanes>(x, ldx, out, T, I);
}
void gelu_tanh_and_mul_f32_avx512(const float* x, int64_t ldx, float* out, int64_t T, int64_t I) {
  gated_f32_rows<GeluTanhOp, Avx512Lanes>(x, ldx, out, T, I);
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
