// C entry points for tests/kernels/test_emulated_kernels.py: the Q8_0 kernels of
// linear_q8_avx2.cpp and linear_q8_avx512.cpp, built by emu_build.py with emulated intrinsics.
#include <cstdint>

#include "quant_kernel.h"

using pagewire::cpu::Q8Activations;

extern "C" {

void pw_quantize_rows_q8(const float* x, int64_t M, int64_t K, int8_t* q, float* d) {
  pagewire::cpu::quantize_rows_q8_avx2(x, K, M, K, q, d, nullptr);
}

// isa: 0 the AVX2 kernel, 1 the AVX-512 VNNI one.
void pw_linear_q8_0(int isa, const int8_t* xq, const float* xd, int64_t M, int64_t K, const uint8_t* w,
                    const float* bias, float* out, int64_t N) {
  const Q8Activations x{xq, xd, M, K};
  (isa == 1 ? pagewire::cpu::linear_q8_0_avx512 : pagewire::cpu::linear_q8_0_avx2)(x, w, bias, out, N, N);
}

}  // extern "C"
