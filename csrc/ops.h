// Declarations of the pagewire tensor ops (schemas live in ops_registration.cpp).
// Every shape below is the one the schema promises; the CPU implementations check them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string>
#include <tuple>

namespace pagewire {

// key, value:             [T, num_kv_heads, head_dim]
// key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim]   (mutated)
// slot_mapping:           int64 [T]; slot = block * block_size + offset, -1 = skip
void write_kv_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                        at::Tensor& value_cache, const at::Tensor& slot_mapping);

// out, query:             [T, num_heads, head_dim]                            (out mutated)
// key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim]
// block_tables:           int32 [S, max_blocks]
// seq_lens:               int32 [S]       tokens in cache after this step
// query_start_loc:        int32 [S + 1]   prefix sum of new tokens per sequence
// scale multiplies q.k; softcap > 0 then caps each score to softcap * tanh(score / softcap)
// (Gemma 2's attention soft-capping) before the mask and softmax; softcap 0 is off.
// sinks: float32 [num_heads] or None; head h's sink joins every row's softmax denominator as one more
// logit with no value (gpt-oss), so out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sinks[h])).
void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                         int64_t sliding_window, int64_t max_query_len, int64_t max_seq_len, double softcap,
                         const c10::optional<at::Tensor>& sinks);

// key_caches, value_caches: one [num_blocks, num_kv_heads, block_size, head_dim] per layer (mutated)
// block_mapping:            int64 [N, 2] rows of (src, dst) physical block ids
void copy_blocks_cpu(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping);

// LFM2's gated short convolution (cpu/short_conv_kernel.h): bcx [T, 3C] = in_proj(x) (B, C, x chunks),
// weight_t fp32 [K, C], bias fp32 [C] or None, state [slots, K - 1, C] of bcx's dtype (mutated: each
// sequence's slot), slots int64 [S], query_start_loc int32 [S + 1] -> [T, C] = C * conv(B * x).
at::Tensor short_conv_cpu(const at::Tensor& bcx, const at::Tensor& weight_t, const c10::optional<at::Tensor>& bias,
                          at::Tensor& state, const at::Tensor& slots, const at::Tensor& query_start_loc);

// x: [M, K], weight: [N, K] (nn.Linear layout), bias: [N] or None -> [M, N] in x's dtype.
// bf16 runs the small-batch kernel of the CPU's family (AVX512-BF16 or AVX2+FMA, cpu/cpu_features.h);
// everything else, and CPUs with neither, is at::linear.
at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// bf16 weights in the interleaved x8 layout (cpu/linear_kernel.h), which the AVX2 bf16 kernel
// streams fastest: weight uint8 [N, 2K] (the [N, K] bf16 matrix's bytes, moved; K % 16 == 0).
at::Tensor interleave_bf16_cpu(const at::Tensor& weight);    // bf16 [N, K] -> uint8 [N, 2K]
at::Tensor deinterleave_bf16_cpu(const at::Tensor& weight);  // uint8 [N, 2K] -> bf16 [N, K]
// x [M, K] @ weight^T + bias [N] -> [M, N] in x's dtype: bf16 x through the family's x8 kernel
// (pagewire::linear's result, bit for bit: AVX2 at every M, AVX512-BF16 up to 256 rows and in
// batch-invariant mode, above that ATen's GEMM on de-interleaved chunks); other dtypes or no AVX2,
// at::linear.
at::Tensor linear_bf16x8_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
// ids int64 [...] -> bf16 [..., K]: F.embedding of the x8 weight's rows (a tied embedding table).
at::Tensor embedding_bf16x8_cpu(const at::Tensor& ids, const at::Tensor& weight);
// The packed bf16 layout (cpu/bf16z_layout.h: the x8 layout at 12.5 bits a value, lossless): a
// uint8 [N, W] buffer. pack_bf16z: bf16 [N, K] (K % 16 == 0) -> the buffer; unpack_bf16z: the
// buffer -> bf16 [N, K] (k: the weight's K, checked); linear_bf16z and embedding_bf16z as the x8 ops.
at::Tensor pack_bf16z_cpu(const at::Tensor& weight);
at::Tensor unpack_bf16z_cpu(const at::Tensor& weight, int64_t k);
at::Tensor linear_bf16z_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor embedding_bf16z_cpu(const at::Tensor& ids, const at::Tensor& weight, int64_t k);

