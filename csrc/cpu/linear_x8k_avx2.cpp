// The K-quant x8 kernels (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) on AVX2 CPUs: x8k_body.h built with maddubs + madd (the
// kernels' description is there). linear_x8k_vnni.cpp builds the same body with AVX-512 VNNI.
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

PAGEWIRE_TARGET_PUSH("avx2,fma,f16c")

#define PAGEWIRE_X8_VNNI 0
#include "x8k_body.h"

namespace pagewire::cpu {

void linear_q4kx8_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N) {
  run_q4k(x, w, bias, out, ldo, N);
}

void linear_q5kx8_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N) {
  run_q5k(x, w, bias, out, ldo, N);
}

void linear_q2kx8_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N) {
  run_q2k(x, w, bias, out, ldo, N);
}

void linear_q3kx8_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N) {
  run_q3k(x, w, bias, out, ldo, N);
}

void linear_q6kx8_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N) {
  run_q6k(x, w, bias, out, ldo, N);
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
