// Binds the CUDA implementations to the pagewire schemas (declared once in ops_registration.cpp).
// Compiled only in CUDA builds: setup.py globs csrc/cuda/*.cu only when torch has CUDA.
#include <torch/library.h>

#include "ops_cuda.h"

TORCH_LIBRARY_IMPL(pagewire, CUDA, m) {
  m.impl("write_kv_cache", &pagewire::write_kv_cache_cuda);
  m.impl("paged_attention", &pagewire::paged_attention_cuda);
  m.impl("copy_blocks", &pagewire::copy_blocks_cuda);
  m.impl("rejection_sample", &pagewire::rejection_sample_cuda);
  m.impl("moe_experts", &pagewire::moe_experts_cuda);
}
