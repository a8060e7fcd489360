// Declarations of the CUDA implementations of the pagewire ops (CUDA builds only; registered in
// registration_cuda.cu). Shapes are those of the schemas in csrc/ops_registration.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace pagewire {

void write_kv_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                         at::Tensor& value_cache, const at::Tensor& slot_mapping);

void paged_attention_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                          int64_t max_query_len, int64_t max_seq_len, double softcap,
                          const c10::optional<at::Tensor>& sinks);

void copy_blocks_cuda(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping);

std::tuple<at::Tensor, at::Tensor> rejection_sample_cuda(const at::Tensor& draft_token_ids,
                                                         const at::Tensor& cu_num_draft,
                                                         const c10::optional<at::Tensor>& draft_probs,
                                                         const c10::optional<at::Tensor>& target_probs,
                                                         const at::Tensor& target_argmax, const at::Tensor& is_greedy,
                                                         const at::Tensor& uniform);

// The routed experts of a MoE layer (moe.cu): float experts only (kind "float").
at::Tensor moe_experts_cuda(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                            const at::Tensor& gate_up, c10::string_view gate_up_kind, const at::Tensor& down,
                            c10::string_view down_kind, const c10::optional<at::Tensor>& gate_up_bias,
                            const c10::optional<at::Tensor>& down_bias, c10::string_view activation, double alpha,
                            double limit);

}  // namespace pagewire
