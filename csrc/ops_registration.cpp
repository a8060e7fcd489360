// The pagewire op library: every schema (TORCH_LIBRARY) and the CPU implementations bound to it.
// CUDA implementations register under the same names from csrc/cuda/ (CUDA builds only).
#include <torch/library.h>

#include "cpu/gdn_ops.h"
#include "cpu/hybrid_decode.h"
#include "ops.h"
#include "cpu/moe_route.h"  // moe_route_cpu

namespace pagewire {
// cpu/embedding_gguf.cpp (declared here, not in ops.h, which every kernel file includes)
at::Tensor embedding_gguf_cpu(const at::Tensor& ids, const at::Tensor& weight, c10::string_view qtype,
                              at::ScalarType dtype);
}  // namespace pagewire

TORCH_LIBRARY(pagewire, m) {
  // key, value: [T, num_kv_heads, head_dim]; caches: [num_blocks, num_kv_heads, block_size, head_dim]
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  // out, query: [T, num_heads, head_dim]; block_tables int32 [S, max_blocks]; seq_lens int32 [S];
  // query_start_loc int32 [S + 1]; softcap > 0: scores capped to softcap * tanh(score / softcap);
  // sinks float32 [num_heads] or None: a learned logit per query head that joins each row's softmax
  // (gpt-oss's attention sinks) and contributes no value
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window, "
      "int max_query_len, int max_seq_len, float softcap=0.0, Tensor? sinks=None) -> ()");
  // block_mapping int64 [N, 2] of (src, dst), applied to every layer's caches
  m.def("copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");
  // x [M, K], weight [N, K], bias [N] -> [M, N]; F.linear semantics (small-batch bf16 kernel on CPU)
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // x [T, d], weight [d] -> RMSNorm(x) * weight
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // residual [T, d] += delta, then RMSNorm(residual) * weight
  m.def("add_rms_norm(Tensor(a!) residual, Tensor delta, Tensor weight, float eps) -> Tensor");
  // x [T, heads, head_dim] rotated in place at positions int64 [T] with cos/sin fp32 [P, head_dim/2],
  // after a per-head RMSNorm when norm_weight [heads, head_dim] is given
  m.def("rotary_embedding(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin, Tensor? norm_weight, "
        "float eps) -> ()");
  // x [T, 2 I] = cat(gate, up) -> silu(gate) * up [T, I]
  m.def("silu_and_mul(Tensor x) -> Tensor");
  // x [T, 2 I] = cat(gate, up) -> gelu(gate, approximate="tanh") * up [T, I]
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  // Q8_0 weights: uint8 [N, K / 32 * 34], GGUF's block layout (fp16 scale + 32 int8 per block), or
  // with interleaved=True eight rows at a time (cpu/quant_kernel.h), as interleave_q8_0 makes them
  // bf16 weights in the interleaved x8 layout (uint8 [N, 2K], cpu/linear_kernel.h)
  m.def("interleave_bf16(Tensor weight) -> Tensor");
  m.def("deinterleave_bf16(Tensor weight) -> Tensor");
  m.def("linear_bf16x8(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("embedding_bf16x8(Tensor ids, Tensor weight) -> Tensor");
  // bf16 weights packed losslessly at 12.5 bits a value (uint8 [N, W], cpu/bf16z_layout.h)
  m.def("pack_bf16z(Tensor weight) -> Tensor");
  m.def("unpack_bf16z(Tensor weight, int k) -> Tensor");
  m.def("linear_bf16z(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("embedding_bf16z(Tensor ids, Tensor weight, int k) -> Tensor");
  m.def("quantize_q8_0(Tensor weight) -> Tensor");
  m.def("dequantize_q8_0(Tensor weight, bool interleaved=False) -> Tensor");
  m.def("interleave_q8_0(Tensor weight) -> Tensor");
  // x [M, K] @ dequant(weight)^T + bias [N] -> [M, N] in x's dtype (x quantised per row on the fly)
  m.def("linear_q8_0(Tensor x, Tensor weight, Tensor? bias, bool interleaved=False) -> Tensor");
  // 4-bit / 5-bit / K-quant weights: uint8 [N, K / block * block bytes], GGUF's Q4_0, Q4_1, Q5_0, Q5_1,
  // IQ4_NL, IQ4_XS, Q4_K, Q5_K, Q6_K, MXFP4 ("q4_0" ... "mxfp4"), or interleaved eight rows at a time ("q4_0x8", ...:
  // every type but MXFP4, cpu/quant4_kernel.h parse_q4_name); linear_q4 as linear_q8_0
  m.def("quantize_q4_0(Tensor weight) -> Tensor");
  m.def("dequantize_q4(Tensor weight, str qtype) -> Tensor");
  m.def("linear_q4(Tensor x, Tensor weight, str qtype, Tensor? bias) -> Tensor");
  m.def("interleave_q4(Tensor weight, str qtype) -> Tensor");  // -> the "q4_0x8" / "q4_1x8" layout
  // rows `ids` of a Q8_0 / 4-bit / K-quant table (qtype as dequantize_q4's, or "q8_0" / "q8_0x8")
  // dequantised to `dtype`: [*ids.shape, K] (cpu/embedding_gguf.cpp)
  m.def("embedding_gguf(Tensor ids, Tensor weight, str qtype, ScalarType dtype) -> Tensor");
  // A mixture-of-experts router's choice for CPU logits [T, E] of any T: router "softmax_topk",
  // "topk_softmax" or "sigmoid_topk" as server.models.moe_router.route (and moe_decode) applies it ->
  // ids int64 [T, top_k] and weights float32 [T, top_k] (cpu/moe_route_op.cpp)
  m.def("moe_route(Tensor logits, str router, int top_k, bool norm_topk_prob, Tensor? selection_bias=None, "
        "int n_group=1, int topk_group=1, float routed_scaling=1.0) -> (Tensor ids, Tensor weights)");
  // One decoder layer of at most 16 tokens in one call (ops.h; CPU only)
  m.def(
      "decode_layer(Tensor(a!) hidden, Tensor? delta, Tensor? attn_norm, Tensor? attn_post_norm, Tensor? mlp_norm, "
      "Tensor? mlp_post_norm, float eps, float residual_multiplier, Tensor qkv_weight, str qkv_kind, Tensor? qkv_bias, "
      "Tensor? q_norm, Tensor? k_norm, Tensor o_weight, str o_kind, Tensor? o_bias, Tensor gate_up_weight, "
      "str gate_up_kind, Tensor? gate_up_bias, Tensor down_weight, str down_kind, Tensor? down_bias, Tensor positions, "
      "Tensor? cos, Tensor? sin, Tensor? qk_norm, Tensor(b!) key_cache, Tensor(c!) value_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window, "
      "int max_query_len, int max_seq_len, int num_heads, int num_kv_heads, int head_dim, float softcap=0.0, "
      "str activation=\"silu\", Tensor? v_norm=None, bool shares_kv=False, bool value_from_key=False, "
      "Tensor? per_layer_input=None, Tensor? ple_gate=None, str ple_gate_kind=\"torch\", Tensor? ple_proj=None, "
      "str ple_proj_kind=\"torch\", Tensor? ple_norm=None, Tensor? layer_scalar=None, Tensor? sinks=None, "
      "Tensor[]? lora=None, int[]? lora_spec=None) -> Tensor");
  // The LoRA terms of one fused projection, each row its own adapter (shapes in ops.h)
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor adapter, Tensor a, Tensor spans, Tensor scales, Tensor[] bts, "
        "int[] parts) -> ()");
  // The routed experts of an MoE layer (shapes in ops.h): tokens grouped by expert, only the experts used read
  m.def("moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, str gate_up_kind, "
        "Tensor down, str down_kind, Tensor? gate_up_bias=None, Tensor? down_bias=None, str activation=\"silu\", "
        "float alpha=1.702, float limit=7.0) -> Tensor");
  // A mixture-of-experts layer's router, experts and shared expert for at most 16 tokens (ops.h)
  m.def("moe_decode(Tensor x, Tensor router_weight, str router_kind, Tensor? router_bias, str router, int top_k, "
        "bool norm_topk_prob, Tensor gate_up, str gate_up_kind, Tensor down, str down_kind, Tensor? gate_up_bias, "
        "Tensor? down_bias, str activation, float alpha, float limit, Tensor? shared_gate_up, "
        "str shared_gate_up_kind, Tensor? shared_down, str shared_down_kind, Tensor? shared_gate, "
        "str shared_gate_kind, Tensor? selection_bias=None, int n_group=1, int topk_group=1, "
        "float routed_scaling=1.0) -> Tensor");
  // LFM2's gated short convolution with its per-sequence state (shapes in ops.h)
  m.def("short_conv(Tensor bcx, Tensor weight_t, Tensor? bias, Tensor(a!) state, Tensor slots, "
        "Tensor query_start_loc) -> Tensor");
  // Speculative decoding (shapes in ops.h): the n-gram proposer (CPU only: it reads host token
  // lists) and exact verification by rejection sampling.
  m.def("ngram_propose(Tensor[] token_ids, Tensor num_tokens, int k, int min_n, int max_n) -> Tensor");
  m.def(
      "rejection_sample(Tensor draft_token_ids, Tensor cu_num_draft, Tensor? draft_probs, Tensor? target_probs, "
      "Tensor target_argmax, Tensor is_greedy, Tensor uniform) -> (Tensor, Tensor)");
  // The greedy sampler's argmax per row (CPU; ops.h).
  m.def("argmax_rows(Tensor x) -> Tensor");
  // compute_logits' bf16 -> float32 (CPU; ops.h).
  m.def("widen_rows(Tensor x) -> Tensor");
  // Gated DeltaNet (shapes in ops.h): the states are pools indexed by slots, updated in place.
  m.def("gdn_causal_conv1d(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_states, Tensor slots, "
        "Tensor query_start_loc, str activation=\"silu\") -> Tensor");
  m.def("gdn_gating(Tensor a, Tensor b, Tensor A_log, Tensor dt_bias) -> (Tensor, Tensor)");
  m.def("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states, Tensor slots, "
        "Tensor query_start_loc, int chunk_size=64) -> Tensor");
  m.def("gated_rms_norm(Tensor x, Tensor gate, Tensor weight, float eps) -> Tensor");
  // The hybrids' fused decode layers (at most 16 tokens; shapes in cpu/hybrid_decode.h).
  m.def("gdn_decode_layer(Tensor(a!) hidden, Tensor? delta, Tensor attn_norm, Tensor mlp_norm, float eps, "
        "Tensor in_proj, str in_kind, Tensor conv_weight, Tensor A_log, Tensor dt_bias, Tensor norm_weight, "
        "float norm_eps, Tensor out_proj, str out_kind, Tensor gate_up, str gate_up_kind, Tensor down, str down_kind, "
        "Tensor(b!) conv_states, Tensor(c!) recurrent_states, Tensor slots, Tensor query_start_loc, "
        "int num_key_heads, int num_value_heads, int key_head_dim, int value_head_dim, int chunk_size=64, "
        "Tensor? out_columns=None) -> Tensor");
  m.def("gated_attention_decode_layer(Tensor(a!) hidden, Tensor? delta, Tensor attn_norm, Tensor mlp_norm, "
        "float eps, Tensor qkv_weight, str qkv_kind, Tensor qk_norm, Tensor o_weight, str o_kind, Tensor gate_up, "
        "str gate_up_kind, Tensor down, str down_kind, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(b!) key_cache, Tensor(c!) value_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, int sliding_window, int max_query_len, int max_seq_len, "
        "int num_heads, int num_kv_heads, int head_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagewire, CPU, m) {
  m.impl("write_kv_cache", &pagewire::write_kv_cache_cpu);
  m.impl("paged_attention", &pagewire::paged_attention_cpu);
  m.impl("copy_blocks", &pagewire::copy_blocks_cpu);
  m.impl("linear", &pagewire::linear_cpu);
  m.impl("rms_norm", &pagewire::rms_norm_cpu);
  m.impl("add_rms_norm", &pagewire::add_rms_norm_cpu);
  m.impl("rotary_embedding", &pagewire::rotary_embedding_cpu);
  m.impl("silu_and_mul", &pagewire::silu_and_mul_cpu);
  m.impl("gelu_tanh_and_mul", &pagewire::gelu_tanh_and_mul_cpu);
  m.impl("quantize_q8_0", &pagewire::quantize_q8_0_cpu);
  m.impl("dequantize_q8_0", &pagewire::dequantize_q8_0_cpu);
  m.impl("linear_q8_0", &pagewire::linear_q8_0_cpu);
  m.impl("interleave_q8_0", &pagewire::interleave_q8_0_cpu);
  m.impl("quantize_q4_0", &pagewire::quantize_q4_0_cpu);
  m.impl("interleave_bf16", &pagewire::interleave_bf16_cpu);
  m.impl("deinterleave_bf16", &pagewire::deinterleave_bf16_cpu);
  m.impl("linear_bf16x8", &pagewire::linear_bf16x8_cpu);
  m.impl("embedding_bf16x8", &pagewire::embedding_bf16x8_cpu);
  m.impl("pack_bf16z", &pagewire::pack_bf16z_cpu);
  m.impl("unpack_bf16z", &pagewire::unpack_bf16z_cpu);
  m.impl("linear_bf16z", &pagewire::linear_bf16z_cpu);
  m.impl("embedding_bf16z", &pagewire::embedding_bf16z_cpu);
  m.impl("dequantize_q4", &pagewire::dequantize_q4_cpu);
  m.impl("linear_q4", &pagewire::linear_q4_cpu);
  m.impl("interleave_q4", &pagewire::interleave_q4_cpu);
  m.impl("embedding_gguf", &pagewire::embedding_gguf_cpu);
  m.impl("decode_layer", &pagewire::decode_layer_cpu);
  m.impl("moe_experts", &pagewire::moe_experts_cpu);
  m.impl("lora_add", &pagewire::lora_add_cpu);
  m.impl("moe_decode", &pagewire::moe_decode_cpu);
  m.impl("moe_route", &pagewire::moe_route_cpu);
  m.impl("short_conv", &pagewire::short_conv_cpu);
  m.impl("ngram_propose", &pagewire::ngram_propose_cpu);
  m.impl("rejection_sample", &pagewire::rejection_sample_cpu);
  m.impl("argmax_rows", &pagewire::argmax_rows_cpu);
  m.impl("widen_rows", &pagewire::widen_rows_cpu);
  m.impl("gdn_causal_conv1d", &pagewire::gdn_causal_conv1d_cpu);
  m.impl("gdn_gating", &pagewire::gdn_gating_cpu);
  m.impl("gated_delta_rule", &pagewire::gated_delta_rule_cpu);
  m.impl("gated_rms_norm", &pagewire::gated_rms_norm_cpu);
  m.impl("gdn_decode_layer", &pagewire::gdn_decode_layer_cpu);
  m.impl("gated_attention_decode_layer", &pagewire::gated_attention_decode_layer_cpu);
}
