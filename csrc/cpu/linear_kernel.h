// The torch-free interface of the small-batch bf16 linear kernel (linear_avx512.cpp).
#pragma once

#include <cstdint>

namespace pagewire::cpu {

// out[m][n] = bf16(sum_k x[m][k] * w[n][k] + bias[n]) with fp32 accumulation; all values are bf16
// bit patterns. x: [M, K] with row stride ldx; w: [N, K] contiguous; bias: [N] or nullptr;
// out: [M, N] with row stride ldo. Requires cpu_has_avx512() (avx512f/bw/vl/bf16).
void linear_bf16_avx512(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                        int64_t ldo, int64_t M, int64_t N, int64_t K);

}  // namespace pagewire::cpu