// Q8_0 quantised weights (GGUF's block layout: per 32 values an fp16 scale and 32 int8), see
// cpu/quant_kernel.h. weight: uint8 [N, K / 32 * 34].
constexpr int64_t kQ8KernelMaxRows = 16;  // larger batches dequantise and use ATen's GEMM
at::Tensor quantize_q8_0_cpu(const at::Tensor& weight);    // float [N, K] -> Q8_0 bytes
// interleaved: the weight is in the x8 layout (cpu/quant_kernel.h) that interleave_q8_0 makes.
at::Tensor dequantize_q8_0_cpu(const at::Tensor& weight, bool interleaved);  // Q8_0 bytes -> float32 [N, K]
at::Tensor interleave_q8_0_cpu(const at::Tensor& weight);  // row layout -> x8 layout, same shape
// x [M, K] (float32, bfloat16 or float16) @ dequant(weight)^T + bias [N] -> [M, N] in x's dtype
at::Tensor linear_q8_0_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           bool interleaved);
// The same, but the integer kernel at every M: above kQ8KernelMaxRows it runs in blocks of that many
// rows into one output, so each row's floats are those of a call with its block alone (the autotune's
// "kernel" choice for large buckets and batch-invariant mode; server._C.fast.linear_q8_0_rows).
at::Tensor linear_q8_0_rows_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                bool interleaved);

// 4-bit, 5-bit and K-quant weights (GGUF's Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_K,
// Q5_K, Q6_K, MXFP4 layouts), see cpu/quant4_kernel.h. weight: uint8 [N, K / block * block bytes]; qtype:
// "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "mxfp4", or with "x8" (all but mxfp4) in
// the interleaved x8 layout (cpu/quant4_kernel.h parse_q4_name).
constexpr int64_t kQ4KernelMaxRows = 16;  // larger batches dequantise chunks and use ATen's GEMM
at::Tensor quantize_q4_0_cpu(const at::Tensor& weight);  // float [N, K] -> Q4_0 bytes
at::Tensor dequantize_q4_cpu(const at::Tensor& weight, c10::string_view qtype);  // -> float32 [N, K]
// A row-layout qtype with an x8 layout -> that layout ("q4_0x8", ..., "iq4_nlx8"), same shape.
at::Tensor interleave_q4_cpu(const at::Tensor& weight, c10::string_view qtype);
// x [M, K] (float32, bfloat16 or float16) @ dequant(weight)^T + bias [N] -> [M, N] in x's dtype
at::Tensor linear_q4_cpu(const at::Tensor& x, const at::Tensor& weight, c10::string_view qtype,
                         const c10::optional<at::Tensor>& bias);
// The kernel at every M, as linear_q8_0_rows_cpu (server._C.fast.linear_q4_rows).
at::Tensor linear_q4_rows_cpu(const at::Tensor& x, const at::Tensor& weight, c10::string_view qtype,
                              const c10::optional<at::Tensor>& bias);

// Fused decoder-layer elementwise ops (fused_ops.cpp); float32, bfloat16 or float16, rounding
// as transformers does.
// x: [T, d] (rows may be strided), weight: [d] -> RMSNorm(x) * weight, [T, d]
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
// residual += delta (mutated, rounded to its dtype), then returns RMSNorm(residual) * weight
at::Tensor add_rms_norm_cpu(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps);
// x: [T, heads, head_dim] (mutated; rows and heads may be strided), positions int64 [T],
// cos/sin float32 [max_positions, head_dim / 2]; norm_weight [heads, head_dim] or None applies a
// per-head RMSNorm (Qwen3's q/k norm) before the rotation.
void rotary_embedding_cpu(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                          const c10::optional<at::Tensor>& norm_weight, double eps);
// x: [T, 2 * I] = cat(gate, up) -> silu(gate) * up, [T, I]
at::Tensor silu_and_mul_cpu(const at::Tensor& x);
// x: [T, 2 * I] = cat(gate, up) -> gelu_tanh(gate) * up, [T, I] (Gemma's gelu_pytorch_tanh)
at::Tensor gelu_tanh_and_mul_cpu(const at::Tensor& x);

// LoRA terms of one fused projection for a batch of rows, each row its own adapter (cpu/lora_kernel.h):
// out [T, N] (mutated) += per row t with adapter[t] = k >= 0 (int32 [T], -1: none) and per part p:
// scales[k] * Bᵀ_p[k]ᵀ (A[k] x[t]) into out's columns [row_p, row_p + rows_p), rounded as PEFT in x's
// dtype (float32, bfloat16 or float16). a [R, in]: every adapter's A rows stacked; bts[p] [C_p, rows_p]:
// part p's Bᵀ over rows [c0_p, c0_p + C_p) of a; spans int32 [n, P, 2]: adapter k's (first row of a,
// rank) in part p (rank 0: none); scales float32 [n]; parts: (row_p, rows_p, c0_p) per part.
void lora_add_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& adapter, const at::Tensor& a,
                  const at::Tensor& spans, const at::Tensor& scales, at::TensorList bts, at::IntArrayRef parts);

