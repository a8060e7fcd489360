// The paged_attention CPU op: argument checks, the host-side work plan (query tiles per sequence),
// and the choice between the AVX-512 and the portable kernel.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <ATen/core/Tensor.h>

#include "../ops.h"
#include "attention_kernel.h"
#include "cpu_features.h"

namespace pagewire {

namespace {

// Query tokens per work unit: enough (token, head) rows that each K/V chunk is reused across a
// small GEMM, few enough that one long prefill still splits into many parallel units.
int tile_tokens(int group) { return std::max(1, std::min(32, 64 / group)); }

void check_int32_vector(const at::Tensor& t, const char* name, int64_t len) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == len, name, " must have shape [", len, "], got ", t.sizes());
}

cpu::ElemType elem_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return cpu::ElemType::kFloat32;
    case at::kBFloat16:
      return cpu::ElemType::kBFloat16;
    case at::kHalf:
      return cpu::ElemType::kFloat16;
    default:
      TORCH_CHECK(false, "query dtype must be float32, bfloat16 or float16, got ", t);
  }
}

// PAGEWIRE_CPU_ISA=generic (or avx2) forces the portable kernel (tests use it to cover that path).
bool use_avx512(int head_dim) { return head_dim % 16 == 0 && cpu::active_isa() == cpu::Isa::kAvx512Bf16; }

}  // namespace

