// The torch-free interface of the short causal convolution's ISA bodies (short_conv_avx2.cpp,
// short_conv_avx512.cpp), and the shared body they instantiate. LFM2's gated short convolution
// over one sequence's new rows, channels [c0, c1):
//
//   bx[t]  = B[t] * x[t]                          (rounded to the storage type, as transformers)
//   y[t]   = bias + sum_k w[k] * win[t + k]        win = state (K - 1 rows) ++ bx (T rows)
//   out[t] = C[t] * round(y[t])                   (rounded to the storage type)
//   state  = the last K - 1 rows of win
//
// bcx: [T, 3C] rows of stride ldx holding B, C, x (the in-projection's three chunks); w: fp32
// [K, C] (the depthwise kernel, transposed so channels are contiguous); bias: fp32 [C] or null;
// state: the sequence's slot, [K - 1, C] of the storage type, read and rewritten; out: [T, C]
// rows of stride ldo. K <= kShortConvMaxK. Call a body only when cpu::active_isa() is at least
// its family (cpu_features.h).
#pragma once

#include <cstdint>

namespace pagewire::cpu {

constexpr int64_t kShortConvMaxK = 8;

void short_conv_f32_avx2(const float* bcx, int64_t ldx, float* state, const float* w, const float* bias,
                         float* out, int64_t ldo, int64_t T, int64_t C, int64_t K, int64_t c0, int64_t c1);
void short_conv_bf16_avx2(const uint16_t* bcx, int64_t ldx, uint16_t* state, const float* w, const float* bias,
                          uint16_t* out, int64_t ldo, int64_t T, int64_t C, int64_t K, int64_t c0, int64_t c1);
void short_conv_f32_avx512(const float* bcx, int64_t ldx, float* state, const float* w, const float* bias,
                           float* out, int64_t ldo, int64_t T, int64_t C, int64_t K, int64_t c0, int64_t c1);
void short_conv_bf16_avx512(const uint16_t* bcx, int64_t ldx, uint16_t* state, const float* w, const float* bias,
                            uint16_t* out, int64_t ldo, int64_t T, int64_t C, int64_t K, int64_t c0, int64_t c1);

}  // namespace pagewire::cpu
