// C entry points for tests/kernels/test_emulated_amx.py: the AMX kernels of linear_amx.cpp and linear_x8_amx.cpp, the
// AVX2 Q8_0 and x8 kernels they are compared with, and the tile emulation itself, built by emu_build.py with
// emulated intrinsics.
#include <cstdint>

#include "linear_kernel.h"
#include "quant4_kernel.h"
#include "quant_kernel.h"

using pagewire::cpu::Q8Activations;
using pagewire::cpu::Q8SumActivations;

extern "C" {

// One tile product through the emulated instructions: config (64 bytes, as LDTILECFG reads it),
// C in tile 0, A in tile 1, B in tile 2; kind 0 TDPBF16PS, 1 TDPBSSD. C is loaded, updated and
// stored back with the configured shapes only.
void pw_amx_emu_dp(int kind, const uint8_t* cfg, void* c, int64_t ldc, const void* a, int64_t lda, const void* b,
                   int64_t ldb) {
  _tile_loadconfig(cfg);
  _tile_loadd(0, c, ldc);
  _tile_loadd(1, a, lda);
  _tile_loadd(2, b, ldb);
  if (kind == 0) {
    _tile_dpbf16ps(0, 1, 2);
  } else {
    _tile_dpbssd(0, 1, 2);
  }
  _tile_stored(0, c, ldc);
  _tile_release();
}

// The AMX bf16 kernel, out [M, N] contiguous. (linear_avx2.cpp includes <immintrin.h> itself, so
// it cannot be built with emulated intrinsics; the test compares with a float64 reference instead.)
void pw_linear_bf16_amx(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                        int64_t M, int64_t N, int64_t K) {
  pagewire::cpu::linear_bf16_amx(x, ldx, w, bias, out, N, M, N, K);
}

void pw_quantize_rows_q8(const float* x, int64_t M, int64_t K, int8_t* q, float* d) {
  pagewire::cpu::quantize_rows_q8_avx2(x, K, M, K, q, d, nullptr);
}

// isa: 0 the AVX2 kernel, 1 the AMX one.
void pw_linear_q8_0(int isa, const int8_t* xq, const float* xd, int64_t M, int64_t K, const uint8_t* w,
                    const float* bias, float* out, int64_t N) {
  const Q8Activations x{xq, xd, M, K};
  (isa == 1 ? pagewire::cpu::linear_q8_0_amx : pagewire::cpu::linear_q8_0_avx2)(x, w, bias, out, N, N);
}

// Q8_0 in the x8 layout (whole groups of eight rows): isa 0 the AVX2 x8 kernel, 1 the AMX one.
void pw_linear_q8_0x8(int isa, const int8_t* xq, const float* xd, int64_t M, int64_t K, const uint8_t* w,
                      const float* bias, float* out, int64_t N) {
  const Q8Activations x{xq, xd, M, K};
  (isa == 1 ? pagewire::cpu::linear_q8_0x8_amx : pagewire::cpu::linear_q8_0x8_avx2)(x, w, bias, out, N, N);
}

// Q4_0 (t 0) or Q4_1 (t 1) in the x8 layout (whole groups): isa 0 the AVX2 x8 kernel, 1 the AMX one.
// xs: per (row, block) the activation block's sum times its scale (quantize_rows_q8's third output).
void pw_linear_q4x8(int isa, int t, const int8_t* xq, const float* xd, const float* xs, int64_t M, int64_t K,
                    const uint8_t* w, const float* bias, float* out, int64_t N) {
  const Q8SumActivations x{xq, xd, xs, M, K};
  const auto type = t == 0 ? pagewire::cpu::Q4Type::kQ4_0 : pagewire::cpu::Q4Type::kQ4_1;
  (isa == 1 ? pagewire::cpu::linear_q4x8_amx : pagewire::cpu::linear_q4x8_avx2)(type, x, w, bias, out, N, N);
}

void pw_quantize_rows_q8_sums(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  pagewire::cpu::quantize_rows_q8_avx2(x, K, M, K, q, d, s);
}

}  // extern "C"
