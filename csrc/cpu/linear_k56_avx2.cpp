// Q5_K and Q6_K weight x Q8 activation GEMV/GEMM on AVX2 (the body is k56_body.h; layouts in
// quant4_kernel.h). linear_q4_avx2 calls it for those two types.
#include <omp.h>

#include <cstdint>

// Headers first: inline functions they define must keep the baseline ISA.
#include "quant4_kernel.h"
#include "x86_target.h"

PAGEWIRE_TARGET_PUSH("avx2,fma,f16c")

#include "k56_body.h"

namespace pagewire::cpu {

void linear_k56_avx2(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                     int64_t ldo, int64_t N) {
  k56::run<false>(t, x, w, bias, out, ldo, N);
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
