// C entry point for tests/kernels/test_emulated_attention.py: the AVX-512 / AVX512-BF16 paged
// attention kernel of attention_avx512.cpp, built by emu_build.py with emulated intrinsics. The
// work plan is attention.cpp's: each sequence cut into tiles of at most `tile` query tokens.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_kernel.h"

extern "C" void pw_paged_attention_avx512(int dtype, void* out, const void* query, const void* key_cache,
                                          const void* value_cache, const int32_t* block_tables, int64_t table_stride,
                                          const int32_t* seq_lens, const int32_t* query_start_loc, int num_seqs,
                                          int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                                          float softcap, int sliding_window, int tile) {
  using namespace pagewire::cpu;
  std::vector<WorkItem> items;
  int max_tile = 1;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = query_start_loc[s + 1] - query_start_loc[s];
    for (int begin = 0; begin < q_len; begin += tile) {
      const int count = std::min(tile, q_len - begin);
      items.push_back({s, begin, count});
      max_tile = std::max(max_tile, count);
    }
  }
  PagedAttentionArgs a{};
  a.out = out;
  a.query = query;
  a.key_cache = key_cache;
  a.value_cache = value_cache;
  a.block_tables = block_tables;
  a.seq_lens = seq_lens;
  a.query_start_loc = query_start_loc;
  a.out_stride_t = static_cast<int64_t>(num_heads) * head_dim;
  a.out_stride_h = head_dim;
  a.q_stride_t = a.out_stride_t;
  a.q_stride_h = head_dim;
  a.block_table_stride = table_stride;
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.head_dim = head_dim;
  a.block_size = block_size;
  a.max_tile_tokens = max_tile;
  a.scale = scale;
  a.softcap = softcap;
  a.sliding_window = sliding_window;
  a.dtype = static_cast<ElemType>(dtype);
  a.items = items.data();
  a.num_items = static_cast<int64_t>(items.size());
  paged_attention_avx512(a);
}
