// CUDA implementations of the KV-cache maintenance ops: write_kv_cache and copy_blocks.
// Slot and block ids are range-checked on the device (bad ones are skipped rather than written out
// of bounds): checking them on the host would need a device-to-host copy every step.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <vector>

#include "ops_cuda.h"

namespace pagewire {
namespace {

void check_cache(const at::Tensor& cache, const char* name, const at::Device& device) {
  TORCH_CHECK(cache.device() == device, name, " must be on ", device, ", got ", cache.device());
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, num_kv_heads, block_size, head_dim], got shape ",
              cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous");
}

// One CUDA block per token; threads stride over the token's num_kv_heads * head_dim elements.
// Elements are moved as opaque words of the element's size, so one kernel serves every dtype.
template <class Word>
__global__ void write_kv_kernel(const Word* __restrict__ key, const Word* __restrict__ value,
                                Word* __restrict__ key_cache, Word* __restrict__ value_cache,
                                const int64_t* __restrict__ slot_mapping, int64_t ks0, int64_t ks1, int64_t vs0,
                                int64_t vs1, int num_kv_heads, int block_size, int head_dim, int64_t num_slots) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= num_slots) return;  // -1 = padding
  const int64_t block = slot / block_size, offset = slot % block_size;
  for (int i = threadIdx.x; i < num_kv_heads * head_dim; i += blockDim.x) {
    const int h = i / head_dim, d = i % head_dim;
    const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * head_dim + d;
    key_cache[dst] = key[t * ks0 + h * ks1 + d];
    value_cache[dst] = value[t * vs0 + h * vs1 + d];
  }
}

// grid (num_pairs, num_layers): one CUDA block copies one physical block of one layer (K and V).
__global__ void copy_blocks_kernel(const int64_t* __restrict__ k_ptrs, const int64_t* __restrict__ v_ptrs,
                                   const int64_t* __restrict__ mapping, int64_t words_per_block,
                                   int64_t num_blocks) {
  const int64_t pair = blockIdx.x, layer = blockIdx.y;
  const int64_t src = mapping[2 * pair], dst = mapping[2 * pair + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;
  auto* k = reinterpret_cast<uint32_t*>(k_ptrs[layer]);
  auto* v = reinterpret_cast<uint32_t*>(v_ptrs[layer]);
  for (int64_t i = threadIdx.x; i < words_per_block; i += blockDim.x) {
    k[dst * words_per_block + i] = k[src * words_per_block + i];
    v[dst * words_per_block + i] = v[src * words_per_block + i];
  }
}

}  // namespace

void write_kv_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                         at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const at::Device device = key_cache.device();
  check_cache(key_cache, "key_cache", device);
  check_cache(value_cache, "value_cache", device);
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "value_cache shape ", value_cache.sizes(),
              " must equal key_cache shape ", key_cache.sizes());
  TORCH_CHECK(key.device() == device && value.device() == device && slot_mapping.device() == device,
              "key, value and slot_mapping must be on ", device);
  TORCH_CHECK(key.dim() == 3, "key must be [T, num_kv_heads, head_dim], got shape ", key.sizes());
  TORCH_CHECK(value.sizes() == key.sizes(), "value shape ", value.sizes(), " must equal key shape ", key.sizes());
  TORCH_CHECK(key.size(1) == key_cache.size(1) && key.size(2) == key_cache.size(3), "key shape ", key.sizes(),
              " does not match key_cache shape ", key_cache.sizes());
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "key, value, key_cache and value_cache must share one dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key and value must be contiguous in head_dim");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64, got ", slot_mapping.scalar_type());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), "slot_mapping must be [T] with T=",
              key.size(0), ", got shape ", slot_mapping.sizes());
  const int64_t T = key.size(0);
  if (T == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor slots = slot_mapping.contiguous();
  const int kv_heads = key_cache.size(1), block_size = key_cache.size(2), head_dim = key_cache.size(3);
  const int64_t num_slots = key_cache.size(0) * block_size;
  const int threads = std::min(512, kv_heads * head_dim);
  auto launch = [&](auto word) {
    using Word = decltype(word);
    write_kv_kernel<Word><<<T, threads, 0, stream>>>(
        static_cast<const Word*>(key.data_ptr()), static_cast<const Word*>(value.data_ptr()),
        static_cast<Word*>(key_cache.data_ptr()), static_cast<Word*>(value_cache.data_ptr()),
        slots.data_ptr<int64_t>(), key.stride(0), key.stride(1), value.stride(0), value.stride(1), kv_heads,
        block_size, head_dim, num_slots);
  };
  switch (key.element_size()) {
    case 1:
      launch(uint8_t{});
      break;
    case 2:
      launch(uint16_t{});
      break;
    case 4:
      launch(uint32_t{});
      break;
    case 8:
      launch(uint64_t{});
      break;
    default:
      TORCH_CHECK(false, "write_kv_cache: unsupported element size ", key.element_size());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void copy_blocks_cuda(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "key_caches has ", key_caches.size(),
              " layers but value_caches has ", value_caches.size());
  TORCH_CHECK(block_mapping.scalar_type() == at::kLong, "block_mapping must be int64, got ",
              block_mapping.scalar_type());
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2, "block_mapping must be [N, 2], got shape ",
              block_mapping.sizes());
  const int64_t num_layers = key_caches.size(), num_pairs = block_mapping.size(0);
  if (num_layers == 0 || num_pairs == 0) return;
  const at::Device device = key_caches[0].device();
  std::vector<int64_t> k_ptrs(num_layers), v_ptrs(num_layers);
  for (int64_t l = 0; l < num_layers; ++l) {
    check_cache(key_caches[l], "key_caches[i]", device);
    check_cache(value_caches[l], "value_caches[i]", device);
    TORCH_CHECK(key_caches[l].sizes() == key_caches[0].sizes() && value_caches[l].sizes() == key_caches[0].sizes() &&
                    key_caches[l].scalar_type() == key_caches[0].scalar_type() &&
                    value_caches[l].scalar_type() == key_caches[0].scalar_type(),
                "every layer's key and value cache must match key_caches[0] in shape and dtype; layer ", l,
                " does not");
    k_ptrs[l] = reinterpret_cast<int64_t>(key_caches[l].data_ptr());
    v_ptrs[l] = reinterpret_cast<int64_t>(value_caches[l].data_ptr());
  }
  const int64_t block_bytes = key_caches[0].stride(0) * key_caches[0].element_size();
  TORCH_CHECK(block_bytes % 4 == 0, "copy_blocks: a cache block must be a multiple of 4 bytes, got ", block_bytes);
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Layer pointers travel as one small int64 tensor; the copy is stream-ordered with the kernel.
  const auto opts = at::TensorOptions().dtype(at::kLong);
  const at::Tensor k_dev = at::from_blob(k_ptrs.data(), {num_layers}, opts).to(device);
  const at::Tensor v_dev = at::from_blob(v_ptrs.data(), {num_layers}, opts).to(device);
  const at::Tensor mapping = block_mapping.to(device).contiguous();
  const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(num_layers));
  copy_blocks_kernel<<<grid, 256, 0, stream>>>(k_dev.data_ptr<int64_t>(), v_dev.data_ptr<int64_t>(),
                                               mapping.data_ptr<int64_t>(), block_bytes / 4, key_caches[0].size(0));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace pagewire