// One decoder layer of at most 16 tokens (cpu/decode_layer.cpp): the ops above in the Python
// layer's order. hidden [T, H] (the residual stream, mutated), delta [T, H] or None (the previous
// layer's MLP output); norms [H] or None by placement (attn_norm/mlp_norm before each sub-block,
// attn_post_norm/mlp_post_norm on its output); residual_multiplier scales each sub-block's output;
// q_norm [q] / k_norm [kv]: RMSNorm over the whole projection (OLMo 2), qk_norm [heads, head_dim]:
// per head (Qwen3, Gemma 3); cos/sin None: a NoPE layer, narrower than head_dim / 2: partial
// rotary; *_kind: the linear path per matrix ("kernel", "torch", "q8_0", "q8_0x8", or a linear_q4
// qtype); caches mutated; softcap and sinks as paged_attention's; activation "silu" or "gelu_tanh" (the gated
// MLP's). Gemma 4's parts: v_norm [head_dim] (the weightless value norm); shares_kv: the layer
// projects queries only and attends over the caches given (an earlier layer's), writing nothing;
// value_from_key: no v rows in qkv, the values are the key projection; per_layer_input [T, P] with
// ple_gate [P, H], ple_proj [H, P] (and their kinds), ple_norm [H]: the per-layer input block;
// layer_scalar [1]. lora / lora_spec: a step's stacked LoRA terms (server/models/lora.py, LoraStep.
// fused_args), each added to its projection's output as LoraStep.add adds it, op for op; empty:
// none. Returns this layer's MLP output [T, H] as it joins the residual stream, or, when
// the layer ends itself (per-layer input block or layer scalar: the output already added), [0, H].
at::Tensor decode_layer_cpu(at::Tensor& hidden, const c10::optional<at::Tensor>& delta,
                            const c10::optional<at::Tensor>& attn_norm, const c10::optional<at::Tensor>& attn_post_norm,
                            const c10::optional<at::Tensor>& mlp_norm, const c10::optional<at::Tensor>& mlp_post_norm,
                            double eps, double residual_multiplier, const at::Tensor& qkv_weight,
                            c10::string_view qkv_kind, const c10::optional<at::Tensor>& qkv_bias,
                            const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                            const at::Tensor& o_weight, c10::string_view o_kind, const c10::optional<at::Tensor>& o_bias,
                            const at::Tensor& gate_up_weight, c10::string_view gate_up_kind,
                            const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down_weight,
                            c10::string_view down_kind, const c10::optional<at::Tensor>& down_bias,
                            const at::Tensor& positions, const c10::optional<at::Tensor>& cos,
                            const c10::optional<at::Tensor>& sin, const c10::optional<at::Tensor>& qk_norm,
                            at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                            int64_t max_query_len, int64_t max_seq_len, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, double softcap, c10::string_view activation,
                            const c10::optional<at::Tensor>& v_norm, bool shares_kv, bool value_from_key,
                            const c10::optional<at::Tensor>& per_layer_input, const c10::optional<at::Tensor>& ple_gate,
                            c10::string_view ple_gate_kind, const c10::optional<at::Tensor>& ple_proj,
                            c10::string_view ple_proj_kind, const c10::optional<at::Tensor>& ple_norm,
                            const c10::optional<at::Tensor>& layer_scalar,
                            const c10::optional<at::Tensor>& sinks, c10::optional<at::TensorList> lora,
                            at::OptionalIntArrayRef lora_spec);

// The routed experts of a mixture-of-experts layer (cpu/moe.cpp). x [T, H] (float32, bfloat16 or
// float16); topk_ids int64 [T, k] (expert per slot, -1 = empty), topk_weights float32 [T, k];
// gate_up [E, 2I, H] and down [E, H, I] stacked per expert, each either float of x's dtype (kind
// "float") or uint8 GGUF blocks [E, rows, row bytes] (kind "q8_0", "q8_0x8", "mxfp4" or a linear_q4
// qtype; mxfp4 experts go through linear_q4 with qtype "mxfp4": the integer kernels read their blocks).
// Tokens are grouped by expert and only the experts used are read; each token's k results are
// summed in slot order in fp32. Returns [T, H] in x's dtype. gate_up_bias [E, 2I] and down_bias
// [E, H] (x's dtype) or None; activation "silu" (SiLU(gate) * up) or "swiglu_oai" (gpt-oss's
// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)).
at::Tensor moe_experts_cpu(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                           const at::Tensor& gate_up, c10::string_view gate_up_kind, const at::Tensor& down,
                           c10::string_view down_kind, const c10::optional<at::Tensor>& gate_up_bias,
                           const c10::optional<at::Tensor>& down_bias, c10::string_view activation, double alpha,
                           double limit);

