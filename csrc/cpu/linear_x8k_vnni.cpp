// The K-quant x8 kernels (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) on AVX-512 VNNI CPUs (Isa::kAvx512 and better): x8k_body.h built
// with 256-bit vpdpbusd and vpmulld in place of maddubs + madd: the same integers, so the same
// floats as linear_x8k_avx2.cpp, bit for bit (the kernels are described in x8k_body.h).
// Headers first (x8k_body.h's own includes then add nothing): inline functions they define must
// keep the baseline ISA.
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_features.h"
#include "quant4_kernel.h"
#include "team_kernel.h"
#include "x86_target.h"

PAGEWIRE_TARGET_PUSH("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
// GCC 12's own intrinsic headers trip -Wmaybe-uninitialized (the _mm512_undefined_* idiom).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define PAGEWIRE_X8_VNNI 1
#include "x8k_body.h"

namespace pagewire::cpu {

void linear_q4kx8_vnni(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N) {
  run_q4k(x, w, bias, out, ldo, N);
}

void linear_q5kx8_vnni(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N) {
  run_q5k(x, w, bias, out, ldo, N);
}

void linear_q2kx8_vnni(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N) {
  run_q2k(x, w, bias, out, ldo, N);
}

void linear_q3kx8_vnni(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N) {
  run_q3k(x, w, bias, out, ldo, N);
}

void linear_q6kx8_vnni(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N) {
  run_q6k(x, w, bias, out, ldo, N);
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
