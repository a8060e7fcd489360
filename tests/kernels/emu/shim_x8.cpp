// C entry points for tests/kernels/test_x8_vnni.py: the activation quantiser of linear_q8_avx2.cpp
// and the x8 interleaved kernels of x8_body.h in both builds (linear_x8_avx2.cpp, linear_x8_vnni.cpp),
// built by emu_build.py with emulated intrinsics.
#include <cstdint>

#include "quant4_kernel.h"
#include "quant_kernel.h"

using pagewire::cpu::Q4Type;
using pagewire::cpu::Q8Activations;
using pagewire::cpu::Q8SumActivations;

extern "C" {

// Rows of x to Q8 blocks of 32 with their sums s[b] = d[b] * sum q.
void pw_quantize_rows_q8_sums(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  pagewire::cpu::quantize_rows_q8_avx2(x, K, M, K, q, d, s);
}

// vnni: 0 the AVX2 build, 1 the AVX-512 VNNI one; qtype: Q4Type's value (0 q4_0, 1 q4_1, 2 q4_k,
// 4 q6_k) or -1 for Q8_0. N: whole groups of eight rows.
void pw_linear_x8(int vnni, int qtype, const int8_t* xq, const float* xd, const float* xs, int64_t M, int64_t K,
                  const uint8_t* w, const float* bias, float* out, int64_t N) {
  if (qtype < 0) {
    const Q8Activations x{xq, xd, M, K};
    (vnni ? pagewire::cpu::linear_q8_0x8_vnni : pagewire::cpu::linear_q8_0x8_avx2)(x, w, bias, out, N, N);
    return;
  }
  const Q8SumActivations x{xq, xd, xs, M, K};
  (vnni ? pagewire::cpu::linear_q4x8_vnni : pagewire::cpu::linear_q4x8_avx2)(static_cast<Q4Type>(qtype), x, w, bias,
                                                                             out, N, N);
}

}  // extern "C"
