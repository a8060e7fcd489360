// The x8 interleaved kernels (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS) on AVX-512 VNNI CPUs (Isa::kAvx512 and better:
// Zen 4/5, Ice Lake and later Xeons): x8_body.h built with 256-bit vpdpbusd in place of AVX2's
// maddubs + madd, the same integers and so the same floats as linear_x8_avx2.cpp, bit for bit.
// 256-bit vectors, not 512: one 32-bit lane per weight row of the eight-row group, as the layout
// is built; what VNNI buys here is fewer operations per block (a Q4 chunk's four maddubs and
// adds become two vpdpbusd, a Q8_0 chunk's maddubs + madd + add one), which is what limits the
// kernel from two activation rows up. Q4_K and Q6_K have their own VNNI build (linear_x8k_vnni.cpp,
// x8k_body.h).
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// Headers first: inline functions they define must keep the baseline ISA.
#include "cpu_features.h"
#include "quant4_kernel.h"
#include "quant_kernel.h"
#include "x86_target.h"

PAGEWIRE_TARGET_PUSH("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")

#define PAGEWIRE_X8_VNNI 1
#include "x8_body.h"

namespace pagewire::cpu {

void linear_q8_0x8_vnni(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                        int64_t N) {
  run8(x, w, bias, out, ldo, N);
}

void linear_q4x8_vnni(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                      int64_t ldo, int64_t N) {
  if (t == Q4Type::kQ4_0) {
    run4<Q4Type::kQ4_0>(x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ4_1) {
    run4<Q4Type::kQ4_1>(x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ5_0) {
    run4<Q4Type::kQ5_0>(x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ5_1) {
    run4<Q4Type::kQ5_1>(x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kIQ4_NL) {
    run4<Q4Type::kIQ4_NL>(x, w, bias, out, ldo, N);
  } else if (q_is_xs(t) || q_is_x16(t)) {  // IQ4_XS's layout (and the types held in it) or its x16 form
    run_iq4xs(t, x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ4_K) {
    linear_q4kx8_vnni(x, w, bias, out, ldo, N);  // the K-quants' own x8 kernels (x8k_body.h)
  } else if (t == Q4Type::kQ5_K) {
    linear_q5kx8_vnni(x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ2_K) {
    linear_q2kx8_vnni(x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ3_K) {
    linear_q3kx8_vnni(x, w, bias, out, ldo, N);
  } else {
    linear_q6kx8_vnni(x, w, bias, out, ldo, N);
  }
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
