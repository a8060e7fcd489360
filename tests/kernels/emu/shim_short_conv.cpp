// C entry points for tests/kernels/test_emulated_short_conv.py: the short convolution bodies of
// short_conv_avx2.cpp and short_conv_avx512.cpp, built by emu_build.py with emulated intrinsics.
#include <cstdint>

#include "short_conv_kernel.h"

extern "C" {

// isa: 0 AVX2, 1 AVX-512; bf16: 0 float32 buffers, 1 bfloat16 (uint16) buffers. One sequence.
void pw_short_conv(int isa, int bf16, const void* bcx, int64_t ldx, void* state, const float* w, const float* bias,
                   void* out, int64_t T, int64_t C, int64_t K) {
  using namespace pagewire::cpu;
  if (bf16) {
    (isa == 1 ? short_conv_bf16_avx512 : short_conv_bf16_avx2)(
        static_cast<const uint16_t*>(bcx), ldx, static_cast<uint16_t*>(state), w, bias, static_cast<uint16_t*>(out),
        C, T, C, K, 0, C);
  } else {
    (isa == 1 ? short_conv_f32_avx512 : short_conv_f32_avx2)(
        static_cast<const float*>(bcx), ldx, static_cast<float*>(state), w, bias, static_cast<float*>(out), C, T, C,
        K, 0, C);
  }
}

}  // extern "C"
