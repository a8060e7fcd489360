// AVX2+FMA bodies of the fused silu_and_mul and gelu_tanh_and_mul ops (fused_ops.cpp calls them
// when cpu::active_isa() is at least Isa::kAvx2 and below AVX-512): 8 values per step with a
// vectorised exp, where the portable loop pays one libm expf (or tanhf) call per value and loses
// to torch's own vectorised activations. The bodies are gated_body.h's, shared with the AVX-512
// family (fused_avx512.cpp), which gives the same bits 16 lanes at a time. Emulated builds
// (tests/kernels/emu_build.py) compile it unchanged with SIMDe's intrinsics.
#include "x86_target.h"  // <immintrin.h>, or nothing in emulated builds

#include <cstdint>

// Headers first: inline functions they define must keep the baseline ISA.
#include "fused_kernel.h"
#include "maybe_parallel.h"

PAGEWIRE_TARGET_PUSH("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")

#include "gated_body.h"

namespace pagewire::cpu {

void silu_and_mul_bf16_avx2(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t T, int64_t I) {
  gated_bf16_rows<SiluOp, Avx2Lanes>(x, ldx, out, T, I);
}
void silu_and_mul_f32_avx2(const float* x, int64_t ldx, float* out, int64_t T, int64_t I) {
  gated_f32_rows<SiluOp, Avx2Lanes>(x, ldx, out, T, I);
}
void gelu_tanh_and_mul_bf16_avx2(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t T, int64_t I) {
  gated_bf16_rows<GeluTanhOp, Avx2Lanes>(x, ldx, out, T, I);
}
void gelu_tanh_and_mul_f32_avx2(const float* x, int64_t ldx, float* out, int64_t T, int64_t I) {
  gated_f32_rows<GeluTanhOp, Avx2Lanes>(x, ldx, out, T, I);
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
