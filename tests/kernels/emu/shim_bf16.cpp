// C entry point for tests/kernels/test_emulated_bf16.py: the AVX512-BF16 linear kernel of
// linear_avx512.cpp, built by emu_build.py with emulated intrinsics.
#include <cstdint>

#include "linear_kernel.h"

extern "C" void pw_linear_bf16_avx512(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                                      int64_t M, int64_t N, int64_t K) {
  pagewire::cpu::linear_bf16_avx512(x, K, w, bias, out, N, M, N, K);
}

// The same product from a weight in the x8 layout (linear_bf16x8_avx512.cpp), which must give the
// row-layout kernel's bits.
extern "C" void pw_linear_bf16x8_avx512(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                                        int64_t M, int64_t N, int64_t K) {
  pagewire::cpu::linear_bf16x8_avx512(x, K, w, bias, out, N, M, N, K);
}
