// CPU implementations of the KV-cache maintenance ops: write_kv_cache and copy_blocks.
#include <omp.h>

#include <cstring>
#include <unordered_set>

#include <ATen/core/Tensor.h>

#include "../ops.h"
#include "maybe_parallel.h"

namespace pagewire {

namespace {

// Checks one paged cache tensor: [num_blocks, num_kv_heads, block_size, head_dim], contiguous, CPU.
void check_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.device().is_cpu(), name, " must be a CPU tensor, got ", cache.device());
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, num_kv_heads, block_size, head_dim], got shape ",
              cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous");
}

}  // namespace

void write_kv_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                        at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "value_cache shape ", value_cache.sizes(),
              " must equal key_cache shape ", key_cache.sizes());
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu(), "key and value must be CPU tensors");
  TORCH_CHECK(key.dim() == 3, "key must be [T, num_kv_heads, head_dim], got shape ", key.sizes());
  TORCH_CHECK(value.sizes() == key.sizes(), "value shape ", value.sizes(), " must equal key shape ", key.sizes());
  const int64_t num_blocks = key_cache.size(0), num_kv_heads = key_cache.size(1);
  const int64_t block_size = key_cache.size(2), head_dim = key_cache.size(3);
  TORCH_CHECK(key.size(1) == num_kv_heads && key.size(2) == head_dim, "key shape ", key.sizes(),
              " does not match key_cache (num_kv_heads=", num_kv_heads, ", head_dim=", head_dim, ")");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type(), "key dtype ", key.scalar_type(),
              " must equal key_cache dtype ", key_cache.scalar_type());
  TORCH_CHECK(value.scalar_type() == value_cache.scalar_type(), "value dtype ", value.scalar_type(),
              " must equal value_cache dtype ", value_cache.scalar_type());
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "key_cache and value_cache dtypes differ");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key and value must be contiguous in head_dim");
  TORCH_CHECK(slot_mapping.device().is_cpu(), "slot_mapping must be a CPU tensor");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64, got ", slot_mapping.scalar_type());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), "slot_mapping must be [T] with T=",
              key.size(0), ", got shape ", slot_mapping.sizes());

  const int64_t num_tokens = key.size(0);
  const at::Tensor slots_c = slot_mapping.contiguous();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  const int64_t num_slots = num_blocks * block_size;
  // Validate every slot before any write so that a bad slot leaves the cache untouched and the
  // error is raised outside the OpenMP region (exceptions must not escape it).
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                " is out of range [-1, ", num_slots, ")");
  }

  const size_t elem = key.element_size();
  const size_t row_bytes = head_dim * elem;
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  char* k_dst = static_cast<char*>(key_cache.data_ptr());
  char* v_dst = static_cast<char*>(value_cache.data_ptr());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);

  cpu::maybe_parallel_for(num_tokens, num_tokens * num_kv_heads * head_dim > 32768, [&](int64_t t) {
    const int64_t slot = slots[t];
    if (slot < 0) return;  // padding token
    const int64_t block = slot / block_size, offset = slot % block_size;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * head_dim;
      std::memcpy(k_dst + dst * elem, k_src + (t * ks0 + h * ks1) * elem, row_bytes);
      std::memcpy(v_dst + dst * elem, v_src + (t * vs0 + h * vs1) * elem, row_bytes);
    }
  });
}

void copy_blocks_cpu(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "key_caches has ", key_caches.size(),
              " layers but value_caches has ", value_caches.size());
  TORCH_CHECK(block_mapping.device().is_cpu(), "block_mapping must be a CPU tensor");
  TORCH_CHECK(block_mapping.scalar_type() == at::kLong, "block_mapping must be int64, got ",
              block_mapping.scalar_type());
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2, "block_mapping must be [N, 2], got shape ",
              block_mapping.sizes());
  const int64_t num_layers = key_caches.size();
  const int64_t num_pairs = block_mapping.size(0);
  if (num_layers == 0 || num_pairs == 0) return;

  for (int64_t l = 0; l < num_layers; ++l) {
    check_cache(key_caches[l], "key_caches[i]");
    check_cache(value_caches[l], "value_caches[i]");
    TORCH_CHECK(key_caches[l].sizes() == key_caches[0].sizes() && value_caches[l].sizes() == key_caches[0].sizes(),
                "every layer's key and value cache must have the shape of key_caches[0] ", key_caches[0].sizes(),
                "; layer ", l, " has ", key_caches[l].sizes(), " and ", value_caches[l].sizes());
    TORCH_CHECK(value_caches[l].scalar_type() == key_caches[l].scalar_type(), "value_caches[", l, "] dtype ",
                value_caches[l].scalar_type(), " must equal key_caches[", l, "] dtype ", key_caches[l].scalar_type());
  }
  const int64_t num_blocks = key_caches[0].size(0);
  const at::Tensor map_c = block_mapping.contiguous();
  const int64_t* map = map_c.data_ptr<int64_t>();
  // Pairs are copied in parallel, which is only well defined when no destination is written
  // twice or read as another pair's source.
  std::unordered_set<int64_t> srcs, dsts;
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t src = map[2 * i], dst = map[2 * i + 1];
    TORCH_CHECK(src >= 0 && src < num_blocks && dst >= 0 && dst < num_blocks, "block_mapping[", i, "] = (", src,
                ", ", dst, ") is out of range [0, ", num_blocks, ")");
    TORCH_CHECK(dsts.insert(dst).second, "block_mapping: destination block ", dst, " appears more than once");
    srcs.insert(src);
  }
  for (int64_t dst : dsts) {
    TORCH_CHECK(!srcs.count(dst), "block_mapping: block ", dst, " is both a source and a destination");
  }

  // Layer pointers are gathered up front: TensorList indexing stays out of the parallel loop.
  std::vector<char*> k_ptrs(num_layers), v_ptrs(num_layers);
  std::vector<size_t> block_bytes(num_layers);
  for (int64_t l = 0; l < num_layers; ++l) {
    k_ptrs[l] = static_cast<char*>(key_caches[l].data_ptr());
    v_ptrs[l] = static_cast<char*>(value_caches[l].data_ptr());
    block_bytes[l] = key_caches[l].stride(0) * key_caches[l].element_size();
  }
#pragma omp parallel for schedule(static) collapse(2)
  for (int64_t l = 0; l < num_layers; ++l) {
    for (int64_t i = 0; i < num_pairs; ++i) {
      const size_t bytes = block_bytes[l];
      std::memcpy(k_ptrs[l] + map[2 * i + 1] * bytes, k_ptrs[l] + map[2 * i] * bytes, bytes);
      std::memcpy(v_ptrs[l] + map[2 * i + 1] * bytes, v_ptrs[l] + map[2 * i] * bytes, bytes);
    }
  }
}

}  // namespace pagewire
