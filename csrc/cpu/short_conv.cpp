// short_conv: LFM2's gated short causal convolution over a flat batch of sequences, each with its
// convolution state in a slot of the state cache (server/engine/state_cache.py). The arithmetic
// is short_conv_kernel.h's; this file checks the arguments, picks the body for the CPU's family
// (AVX-512, AVX2, or the portable scalar body) and runs (sequence, channel block) tasks in parallel.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <cstring>

#include "../ops.h"
#include "cpu_features.h"
#include "short_conv_body.h"
#include "short_conv_kernel.h"

namespace pagewire {
namespace {

constexpr int64_t kChannelBlock = 64;  // a task's channels: a multiple of both vector widths

template <class E>
void run(const at::Tensor& bcx, const at::Tensor& weight_t, const float* bias, at::Tensor& state,
         const int64_t* slots, const int32_t* qsl, int64_t S, at::Tensor& out) {
  const int64_t C = out.size(1), K = weight_t.size(0);
  const E* x = static_cast<const E*>(bcx.data_ptr());
  E* st = static_cast<E*>(state.data_ptr());
  E* o = static_cast<E*>(out.data_ptr());
  const float* w = weight_t.data_ptr<float>();
  const int64_t ldx = bcx.stride(0), slot_stride = state.stride(0);
  const int64_t blocks = (C + kChannelBlock - 1) / kChannelBlock;
  const cpu::Isa isa = cpu::active_isa();
  constexpr bool kF32 = std::is_same_v<E, float>;
#pragma omp parallel for schedule(static) if (S * blocks > 1 && qsl[S] * C >= (1 << 14))
  for (int64_t task = 0; task < S * blocks; ++task) {
    const int64_t s = task / blocks, c0 = (task % blocks) * kChannelBlock;
    const int64_t c1 = std::min(C, c0 + kChannelBlock), t0 = qsl[s], T = qsl[s + 1] - qsl[s];
    if (T <= 0) continue;
    const E* xs = x + t0 * ldx;
    E* ss = st + slots[s] * slot_stride;
    E* os = o + t0 * C;
    if (isa >= cpu::Isa::kAvx512) {
      if constexpr (kF32) cpu::short_conv_f32_avx512(xs, ldx, ss, w, bias, os, C, T, C, K, c0, c1);
      else cpu::short_conv_bf16_avx512(xs, ldx, ss, w, bias, os, C, T, C, K, c0, c1);
    } else if (isa >= cpu::Isa::kAvx2) {
      if constexpr (kF32) cpu::short_conv_f32_avx2(xs, ldx, ss, w, bias, os, C, T, C, K, c0, c1);
      else cpu::short_conv_bf16_avx2(xs, ldx, ss, w, bias, os, C, T, C, K, c0, c1);
    } else {
      for (int64_t c = c0; c < c1; ++c)
        cpu::short_conv_detail::conv_scalar(xs, ldx, ss, w, bias, os, C, T, C, K, c);
    }
  }
}

}  // namespace

at::Tensor short_conv_cpu(const at::Tensor& bcx, const at::Tensor& weight_t, const c10::optional<at::Tensor>& bias,
                          at::Tensor& state, const at::Tensor& slots, const at::Tensor& query_start_loc) {
  TORCH_CHECK(bcx.device().is_cpu() && bcx.dim() == 2 && bcx.stride(1) == 1 && bcx.size(1) % 3 == 0,
              "short_conv: bcx must be a CPU [T, 3C] tensor contiguous in its last dim, got ", bcx.sizes());
  const auto dt = bcx.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "short_conv: bcx must be float32 or bfloat16, got ", dt);
  const int64_t C = bcx.size(1) / 3;
  TORCH_CHECK(weight_t.scalar_type() == at::kFloat && weight_t.dim() == 2 && weight_t.size(1) == C &&
                  weight_t.is_contiguous() && weight_t.size(0) >= 2 && weight_t.size(0) <= cpu::kShortConvMaxK,
              "short_conv: weight_t must be contiguous float32 [K, ", C, "] with 2 <= K <= ", cpu::kShortConvMaxK,
              ", got ", weight_t.scalar_type(), " ", weight_t.sizes());
  const int64_t K = weight_t.size(0);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == C && bias->is_contiguous(),
                "short_conv: bias must be contiguous float32 [", C, "], got ", bias->sizes());
  TORCH_CHECK(state.scalar_type() == dt && state.dim() == 3 && state.size(1) == K - 1 && state.size(2) == C &&
                  state.stride(2) == 1 && state.stride(1) == C,
              "short_conv: state must be [slots, ", K - 1, ", ", C, "] of bcx's dtype with contiguous slots, got ",
              state.scalar_type(), " ", state.sizes());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "short_conv: slots must be contiguous int64 [S]");
  const int64_t S = slots.size(0);
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.dim() == 1 &&
                  query_start_loc.size(0) == S + 1 && query_start_loc.is_contiguous(),
              "short_conv: query_start_loc must be contiguous int32 [S + 1]");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  TORCH_CHECK(qsl[0] == 0 && qsl[S] == bcx.size(0), "short_conv: query_start_loc must run from 0 to T = ",
              bcx.size(0));
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(qsl[s + 1] >= qsl[s], "short_conv: query_start_loc must not decrease");
    TORCH_CHECK(sl[s] >= 0 && sl[s] < state.size(0), "short_conv: slot ", sl[s], " outside the ", state.size(0),
                " slots of state");
  }
  at::Tensor out = at::empty({bcx.size(0), C}, bcx.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (dt == at::kFloat) run<float>(bcx, weight_t, b, state, sl, qsl, S, out);
  else run<uint16_t>(bcx, weight_t, b, state, sl, qsl, S, out);
  return out;
}

}  // namespace pagewire
