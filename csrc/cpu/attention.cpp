// The paged_attention CPU op: argument checks (shared with CUDA, attention_checks.h), the host-side work plan (query tiles per sequence),
// and the choice between the AVX-512, the AVX2 and the portable kernel.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <ATen/core/Tensor.h>
#include <omp.h>

#include "../attention_checks.h"
#include "../ops.h"
#include "attention_kernel.h"
#include "cpu_features.h"

namespace pagewire {

namespace {

// Below this much work (query rows x positions read x head dim, summed over the step's tiles)
// paged attention runs on the calling thread (see the plan in paged_attention_cpu).
constexpr int64_t kSerialWork = int64_t{1} << 17;

// Query tokens per work unit: enough (token, head) rows that each K/V chunk is reused across a
// small GEMM, few enough that one long prefill still splits into many parallel units.
int tile_tokens(int group) { return std::max(1, std::min(32, 64 / group)); }

cpu::ElemType elem_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return cpu::ElemType::kFloat32;
    case at::kBFloat16:
      return cpu::ElemType::kBFloat16;
    case at::kHalf:
      return cpu::ElemType::kFloat16;
    default:
      TORCH_CHECK(false, "query dtype must be float32, bfloat16 or float16, got ", t);  // checked earlier
  }
}

// The best kernel the active family allows for this head size. PAGEWIRE_CPU_ISA caps the family
// (avx2: the AVX2 kernel even on an AVX-512 CPU; generic: the portable one), so tests cover every
// path on one machine.
enum class Kernel { kPortable, kAvx2, kAvx512 };
Kernel pick_kernel(int head_dim) {
  const cpu::Isa isa = cpu::active_isa();
  if (isa >= cpu::Isa::kAvx512Bf16 && head_dim % 16 == 0) return Kernel::kAvx512;
  if (isa >= cpu::Isa::kAvx2 && head_dim % 8 == 0) return Kernel::kAvx2;
  return Kernel::kPortable;
}

}  // namespace

