// The torch-free interface of the small-batch linear kernels (linear_amx.cpp, linear_avx512.cpp,
// linear_avx2.cpp, linear_q8.cpp). Each ISA-specific one may only be called when cpu::active_isa() (cpu_features.h)
// is at least its family.
#pragma once

#include <cstdint>

namespace pagewire::cpu {

// out[m][n] = bf16(sum_k x[m][k] * w[n][k] + bias[n]) with fp32 accumulation; all values are bf16
// bit patterns. x: [M, K] with row stride ldx; w: [N, K] contiguous; bias: [N] or nullptr;
// out: [M, N] with row stride ldo.
void linear_bf16_avx512(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                        int64_t ldo, int64_t M, int64_t N, int64_t K);  // Isa::kAvx512Bf16
// The same on AMX tiles (linear_amx.cpp): each output is one fp32 chain over k in order (two fused
// steps per k-pair, TDPBF16PS), so not bitwise equal to the AVX512-BF16 kernel, but a function of
// its own row alone. Any M, N, K (odd K, M > 16 included).
void linear_bf16_amx(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                     int64_t ldo, int64_t M, int64_t N, int64_t K);  // Isa::kAmx
void linear_bf16_avx2(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                      int64_t ldo, int64_t M, int64_t N, int64_t K);  // Isa::kAvx2

// The interleaved ("x8") bf16 layout, which the x8 kernels below stream as one sequence: the
// first N / 8 * 8 rows in groups of eight, each group 16-value chunk by chunk: chunk c of a group
// holds values 16c..16c+15 of its row 0, then of row 1, ..., row 7 (8 x 32 bytes). The last N % 8
// rows follow in row layout. K must be a multiple of 16. The same bytes as [N, K] bf16, moved.
constexpr int64_t kBf16Interleave = 8;
// linear_bf16_avx2's result, bit for bit, from a weight in the x8 layout (any M).
void linear_bf16x8_avx2(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                        int64_t ldo, int64_t M, int64_t N, int64_t K);  // Isa::kAvx2 or better
// linear_bf16_avx512's result, bit for bit, from a weight in the x8 layout (any M).
void linear_bf16x8_avx512(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                          int64_t ldo, int64_t M, int64_t N, int64_t K);  // Isa::kAvx512Bf16 or better

// out[m][n] = sum_k x[m][k] * w[n][k] + bias[n], all fp32, same strides as above. Each output is
// one 8-lane FMA chain over k in 16-blocks, a fixed horizontal sum and a scalar tail, so a row's
// result is a function of that row alone (not of M, its position, or the thread count).
void linear_f32_avx2(const float* x, int64_t ldx, const float* w, const float* bias, float* out, int64_t ldo,
                     int64_t M, int64_t N, int64_t K);  // Isa::kAvx2 or better

}  // namespace pagewire::cpu