void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                         int64_t sliding_window, int64_t max_query_len, int64_t max_seq_len) {
  TORCH_CHECK(query.device().is_cpu(), "query must be a CPU tensor, got ", query.device());
  TORCH_CHECK(query.dim() == 3, "query must be [T, num_heads, head_dim], got shape ", query.sizes());
  TORCH_CHECK(out.sizes() == query.sizes(), "out shape ", out.sizes(), " must equal query shape ", query.sizes());
  TORCH_CHECK(out.device().is_cpu(), "out must be a CPU tensor, got ", out.device());
  const cpu::ElemType dtype = elem_type(query.scalar_type());
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "out dtype ", out.scalar_type(), " must equal query dtype ",
              query.scalar_type());
  for (const auto& [cache, name] : {std::pair<const at::Tensor&, const char*>{key_cache, "key_cache"},
                                    std::pair<const at::Tensor&, const char*>{value_cache, "value_cache"}}) {
    TORCH_CHECK(cache.device().is_cpu(), name, " must be a CPU tensor, got ", cache.device());
    TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, num_kv_heads, block_size, head_dim], got shape ",
                cache.sizes());
    TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous");
    TORCH_CHECK(cache.scalar_type() == query.scalar_type(), name, " dtype ", cache.scalar_type(),
                " must equal query dtype ", query.scalar_type());
  }
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "value_cache shape ", value_cache.sizes(),
              " must equal key_cache shape ", key_cache.sizes());
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0), num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, "key_cache head_dim ", key_cache.size(3), " must equal query head_dim ",
              head_dim);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "query num_heads ", num_heads,
              " must be a multiple of key_cache num_kv_heads ", num_kv_heads);
  TORCH_CHECK(query.stride(2) == 1, "query must be contiguous in head_dim");
  TORCH_CHECK(out.stride(2) == 1, "out must be contiguous in head_dim");
  TORCH_CHECK(block_tables.device().is_cpu(), "block_tables must be a CPU tensor, got ", block_tables.device());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt, "block_tables must be int32, got ", block_tables.scalar_type());
  TORCH_CHECK(block_tables.dim() == 2, "block_tables must be [S, max_blocks], got shape ", block_tables.sizes());
  const int64_t num_seqs = block_tables.size(0);
  check_int32_vector(seq_lens, "seq_lens", num_seqs);
  check_int32_vector(query_start_loc, "query_start_loc", num_seqs + 1);
  TORCH_CHECK(std::isfinite(scale) && scale > 0, "scale must be a positive finite number, got ", scale);
  if (num_tokens == 0) return;

  const at::Tensor tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  const at::Tensor lens_c = seq_lens.contiguous(), qsl_c = query_start_loc.contiguous();
  const int32_t* lens = lens_c.data_ptr<int32_t>();
  const int32_t* qsl = qsl_c.data_ptr<int32_t>();
  const int32_t* table = tables.data_ptr<int32_t>();
  const int64_t max_blocks = tables.size(1), table_stride = tables.stride(0);
  const int group = static_cast<int>(num_heads / num_kv_heads);
  const int tq = tile_tokens(group);

  TORCH_CHECK(qsl[0] == 0 && qsl[num_seqs] == num_tokens, "query_start_loc must start at 0 and end at T=",
              num_tokens, ", got ", qsl[0], " and ", qsl[num_seqs]);
  // Plan: validate every sequence (outside the parallel region, so errors surface as exceptions)
  // and cut it into query tiles.
  std::vector<cpu::WorkItem> items;
  std::vector<int64_t> cost;
  int max_tile = 1;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int q_len = qsl[s + 1] - qsl[s], seq_len = lens[s];
    TORCH_CHECK(q_len >= 1, "query_start_loc must be strictly increasing; sequence ", s, " has q_len ", q_len);
    TORCH_CHECK(q_len <= max_query_len, "sequence ", s, " has q_len ", q_len, " > max_query_len ", max_query_len);
    TORCH_CHECK(seq_len >= q_len, "seq_lens[", s, "] = ", seq_len, " is smaller than its q_len ", q_len);
    TORCH_CHECK(seq_len <= max_seq_len, "seq_lens[", s, "] = ", seq_len, " > max_seq_len ", max_seq_len);
    TORCH_CHECK(seq_len <= max_blocks * block_size, "seq_lens[", s, "] = ", seq_len, " needs more than the ",
                max_blocks, " blocks of block_tables");
    const int first_pos = seq_len - q_len;
    const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, first_pos - sliding_window + 1) : 0;
    for (int64_t b = lo / block_size; b <= (seq_len - 1) / block_size; ++b) {
      const int32_t phys = table[s * table_stride + b];
      TORCH_CHECK(phys >= 0 && phys < num_blocks, "block_tables[", s, ", ", b, "] = ", phys, " is out of range [0, ",
                  num_blocks, ")");
    }
    for (int begin = 0; begin < q_len; begin += tq) {
      const int count = std::min(tq, q_len - begin);
      const int64_t hi = first_pos + begin + count;
      const int64_t span = sliding_window > 0 ? std::min<int64_t>(hi, sliding_window + count) : hi;
      items.push_back({static_cast<int32_t>(s), begin, count});
      cost.push_back(span * count);
      max_tile = std::max(max_tile, count);
    }
  }
  // Heaviest units first, so dynamic scheduling does not end on one long tile.
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return cost[x] > cost[y]; });
  std::vector<cpu::WorkItem> sorted(items.size());
  for (size_t i = 0; i < order.size(); ++i) sorted[i] = items[order[i]];

  cpu::PagedAttentionArgs args{};
  args.out = out.data_ptr();
  args.query = query.data_ptr();
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.block_tables = table;
  args.seq_lens = lens;
  args.query_start_loc = qsl;
  args.out_stride_t = out.stride(0);
  args.out_stride_h = out.stride(1);
  args.q_stride_t = query.stride(0);
  args.q_stride_h = query.stride(1);
  args.block_table_stride = table_stride;
  args.num_heads = static_cast<int>(num_heads);
  args.num_kv_heads = static_cast<int>(num_kv_heads);
  args.head_dim = static_cast<int>(head_dim);
  args.block_size = static_cast<int>(block_size);
  args.max_tile_tokens = max_tile;
  args.scale = static_cast<float>(scale);
  args.sliding_window = sliding_window > 0 ? static_cast<int>(std::min<int64_t>(sliding_window, 1 << 30)) : 0;
  args.dtype = dtype;
  args.items = sorted.data();
  args.num_items = static_cast<int64_t>(sorted.size());
  if (use_avx512(args.head_dim)) {
    cpu::paged_attention_avx512(args);
  } else {
    cpu::paged_attention_generic(args);
  }
}

}  // namespace pagewire
