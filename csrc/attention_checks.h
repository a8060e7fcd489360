// Argument checks of the paged_attention op, shared by its CPU (csrc/cpu/attention.cpp) and CUDA
// (csrc/cuda/attention.cu) implementations so both reject the same calls with the same messages.
// Header-only and host-only: it reads tensor metadata, never tensor data, so it is safe to call
// before a device kernel launch. Checks that need the data (query_start_loc monotonic, block ids in
// range) stay with the CPU planner, which reads those tensors on the host anyway.
#pragma once

#include <cmath>
#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace pagewire {

// The shapes paged_attention works with, read off validated arguments.
struct PagedAttentionDims {
  int64_t num_tokens, num_heads, head_dim;
  int64_t num_blocks, num_kv_heads, block_size;
  int64_t num_seqs;
};

namespace detail {

inline void check_int32_vector(const at::Tensor& t, const char* name, int64_t len, const at::Device& device) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, " (query's device), got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == len, name, " must have shape [", len, "], got ", t.sizes());
}

inline void check_cache(const at::Tensor& cache, const char* name, const at::Device& device, at::ScalarType dtype) {
  TORCH_CHECK(cache.device() == device, name, " must be on ", device, " (query's device), got ", cache.device());
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, num_kv_heads, block_size, head_dim], got shape ",
              cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(cache.scalar_type() == dtype, name, " dtype ", cache.scalar_type(), " must equal query dtype ", dtype);
}

}  // namespace detail

// Throws c10::Error (RuntimeError in Python) naming the offending argument. Every tensor must be
// on query's device; the caller's dispatch key already decided which device that is.
inline PagedAttentionDims check_paged_attention_args(const at::Tensor& out, const at::Tensor& query,
                                                     const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                     const at::Tensor& query_start_loc, double scale,
                                                     double softcap) {
  const at::Device device = query.device();
  TORCH_CHECK(query.dim() == 3, "query must be [T, num_heads, head_dim], got shape ", query.sizes());
  const at::ScalarType dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "query dtype must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(out.sizes() == query.sizes(), "out shape ", out.sizes(), " must equal query shape ", query.sizes());
  TORCH_CHECK(out.device() == device, "out must be on ", device, " (query's device), got ", out.device());
  TORCH_CHECK(out.scalar_type() == dtype, "out dtype ", out.scalar_type(), " must equal query dtype ", dtype);
  detail::check_cache(key_cache, "key_cache", device, dtype);
  detail::check_cache(value_cache, "value_cache", device, dtype);
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "value_cache shape ", value_cache.sizes(),
              " must equal key_cache shape ", key_cache.sizes());
  PagedAttentionDims d{};
  d.num_tokens = query.size(0);
  d.num_heads = query.size(1);
  d.head_dim = query.size(2);
  d.num_blocks = key_cache.size(0);
  d.num_kv_heads = key_cache.size(1);
  d.block_size = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == d.head_dim, "key_cache head_dim ", key_cache.size(3),
              " must equal query head_dim ", d.head_dim);
  TORCH_CHECK(d.num_kv_heads > 0 && d.num_heads % d.num_kv_heads == 0, "query num_heads ", d.num_heads,
              " must be a multiple of key_cache num_kv_heads ", d.num_kv_heads);
  TORCH_CHECK(query.stride(2) == 1, "query must be contiguous in head_dim");
  TORCH_CHECK(out.stride(2) == 1, "out must be contiguous in head_dim");
  TORCH_CHECK(block_tables.device() == device, "block_tables must be on ", device, " (query's device), got ",
              block_tables.device());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt, "block_tables must be int32, got ", block_tables.scalar_type());
  TORCH_CHECK(block_tables.dim() == 2, "block_tables must be [S, max_blocks], got shape ", block_tables.sizes());
  d.num_seqs = block_tables.size(0);
  detail::check_int32_vector(seq_lens, "seq_lens", d.num_seqs, device);
  detail::check_int32_vector(query_start_loc, "query_start_loc", d.num_seqs + 1, device);
  TORCH_CHECK(std::isfinite(scale) && scale > 0, "scale must be a positive finite number, got ", scale);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0, "softcap must be 0 (off) or a positive finite number, got ",
              softcap);
  return d;
}

// sinks (None, or float32 [num_heads] contiguous on query's device): true when given.
inline bool check_sinks(const c10::optional<at::Tensor>& sinks, const PagedAttentionDims& d,
                        const at::Device& device) {
  if (!sinks.has_value() || !sinks->defined()) return false;
  const at::Tensor& s = *sinks;
  TORCH_CHECK(s.device() == device, "sinks must be on ", device, " (query's device), got ", s.device());
  TORCH_CHECK(s.scalar_type() == at::kFloat, "sinks must be float32, got ", s.scalar_type());
  TORCH_CHECK(s.dim() == 1 && s.size(0) == d.num_heads && s.is_contiguous(), "sinks must be a contiguous [",
              d.num_heads, "] (one per query head), got shape ", s.sizes());
  return true;
}

}  // namespace pagewire