// x @ w^T (+ b) by one of decode_layer's linear kinds ("kernel", "torch", "q8_0", "q8_0x8", a linear_q4
// qtype, "parts:KIND*ROWS+...": row ranges in other formats): ops.linear's path (cpu/decode_layer.cpp).
at::Tensor run_linear_kind(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                           const std::string& kind);

// A mixture-of-experts layer's MLP for at most 16 tokens in one call (cpu/moe_decode.cpp): the
// router (router_weight [E, H] by router_kind, x cast to its dtype, router_bias [E] or None; router "softmax_topk" or
// "sigmoid_topk" with top_k and norm_topk_prob, or "topk_softmax"; for the first two
// selection_bias [E] or None, n_group / topk_group and routed_scaling as moe_router.route applies
// them), the experts as moe_experts_cpu takes them, and optionally a shared expert (shared_gate_up
// [2S, H], shared_down [H, S] by their kinds, both or neither; shared_gate [1, H] by its kind, or
// None for an ungated one). x [T, H] -> [T, H] in x's dtype.
at::Tensor moe_decode_cpu(const at::Tensor& x, const at::Tensor& router_weight, c10::string_view router_kind,
                          const c10::optional<at::Tensor>& router_bias, c10::string_view router, int64_t top_k,
                          bool norm_topk_prob, const at::Tensor& gate_up, c10::string_view gate_up_kind,
                          const at::Tensor& down, c10::string_view down_kind,
                          const c10::optional<at::Tensor>& gate_up_bias, const c10::optional<at::Tensor>& down_bias,
                          c10::string_view activation, double alpha, double limit,
                          const c10::optional<at::Tensor>& shared_gate_up, c10::string_view shared_gate_up_kind,
                          const c10::optional<at::Tensor>& shared_down, c10::string_view shared_down_kind,
                          const c10::optional<at::Tensor>& shared_gate, c10::string_view shared_gate_kind,
                          const c10::optional<at::Tensor>& selection_bias, int64_t n_group, int64_t topk_group,
                          double routed_scaling);

// Speculative decoding (cpu/spec_decode.cpp).
// token_ids: S contiguous int64 vectors (each sequence's prompt + output; may be longer than used),
// num_tokens: int64 [S] tokens used of each -> int64 [S, k]: per sequence the k tokens that followed
// the latest earlier occurrence of its longest suffix n-gram (min_n <= n <= max_n), -1 = none.
at::Tensor ngram_propose_cpu(at::TensorList token_ids, const at::Tensor& num_tokens, int64_t k, int64_t min_n,
                             int64_t max_n);
// Exact verification of drafted tokens (Leviathan et al. 2023 / Chen et al. 2023). S sequences,
// sequence i has k_i = cu_num_draft[i + 1] - cu_num_draft[i] drafts and k_i + 1 target rows (rows
// cu_num_draft[i] + i ..., the last one for the bonus token). ND = total drafts, V = vocabulary.
//   draft_token_ids int64 [ND]; cu_num_draft int64 [S + 1] (cu[0] = 0);
//   draft_probs     float32 [ND, V], or None: each draft is a point mass (n-gram proposer);
//   target_probs    float32 [ND + S, V] (normalised), None only when every row is greedy;
//   target_argmax   int64 [ND + S] (the greedy token of each target row);
//   is_greedy       bool [S];  uniform float64 [ND + S] in [0, 1): row j's acceptance draw, and the
//                   last row's draw for the residual or bonus sample.
// Returns (output_token_ids int64 [S, max k_i + 1], -1 padded; num_emitted int64 [S], in 1..k_i + 1).
std::tuple<at::Tensor, at::Tensor> rejection_sample_cpu(const at::Tensor& draft_token_ids,
                                                        const at::Tensor& cu_num_draft,
                                                        const c10::optional<at::Tensor>& draft_probs,
                                                        const c10::optional<at::Tensor>& target_probs,
                                                        const at::Tensor& target_argmax, const at::Tensor& is_greedy,
                                                        const at::Tensor& uniform);

// The greedy sampler's argmax (cpu/argmax.cpp): x float32 or bf16 [S, V] -> int64 [S], each row's
// first index of its largest value, a NaN counting as the largest (torch.argmax's choice).
at::Tensor argmax_rows_cpu(const at::Tensor& x);
// Whether argmax_rows_cpu takes x (CPU, float32 or bf16, 2-D, columns, contiguous in them), and its
// body: the S indices into op (argmax_rows_applies(x) must hold).
bool argmax_rows_applies(const at::Tensor& x);
void argmax_rows_into(const at::Tensor& x, int64_t* op);
// compute_logits' widening (cpu/widen_rows.cpp): bf16 [S, V] -> float32 [S, V], exactly; one row on the
// calling thread, several by each thread's column slice (the linear kernels' split).
at::Tensor widen_rows_cpu(const at::Tensor& x);

}  // namespace pagewire
