// Declarations of the Gated DeltaNet ops (Qwen3-Next, Qwen3.5 linear-attention layers; cpu/gdn_ops.cpp),
// kept out of ops.h so that adding them rebuilds only the files that use them. A batch of S
// sequences laid out by query_start_loc int32 [S + 1] (as paged_attention's); slots int64 [S] picks
// each sequence's row of the state pools, which the ops read and update in place.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <tuple>

namespace pagewire {

// x [T, C] -> act(depthwise causal conv1d over cat(state, x)) [T, C]; weight [C, K], bias [C] or
// None, conv_states [N, K - 1, C] in x's dtype (the last K - 1 inputs, oldest first); activation
// "silu" or "none".
at::Tensor gdn_causal_conv1d_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                 at::Tensor& conv_states, const at::Tensor& slots, const at::Tensor& query_start_loc,
                                 c10::string_view activation);
// a, b [T, Hv] -> (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)), both float32 [T, Hv].
std::tuple<at::Tensor, at::Tensor> gdn_gating_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                                                  const at::Tensor& dt_bias);
// q, k [T, Hk, Dk], v [T, Hv, Dv] (Hv a multiple of Hk; value head h reads key head h / (Hv / Hk)),
// g, beta float32 [T, Hv], states float32 [N, Hv, Dk, Dv] -> out [T, Hv, Dv] in v's dtype. q and k
// are l2-normalised inside and q scaled by Dk^-1/2; a sequence's tokens run in chunks of
// chunk_size (one token: the recurrent step).
at::Tensor gated_delta_rule_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, at::Tensor& states, const at::Tensor& slots,
                                const at::Tensor& query_start_loc, int64_t chunk_size);
// x, gate [T, H, D], weight [D] -> weight * RMSNorm(x) * silu(gate), [T, H, D] (Qwen3-Next's RMSNormGated).
at::Tensor gated_rms_norm_cpu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps);

}  // namespace pagewire
