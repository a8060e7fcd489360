// Declarations of the hybrid families' fused decode layers (cpu/hybrid_decode.cpp), kept out of
// ops.h so that adding them rebuilds only the files that use them. Both take at most 16 tokens and
// return the layer's MLP output [T, hidden], left for the next layer's norm to add (as
// decode_layer does); hidden is updated in place.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

namespace pagewire {

// A Gated DeltaNet layer with a dense MLP: in_proj [q, k, v, z, b, a rows], conv_weight [C, K],
// A_log, dt_bias [Hv], norm_weight [Dv]; the state pools and batch as the gdn ops take them;
// out_columns int64 [value_dim] or None: out_proj's input gathered by it (GatedDeltaNet.out_columns).
at::Tensor gdn_decode_layer_cpu(at::Tensor& hidden, const c10::optional<at::Tensor>& delta, const at::Tensor& attn_norm,
                                const at::Tensor& mlp_norm, double eps, const at::Tensor& in_proj,
                                c10::string_view in_kind, const at::Tensor& conv_weight, const at::Tensor& A_log,
                                const at::Tensor& dt_bias, const at::Tensor& norm_weight, double norm_eps,
                                const at::Tensor& out_proj, c10::string_view out_kind, const at::Tensor& gate_up,
                                c10::string_view gate_up_kind, const at::Tensor& down, c10::string_view down_kind,
                                at::Tensor& conv_states, at::Tensor& recurrent_states, const at::Tensor& slots,
                                const at::Tensor& query_start_loc, int64_t num_key_heads, int64_t num_value_heads,
                                int64_t key_head_dim, int64_t value_head_dim, int64_t chunk_size,
                                const c10::optional<at::Tensor>& out_columns);
// A gated full-attention layer with a dense MLP: qkv_weight [q, k, v, gate rows], qk_norm per head
// [heads + kv heads, head_dim], cos/sin the (partial) rotary tables; the rest as decode_layer's.
at::Tensor gated_attention_decode_layer_cpu(
    at::Tensor& hidden, const c10::optional<at::Tensor>& delta, const at::Tensor& attn_norm, const at::Tensor& mlp_norm,
    double eps, const at::Tensor& qkv_weight, c10::string_view qkv_kind, const at::Tensor& qk_norm,
    const at::Tensor& o_weight, c10::string_view o_kind, const at::Tensor& gate_up, c10::string_view gate_up_kind,
    const at::Tensor& down, c10::string_view down_kind, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
    int64_t sliding_window, int64_t max_query_len, int64_t max_seq_len, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim);

}  // namespace pagewire
