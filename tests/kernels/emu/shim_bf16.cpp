// C entry point for tests/kernels/test_emulated_bf16.py: the AVX512-BF16 linear kernel of
// linear_avx512.cpp, built by emu_build.py with emulated intrinsics.
#include <cstdint>

#include "bf16z_layout.h"
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

// The same product from a packed weight (bf16z_layout.h; linear_bf16x8_avx512.cpp's packed kernel),
// which must give the row-layout kernel's bits too; and the packed groups unpacked to row layout.
extern "C" void pw_linear_bf16z_avx512(const uint16_t* x, const uint8_t* packed, const uint16_t* bias, uint16_t* out,
                                       int64_t M, int64_t N, int64_t K) {
  pagewire::cpu::bf16z::linear_bf16z_avx512(x, K, packed, bias, out, N, M);
}

extern "C" void pw_unpack_bf16z_avx512(const uint8_t* packed, int64_t groups, uint16_t* dst) {
  pagewire::cpu::bf16z::unpack_bf16z_avx512(packed, 0, groups, dst);
}