void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                         int64_t sliding_window, int64_t max_query_len, int64_t max_seq_len, double softcap,
                         const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.device().is_cpu(), "query must be a CPU tensor, got ", query.device());
  const PagedAttentionDims dims = check_paged_attention_args(out, query, key_cache, value_cache, block_tables,
                                                             seq_lens, query_start_loc, scale, softcap);
  const bool has_sinks = check_sinks(sinks, dims, query.device());
  const cpu::ElemType dtype = elem_type(query.scalar_type());
  const int64_t num_tokens = dims.num_tokens, num_heads = dims.num_heads, head_dim = dims.head_dim;
  const int64_t num_blocks = dims.num_blocks, num_kv_heads = dims.num_kv_heads, block_size = dims.block_size;
  const int64_t num_seqs = dims.num_seqs;
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
  const Kernel kernel = pick_kernel(static_cast<int>(head_dim));
  // Plan: validate every sequence (outside the parallel region, so errors surface as exceptions)
  // and cut it into query tiles.
  std::vector<cpu::WorkItem> items;
  std::vector<int64_t> cost;
  int max_tile = 1;
  // Decode-sized tiles (at most 16 (token, head) rows) whose context crosses a partition boundary:
  // (item index, first and last partition, the tile's first position read and one past its last).
  struct Splittable {
    size_t item;
    int first_part, last_part;
    int64_t kv_lo, kv_hi;
  };
  std::vector<Splittable> splittable;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int q_len = qsl[s + 1] - qsl[s], seq_len = lens[s];
    TORCH_CHECK(q_len >= 1, "query_start_loc must be strictly increasing; sequence ", s, " has q_len ", q_len);
    TORCH_CHECK(q_len <= max_query_len, "sequence ", s, " has q_len ", q_len, " > max_query_len ", max_query_len);
    TORCH_CHECK(seq_len >= q_len, "seq_lens[", s, "] = ", seq_len, " is smaller than its q_len ", q_len);
    TORCH_CHECK(seq_len <= max_seq_len, "seq_lens[", s, "] = ", seq_len, " > max_seq_len ", max_seq_len);
    TORCH_CHECK(seq_len <= max_blocks * block_size, "seq_lens[", s, "] = ", seq_len, " needs more than the ",
                max_blocks, " blocks of block_tables");
    const int first_pos = seq_len - q_len;
    // Only blocks from the first query's window start on are read; a sliding-window group's table
    // holds no block (-1) before it once the allocator has released them (kv_groups.py).
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
      max_tile = std::max(max_tile, count);
      // The kernels' range: from the tile's first row's window start, rounded down to a span.
      const int64_t kv_lo =
          sliding_window > 0 ? std::max<int64_t>(0, first_pos + begin - sliding_window + 1) / cpu::kSpan * cpu::kSpan : 0;
      const int first_part = static_cast<int>(kv_lo / cpu::kPartition), last_part = static_cast<int>((hi - 1) / cpu::kPartition);
      if (count * group <= 16 && last_part > first_part) splittable.push_back({items.size(), first_part, last_part, kv_lo, hi});
      items.push_back({static_cast<int32_t>(s), begin, count});
      cost.push_back(span * count);
    }
  }
  // Too few units to share evenly among the threads (a few long sequences: at batch 1 there are as
  // many units as KV heads, three for SmolLM2 on two threads): each splittable tile runs as one unit
  // per partition and the kernel merges them after, with the bits of one unit (attention_kernel.h,
  // kPartition). Where the units already share evenly it would only
  // add the merge: a SmolLM2 step at batch 8, context 1024, was 3 % slower split, at batch 1 3-5 %
  // faster (bench/RESULTS.md, session 28).
  std::vector<cpu::MergeGroup> merges;
  int partial_tokens = 0, slots = 0;
  // A step whose whole attention is small (a few short decodes) runs on this thread: waking the
  // team and waiting for the unit that ends last cost more than the units (at one sequence of 96
  // tokens SmolLM2's three KV heads took 6.6 us a layer on two threads). One sequence, alternating
  // processes: SmolLM2 Q4_1 steps 1.83-1.91 -> 1.76-1.81 ms at 96 tokens, level at 256, 2-5 % slower
  // at 512 (so the line: 2^17 query-row x position x dim products, SmolLM2's 227 tokens); the
  // Qwen3-MoE shape at 96 tokens 1-3 % faster; Llama-1B at 96 (above the line) level either way
  // (bench/RESULTS.md, session 30). Which thread runs a unit never changes its floats.
  // On a decode step's crew (crew.h) there is no line: handing a unit over costs a few hundred
  // nanoseconds there, and a lone SmolLM2 decode's three KV heads on the crew's two threads gave
  // steps 0.983 / 0.967 / 0.947 of the serial ones at contexts 64 / 128 / 200 on a Zen 4 (0.979 on
  // the Qwen3-MoE shape; bench/RESULTS.md, session 34).
  int64_t work = 0;
  for (const int64_t c : cost) work += c;
  work *= num_heads * head_dim;
  const int threads = work < kSerialWork && !cpu::leading_crew() ? 1 : cpu::team_size();
  const int64_t units = static_cast<int64_t>(items.size()) * num_kv_heads;
  if (threads > 1 && !splittable.empty() &&
      (units < threads || (units % threads != 0 && units < 4 * threads))) {
    for (const Splittable& t : splittable) {
      const cpu::WorkItem w = items[t.item];
      merges.push_back({w.seq, w.q_begin, w.q_count, slots, t.last_part - t.first_part + 1});
      partial_tokens = std::max(partial_tokens, w.q_count);
      for (int k = t.first_part; k <= t.last_part; ++k) {
        const int64_t part_span = std::min<int64_t>(t.kv_hi, int64_t{k + 1} * cpu::kPartition) -
                                  std::max<int64_t>(t.kv_lo, int64_t{k} * cpu::kPartition);
        // The first partition takes the tile's own place; the others join the end of the list.
        if (k == t.first_part) {
          items[t.item].part = k, items[t.item].slot = slots++;
          cost[t.item] = part_span * w.q_count;
        } else {
          items.push_back({w.seq, w.q_begin, w.q_count, k, slots++});
          cost.push_back(part_span * w.q_count);
        }
      }
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
  args.threads = threads;
  args.scale = static_cast<float>(scale);
  args.softcap = static_cast<float>(softcap);
  args.sinks = has_sinks ? sinks->data_ptr<float>() : nullptr;
  args.sliding_window = sliding_window > 0 ? static_cast<int>(std::min<int64_t>(sliding_window, 1 << 30)) : 0;
  args.dtype = dtype;
  args.items = sorted.data();
  args.num_items = static_cast<int64_t>(sorted.size());
  std::vector<float> partials(static_cast<size_t>(slots) * partial_tokens * num_heads *
                              cpu::partial_row_floats(static_cast<int>(head_dim)));
  args.partials = partials.data();
  args.partial_tokens = partial_tokens;
  args.merges = merges.data();
  args.num_merges = static_cast<int64_t>(merges.size());
  switch (kernel) {
    case Kernel::kAvx512:
      cpu::paged_attention_avx512(args);
      break;
    case Kernel::kAvx2:
      cpu::paged_attention_avx2(args);
      break;
    case Kernel::kPortable:
      cpu::paged_attention_generic(args);
      break;
  }
}

}  // namespace pagewire
