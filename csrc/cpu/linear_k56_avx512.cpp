// Q5_K and Q6_K weight x Q8 activation GEMV/GEMM for the AVX-512 family (Isa::kAvx512 and better):
// k56_body.h compiled for AVX-512 VL + VNNI, Q5_K's unsigned-code dot products one vpdpbusd each
// on 256-bit registers (Q6_K's signed codes keep the maddubs + scale madd of the AVX2 body, which
// applies the two 16-value halves' scales in the same instruction). linear_q4_avx512 calls it.
#include <omp.h>

#include <cstdint>

// Headers first: inline functions they define must keep the baseline ISA.
#include "quant4_kernel.h"
#include "x86_target.h"

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
PAGEWIRE_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#include "k56_body.h"

namespace pagewire::cpu {

void linear_k56_avx512(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                       int64_t ldo, int64_t N) {
  k56::run<true>(t, x, w, bias, out, ldo, N);
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
