// The torch-free interface of the ISA-specific fused-op bodies (fused_avx2.cpp, fused_avx512.cpp,
// fused_rows_avx2.cpp); call each only when cpu::active_isa() (cpu_features.h) is at least the
// family its name says.
#pragma once

#include <cstdint>

namespace pagewire::cpu {

// Elements of work (rows x values) from which the fused row ops (norms, rotations, gated
// activations) split their rows over the OpenMP team. Below it one thread is faster than waking
// the team; at 1 << 16 a decode step of eight rows ran every one of them on the engine thread
// while the other core waited (SmolLM2 at batch 8: about a fifth of the step, perf; RESULTS,
// session 22). The split never changes a result: each row is computed whole by one thread.
constexpr int64_t kFusedParallelElems = 1 << 12;

// out[t][j] = silu(x[t][j]) * x[t][I + j] for T rows of x (row stride ldx), rounded as
// transformers does (bf16: silu rounded to bf16 before the multiply). out: [T, I] contiguous.
void silu_and_mul_bf16_avx2(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t T, int64_t I);
void silu_and_mul_f32_avx2(const float* x, int64_t ldx, float* out, int64_t T, int64_t I);
// The same with gelu(x, approximate="tanh") in place of silu.
void gelu_tanh_and_mul_bf16_avx2(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t T, int64_t I);
void gelu_tanh_and_mul_f32_avx2(const float* x, int64_t ldx, float* out, int64_t T, int64_t I);
// The same four, 16 lanes at a time, with the AVX2 bodies' bits (fused_avx512.cpp); call them only
// when cpu::active_isa() is at least Isa::kAvx512.
void silu_and_mul_bf16_avx512(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t T, int64_t I);
void silu_and_mul_f32_avx512(const float* x, int64_t ldx, float* out, int64_t T, int64_t I);
void gelu_tanh_and_mul_bf16_avx512(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t T, int64_t I);
void gelu_tanh_and_mul_f32_avx512(const float* x, int64_t ldx, float* out, int64_t T, int64_t I);

// RMSNorm of T bf16 rows of d values (fused_ops.cpp norm_rows): x += delta first (rounded) when
// delta != nullptr, then out = weight * round(x * inv_rms). Bit for bit the portable loop.
void rms_norm_rows_bf16_avx2(uint16_t* x, int64_t ldx, const uint16_t* delta, int64_t ldd, const uint16_t* weight,
                             uint16_t* out, int64_t ldo, int64_t T, int64_t d, float eps);
// Rotates T rows of n bf16 heads of d values in place (fused_ops.cpp rope_rows), after the
// per-head RMSNorm by norm_weight [n, d] when it is not null. Bit for bit the portable loop.
void rope_rows_bf16_avx2(uint16_t* x, int64_t st, int64_t sh, int64_t T, int64_t n, int64_t d, const int64_t* pos,
                         const float* cos, const float* sin, const uint16_t* norm_weight, float eps);

}  // namespace pagewire::cpu
