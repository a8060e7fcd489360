// The pagewire op library: every schema (TORCH_LIBRARY) and the CPU implementations bound to it.
// CUDA implementations register under the same names from csrc/cuda/ (CUDA builds only).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(pagewire, m) {
  // key, value: [T, num_kv_heads, head_dim]; caches: [num_blocks, num_kv_heads, block_size, head_dim]
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  // out, query: [T, num_heads, head_dim]; block_tables int32 [S, max_blocks]; seq_lens int32 [S];
  // query_start_loc int32 [S + 1]
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window, "
      "int max_query_len, int max_seq_len) -> ()");
  // block_mapping int64 [N, 2] of (src, dst), applied to every layer's caches
  m.def("copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");
  // x [M, K], weight [N, K], bias [N] -> [M, N]; F.linear semantics (small-batch bf16 kernel on CPU)
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagewire, CPU, m) {
  m.impl("write_kv_cache", &pagewire::write_kv_cache_cpu);
  m.impl("paged_attention", &pagewire::paged_attention_cpu);
  m.impl("copy_blocks", &pagewire::copy_blocks_cpu);
  m.impl("linear", &pagewire::linear_cpu);
}
