// The two layer kinds of the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE with dense
// MLPs) as one C++ call each for a small CPU batch (at most 16 tokens: decode steps), as
// decode_layer.cpp does for the attention-only families:
//   * gdn_decode_layer: norm, the fused in-projection, the causal conv1d with its state, the gating,
//     the gated delta rule on the recurrent state, the gated RMSNorm, out_proj, norm, MLP
//     (server/models/qwen3_next.py GdnLayer.forward and gated_deltanet.py GatedDeltaNet.forward);
//   * gated_attention_decode_layer: norm, qkv + output-gate rows, per-head q/k RMSNorm, partial
//     RoPE, KV write, paged attention, sigmoid(gate) * attention, o_proj, norm, MLP
//     (GatedAttentionLayer.forward).
// Each runs exactly the ops its Python layer calls, in the same order on the same tensors, so it
// gives the same floats (tests/models/test_hybrid_decode.py); what it saves is the Python between
// them: about a dozen op dispatches per layer and the wrappers' checks.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>

#include <string>
#include <tuple>

#include "../ops.h"
#include "gdn_ops.h"
#include "hybrid_decode.h"
#include "layer_parts.h"

namespace pagewire {

using layer_parts::enter;
using layer_parts::run_linear;
using layer_parts::torch_rms_norm;

namespace {

// The dense MLP's half of a layer: gate/up, silu(gate) * up, down; its output is left for the
// next layer's norm to add.
at::Tensor mlp(const at::Tensor& x, const at::Tensor& gate_up, c10::string_view gate_up_kind, const at::Tensor& down,
               c10::string_view down_kind) {
  const at::Tensor act = silu_and_mul_cpu(run_linear(x, gate_up, c10::nullopt, std::string(gate_up_kind)));
  return run_linear(act, down, c10::nullopt, std::string(down_kind));
}

void check_small(const at::Tensor& hidden, const char* op) {
  TORCH_CHECK(hidden.device().is_cpu() && hidden.dim() == 2, op, ": hidden must be a CPU [T, hidden] tensor, got ",
              hidden.sizes(), " on ", hidden.device());
  TORCH_CHECK(hidden.size(0) <= kQ8KernelMaxRows, op, " takes at most ", kQ8KernelMaxRows, " tokens, got ",
              hidden.size(0));
}

}  // namespace

at::Tensor gdn_decode_layer_cpu(at::Tensor& hidden, const c10::optional<at::Tensor>& delta, const at::Tensor& attn_norm,
                                const at::Tensor& mlp_norm, double eps, const at::Tensor& in_proj,
                                c10::string_view in_kind, const at::Tensor& conv_weight, const at::Tensor& A_log,
                                const at::Tensor& dt_bias, const at::Tensor& norm_weight, double norm_eps,
                                const at::Tensor& out_proj, c10::string_view out_kind, const at::Tensor& gate_up,
                                c10::string_view gate_up_kind, const at::Tensor& down, c10::string_view down_kind,
                                at::Tensor& conv_states, at::Tensor& recurrent_states, const at::Tensor& slots,
                                const at::Tensor& query_start_loc, int64_t num_key_heads, int64_t num_value_heads,
                                int64_t key_head_dim, int64_t value_head_dim, int64_t chunk_size,
                                const c10::optional<at::Tensor>& out_columns) {
  check_small(hidden, "gdn_decode_layer");
  const int64_t T = hidden.size(0);
  const int64_t kd = num_key_heads * key_head_dim, vd = num_value_heads * value_head_dim, Hv = num_value_heads;
  const int64_t cd = 2 * kd + vd;
  const at::Tensor x = enter(hidden, delta, attn_norm, eps);
  const at::Tensor proj = run_linear(x, in_proj, c10::nullopt, std::string(in_kind));
  TORCH_CHECK(proj.size(1) == cd + vd + 2 * Hv, "gdn_decode_layer: in_proj has ", proj.size(1),
              " rows, the heads say ", cd + vd + 2 * Hv);
  const at::Tensor mixed = gdn_causal_conv1d_cpu(proj.narrow(1, 0, cd), conv_weight, c10::nullopt, conv_states, slots,
                                                 query_start_loc, "silu");
  const at::Tensor q = mixed.narrow(1, 0, kd).view({T, num_key_heads, key_head_dim});
  const at::Tensor k = mixed.narrow(1, kd, kd).view({T, num_key_heads, key_head_dim});
  const at::Tensor v = mixed.narrow(1, 2 * kd, vd).view({T, Hv, value_head_dim});
  const at::Tensor z = proj.narrow(1, cd, vd).view({T, Hv, value_head_dim});
  const at::Tensor b = proj.narrow(1, cd + vd, Hv);
  const at::Tensor a = proj.narrow(1, cd + vd + Hv, Hv);
  const auto [g, beta] = gdn_gating_cpu(a, b, A_log, dt_bias);
  const at::Tensor core = gated_delta_rule_cpu(q, k, v, g, beta, recurrent_states, slots, query_start_loc, chunk_size);
  const at::Tensor normed = gated_rms_norm_cpu(core, z, norm_weight, norm_eps);
  at::Tensor flat = normed.view({T, vd});
  // A GGUF ssm_out kept in the file's column order reads its input gathered into that order.
  if (out_columns.has_value() && out_columns->defined()) flat = at::index_select(flat, 1, *out_columns);
  const at::Tensor out = run_linear(flat, out_proj, c10::nullopt, std::string(out_kind));
  const at::Tensor x2 = enter(hidden, out, mlp_norm, eps);
  return mlp(x2, gate_up, gate_up_kind, down, down_kind);
}

at::Tensor gated_attention_decode_layer_cpu(
    at::Tensor& hidden, const c10::optional<at::Tensor>& delta, const at::Tensor& attn_norm, const at::Tensor& mlp_norm,
    double eps, const at::Tensor& qkv_weight, c10::string_view qkv_kind, const at::Tensor& qk_norm,
    const at::Tensor& o_weight, c10::string_view o_kind, const at::Tensor& gate_up, c10::string_view gate_up_kind,
    const at::Tensor& down, c10::string_view down_kind, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
    int64_t sliding_window, int64_t max_query_len, int64_t max_seq_len, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim) {
  check_small(hidden, "gated_attention_decode_layer");
  const int64_t T = hidden.size(0);
  const int64_t q = num_heads * head_dim, kv = num_kv_heads * head_dim, rotary_dim = 2 * cos.size(1);
  TORCH_CHECK(rotary_dim > 0 && rotary_dim <= head_dim, "gated_attention_decode_layer: the RoPE tables rotate ",
              rotary_dim, " dims of a ", head_dim, "-dim head");
  const at::Tensor x = enter(hidden, delta, attn_norm, eps);
  const at::Tensor qkv = run_linear(x, qkv_weight, c10::nullopt, std::string(qkv_kind));  // [q, k, v, gate]
  TORCH_CHECK(qkv.size(1) == 2 * q + 2 * kv, "gated_attention_decode_layer: qkv has ", qkv.size(1),
              " rows, the heads say ", 2 * q + 2 * kv);
  at::Tensor qk = qkv.narrow(1, 0, q + kv).view({T, num_heads + num_kv_heads, head_dim});
  qk.copy_(torch_rms_norm(qk, qk_norm, eps));
  at::Tensor turned = rotary_dim == head_dim ? qk : qk.narrow(2, 0, rotary_dim);
  rotary_embedding_cpu(turned, positions, cos, sin, c10::nullopt, eps);
  write_kv_cache_cpu(qk.narrow(1, num_heads, num_kv_heads), qkv.narrow(1, q + kv, kv).view({T, num_kv_heads, head_dim}),
                     key_cache, value_cache, slot_mapping);
  at::Tensor attn = at::empty({T, num_heads, head_dim}, hidden.options());
  paged_attention_cpu(attn, qk.narrow(1, 0, num_heads), key_cache, value_cache, block_tables, seq_lens,
                      query_start_loc, scale, sliding_window, max_query_len, max_seq_len, 0.0, c10::nullopt);
  const at::Tensor gated = at::mul(attn.view({T, q}), at::sigmoid(qkv.narrow(1, q + 2 * kv, q)));
  const at::Tensor o = run_linear(gated, o_weight, c10::nullopt, std::string(o_kind));
  const at::Tensor x2 = enter(hidden, o, mlp_norm, eps);
  return mlp(x2, gate_up, gate_up_kind, down, down_kind);
}

}  // namespace pagewire
