// Declarations of the pagewire tensor ops (schemas live in ops_registration.cpp).
// Every shape below is the one the schema promises; the CPU implementations check them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

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
void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                         int64_t sliding_window, int64_t max_query_len, int64_t max_seq_len);

// key_caches, value_caches: one [num_blocks, num_kv_heads, block_size, head_dim] per layer (mutated)
// block_mapping:            int64 [N, 2] rows of (src, dst) physical block ids
void copy_blocks_cpu(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping);

// x: [M, K], weight: [N, K] (nn.Linear layout), bias: [N] or None -> [M, N] in x's dtype.
// bf16 on AVX512-BF16 CPUs runs the small-batch kernel; everything else is at::linear.
at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

}  // namespace pagewire
