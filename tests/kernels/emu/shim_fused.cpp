// C entry point for tests/kernels/test_emulated_fused.py: the gated activation bodies of
// fused_avx2.cpp and fused_avx512.cpp, built by emu_build.py with emulated intrinsics.
#include <cstdint>

#include "fused_kernel.h"

extern "C" {

// isa: 0 AVX2, 1 AVX-512; gelu: 0 SiLU, 1 GELU-tanh; bf16: 0 float32 buffers, 1 bfloat16 (uint16).
// x: [T, 2 I] rows of stride ldx; out: [T, I].
void pw_gated(int isa, int gelu, int bf16, const void* x, int64_t ldx, void* out, int64_t T, int64_t I) {
  using namespace pagewire::cpu;
  if (bf16) {
    using Fn = void (*)(const uint16_t*, int64_t, uint16_t*, int64_t, int64_t);
    const Fn fn = gelu ? (isa == 1 ? gelu_tanh_and_mul_bf16_avx512 : gelu_tanh_and_mul_bf16_avx2)
                       : (isa == 1 ? silu_and_mul_bf16_avx512 : silu_and_mul_bf16_avx2);
    fn(static_cast<const uint16_t*>(x), ldx, static_cast<uint16_t*>(out), T, I);
  } else {
    using Fn = void (*)(const float*, int64_t, float*, int64_t, int64_t);
    const Fn fn = gelu ? (isa == 1 ? gelu_tanh_and_mul_f32_avx512 : gelu_tanh_and_mul_f32_avx2)
                       : (isa == 1 ? silu_and_mul_f32_avx512 : silu_and_mul_f32_avx2);
    fn(static_cast<const float*>(x), ldx, static_cast<float*>(out), T, I);
  }
}

}  // extern "C"
