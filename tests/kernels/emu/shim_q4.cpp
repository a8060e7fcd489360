// C entry points for tests/kernels/test_emulated_vnni_q4.py: the activation quantiser of
// linear_q8_avx2.cpp and the 4-bit kernels of linear_q4_avx2.cpp and linear_q4_avx512.cpp, built by
// emu_build.py with emulated intrinsics.
#include <cstdint>

#include "quant4_kernel.h"
#include "quant_kernel.h"

using pagewire::cpu::Q4Type;
using pagewire::cpu::Q8SumActivations;

extern "C" {

// Rows of x to Q8 blocks of 32 with their sums s[b] = d[b] * sum q.
void pw_quantize_rows_q8_sums(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  pagewire::cpu::quantize_rows_q8_avx2(x, K, M, K, q, d, s);
}

// isa: 0 the AVX2 kernel, 1 the AVX-512 VNNI one; qtype: Q4Type's value (0 q4_0, 1 q4_1, 2 q4_k, 3 q5_k, 4 q6_k,
// 5 mxfp4).
void pw_linear_q4(int isa, int qtype, const int8_t* xq, const float* xd, const float* xs, int64_t M, int64_t K,
                  const uint8_t* w, const float* bias, float* out, int64_t N) {
  const Q8SumActivations x{xq, xd, xs, M, K};
  (isa == 1 ? pagewire::cpu::linear_q4_avx512 : pagewire::cpu::linear_q4_avx2)(static_cast<Q4Type>(qtype), x, w, bias,
                                                                               out, N, N);
}

}  // extern "C"
