// The torch-free interface between the paged_attention op (attention.cpp) and its ISA-specific
// kernels (attention_generic.cpp, attention_avx2.cpp, attention_avx512.cpp): raw pointers, strides
// and a work list.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "crew.h"
#include "maybe_parallel.h"

namespace pagewire::cpu {

enum class ElemType : int { kFloat32, kBFloat16, kFloat16 };

// KV positions per online-softmax step of every CPU kernel: the per-row softmax bookkeeping (max,
// rescale, one scalar exp) is paid once per 64 positions. Spans start at absolute multiples of it,
// part of the kernels' batch-invariance contract: changing it changes results (identically for
// every batch).
constexpr int kSpan = 64;

// Positions per KV partition: every CPU kernel (attention_tile.h, attention_avx2.cpp) restarts its
// online softmax at every absolute multiple of kPartition and merges the partitions' results in
// position order, so a decode against a long context can run as one unit per partition on
// different threads (a few long sequences at batch 1 would otherwise leave threads idle: SmolLM2
// has three KV heads) and still give the bits it gives as one unit, in a prefill or in any batch.
// A multiple of kSpan.
constexpr int kPartition = 512;
static_assert(kPartition % kSpan == 0, "partitions are whole spans");

// One unit of parallel work: q_count consecutive query tokens of one sequence (all query heads
// of one KV head are processed together, so the unit is really (item, kv_head)).
struct WorkItem {
  int32_t seq;
  int32_t q_begin;  // first query token of the tile, relative to the sequence's new tokens
  int32_t q_count;
  // -1: every partition of the tile's context, in order, and the output written. Otherwise only
  // partition `part` (positions [part, part + 1) x kPartition), its unnormalised result written to
  // partial slot `slot` for the merge (PagedAttentionArgs::merges).
  int32_t part = -1;
  int32_t slot = -1;
};

// A tile run as one unit per partition: its parts partitions' results sit in partial slots
// first_slot .. first_slot + parts - 1, in position order.
struct MergeGroup {
  int32_t seq, q_begin, q_count;
  int32_t first_slot, parts;
};

struct PagedAttentionArgs {
  void* out;                // [T, num_heads, head_dim] (strides below; head_dim contiguous)
  const void* query;        // [T, num_heads, head_dim]
  const void* key_cache;    // [num_blocks, num_kv_heads, block_size, head_dim] contiguous
  const void* value_cache;  // same shape as key_cache
  const int32_t* block_tables;     // [S, block_table_stride]
  const int32_t* seq_lens;         // [S]
  const int32_t* query_start_loc;  // [S + 1]
  int64_t out_stride_t, out_stride_h, q_stride_t, q_stride_h, block_table_stride;
  int num_heads, num_kv_heads, head_dim, block_size;
  int max_tile_tokens;  // largest WorkItem::q_count, sizes the per-thread scratch
  int threads = 0;      // threads to run the units on (0: every thread of the team)
  float scale;
  // > 0: logit soft-capping (Gemma 2), scores become softcap * tanh(score / softcap) after the
  // scale and before the mask and softmax; <= 0: off.
  float softcap;
  // [num_heads] or null: per-head sink logits joining each row's softmax denominator (gpt-oss);
  // the kernels fold them in at the end with sink_inv_l.
  const float* sinks;
  int sliding_window;  // <= 0: no window
  ElemType dtype;      // query, out and both caches share it
  const WorkItem* items;
  int64_t num_items;
  // Split tiles (WorkItem::part >= 0): partial results, slot after slot,
  // each slot [partial_tokens][num_heads] rows of (m, l, acc[head_dim]) floats, and the groups to merge.
  float* partials = nullptr;
  int partial_tokens = 0;
  const MergeGroup* merges = nullptr;
  int64_t num_merges = 0;
};

// Floats of one partial row: the running max, the sum and the unnormalised output.
inline int64_t partial_row_floats(int head_dim) { return 2 + head_dim; }

// All compute the same attention (to rounding). The AVX-512 one must only be called when
// cpu::active_isa() is Isa::kAvx512Bf16 and head_dim % 16 == 0, the AVX2 one when it is at least
// Isa::kAvx2 and head_dim % 8 == 0 (cpu_features.h). The AVX2 one is also batch-invariant: a
// query row's output bits do not depend on the rest of the batch or on how the work was tiled
// (attention_avx2.cpp says how).
void paged_attention_generic(const PagedAttentionArgs& args);
void paged_attention_avx2(const PagedAttentionArgs& args);
void paged_attention_avx512(const PagedAttentionArgs& args);

// 1 / the softmax denominator of a row whose online softmax ended at running max m and sum l,
// with the head's sink logit (if any) as one more term: the sink only grows the denominator. Taken
// relative to max(m, sink) so neither exp overflows: acc * scale / (l * scale + exp(sink - m')),
// scale = exp(m - m'), which equals acc / (l + exp(sink - m)). Static: each ISA's file keeps its own copy
// (compiled with its target options), as attention_tile.h's internal linkage does.
static inline float sink_inv_l(float m, float l, const float* sinks, int head) {
  if (sinks == nullptr) return 1.f / l;
  const float sink = sinks[head];
  const float top = m > sink ? m : sink;
  const float scale = std::exp(m - top);
  return scale / (l * scale + std::exp(sink - top));
}

// Merges one row's partition result (m, l, acc) into the partitions before it (mt, lt, acct): the
// one way partitions are combined, whether one unit ran them in turn or each ran apart and
// merge_partitions combines their slots, so both give the same bits. Static and noinline, defined
// here before any kernel file's target switch: one baseline-ISA copy per file, called by both.
[[gnu::noinline]] static inline void fold_row(float* mt, float* lt, float* acct, float m, float l, const float* acc,
                                              int D) {
  if (m == -std::numeric_limits<float>::infinity()) return;  // the row sees nothing in this partition
  if (*mt == -std::numeric_limits<float>::infinity()) {
    *mt = m, *lt = l;
    std::copy(acc, acc + D, acct);
    return;
  }
  const float mx = std::max(*mt, m);
  const float keep = std::exp(*mt - mx), add = std::exp(m - mx);
  *lt = *lt * keep + l * add;
  for (int d = 0; d < D; ++d) acct[d] = acct[d] * keep + acc[d] * add;
  *mt = mx;
}

// The split tiles' outputs (PagedAttentionArgs::merges): each row's partitions folded in position
// order by fold_row, as a unit running them in turn folds them, then store(acc, m, l, head, dst)
// normalises and writes the row as the kernel's own epilogue does.
template <class Store>
void merge_partitions(const PagedAttentionArgs& a, const Store& store) {
  const int D = a.head_dim;
  const int64_t prf = partial_row_floats(D);
  const int64_t slot_floats = static_cast<int64_t>(a.partial_tokens) * a.num_heads * prf;
  const int64_t rows_per_group = static_cast<int64_t>(a.partial_tokens) * a.num_heads;
  const int64_t rows = a.num_merges * rows_per_group;
  maybe_parallel_for(rows, rows * D >= (1 << 14), [&](int64_t i) {
    const MergeGroup& mg = a.merges[i / rows_per_group];
    const int t = static_cast<int>(i % rows_per_group / a.num_heads), h = static_cast<int>(i % a.num_heads);
    if (t >= mg.q_count) return;
    float* acc = row_scratch(D);
    float m = -std::numeric_limits<float>::infinity(), l = 0.f;
    for (int k = 0; k < mg.parts; ++k) {
      const float* src = a.partials + (mg.first_slot + k) * slot_floats + (static_cast<int64_t>(t) * a.num_heads + h) * prf;
      fold_row(&m, &l, acc, src[0], src[1], src + 2, D);
    }
    store(acc, m, l, h, a.query_start_loc[mg.seq] + mg.q_begin + t);
  });
}

// Where a split tile's partition puts the result of token t, query head `head`: (m, l, acc).
inline float* partial_row(const PagedAttentionArgs& a, const WorkItem& w, int t, int head) {
  const int64_t prf = partial_row_floats(a.head_dim);
  return a.partials + ((static_cast<int64_t>(w.slot) * a.partial_tokens + t) * a.num_heads + head) * prf;
}

// A tile's online-softmax rows over the partitions of its context, on a kernel's scratch: the
// current partition's running max, sum and unnormalised output per row (m, l, acc: the kernel's
// span steps update them), and the partitions before it merged (m_t, l_t, acc_t). Both kernels'
// drivers use it, so they cut, merge and hand over partitions the same way.
struct PartitionRows {
  float *m, *l, *acc, *m_t, *l_t, *acc_t;
  int rows, D;
  bool folded = false;  // a partition has ended and been merged into the totals

  // A fresh partition: no position seen yet.
  void start() {
    std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + rows, 0.f);
    std::fill(acc, acc + static_cast<int64_t>(rows) * D, 0.f);
  }
  // The current partition is done: merged into the totals (the first one starts them), then a
  // fresh one begins.
  void end_partition() {
    if (!folded) {
      std::fill(m_t, m_t + rows, -std::numeric_limits<float>::infinity());
      std::fill(l_t, l_t + rows, 0.f);
      folded = true;
    }
    for (int r = 0; r < rows; ++r) {
      fold_row(m_t + r, l_t + r, acc_t + static_cast<int64_t>(r) * D, m[r], l[r], acc + static_cast<int64_t>(r) * D, D);
    }
    start();
  }
  // After the last span: the last partition joins the others, if any ended before it. Then
  // out_m / out_l / out_acc are the rows to normalise.
  void finish() {
    if (folded) end_partition();
  }
  const float* out_m() const { return folded ? m_t : m; }
  const float* out_l() const { return folded ? l_t : l; }
  const float* out_acc() const { return folded ? acc_t : acc; }
  // A split tile's one partition (w.part >= 0): each row's (m, l, acc) into its partial slot, for
  // merge_partitions. Row r = t * G + g is query head kvh * G + g of token t.
  void store_partials(const PagedAttentionArgs& a, const WorkItem& w, int kvh) const {
    const int G = a.num_heads / a.num_kv_heads;
    for (int r = 0; r < rows; ++r) {
      float* dst = partial_row(a, w, r / G, kvh * G + r % G);
      dst[0] = m[r], dst[1] = l[r];
      std::copy(acc + static_cast<int64_t>(r) * D, acc + static_cast<int64_t>(r + 1) * D, dst + 2);
    }
  }
};

// The calling thread's scratch for each thread of a team of `threads` (a kernel file's Scratch for
// `rows` query rows of head dimension D), kept between calls and rebuilt only when a call needs
// more threads, more rows or another D. Allocating it per call cost a 40 KiB aligned_alloc and
// free per thread, 30 times a SmolLM2 decode step (malloc_consolidate and page faults in a profile;
// bench/RESULTS.md, session 27). Built on the calling thread before any parallel region, so an
// allocation failure throws there. Each engine thread has its own (thread_local), so two engines
// in one process never share one.
template <class S>
std::vector<std::unique_ptr<S>>& kept_scratch(int threads, int64_t rows, int64_t D) {
  thread_local std::vector<std::unique_ptr<S>> kept;
  thread_local int64_t kept_rows = 0, kept_d = -1;
  if (static_cast<int64_t>(kept.size()) < threads || rows > kept_rows || D != kept_d) {
    const int64_t r = D == kept_d ? std::max(rows, kept_rows) : rows;
    const int64_t n = std::max<int64_t>(threads, static_cast<int64_t>(kept.size()));
    kept.clear();  // the old buffers go first (a long prefill's tiles can be large)
    kept_rows = 0, kept_d = -1;
    for (int64_t i = 0; i < n; ++i) kept.push_back(std::make_unique<S>(r, D));
    kept_rows = r, kept_d = D;
  }
  return kept;
}

// The first KV lines (two spans) of the unit a thread will run next, prefetched into L2 a few at a
// time while its current unit's last two spans are read: the drivers call Cursor::step() about
// once per cache line of K or V they load, and pace() spreads the queue over those steps. A unit's
// own prefetching reaches only one span ahead, so without this every unit began with its first
// span in flight from DRAM, at most a few dozen lines at a time per core: in a SmolLM2 decode step
// at batch 8 (KV evicted by the weight stream) attention took 37-43 us a layer against 22 us with
// the KV in cache. With it: 28-33 us, the step 5-7 % faster on AVX-512 and 3 % on AVX2. Queuing at
// the last two spans rather than earlier keeps the lines from being evicted by a long unit's own
// stream before use; queuing the span two ahead within a unit as well measured no faster
// (bench/RESULTS.md, session 28).
class NextUnitPrefetch {
 public:
  void clear() { n_ = 0, at_ = {}; }

  // Queues `count` positions of (item w, KV head kvh), in K and V, from position `from` or from the
  // first position that unit reads if later (its window's start), and not past its last: one
  // contiguous run per block.
  template <class E>
  void queue(const PagedAttentionArgs& a, const WorkItem& w, int kvh, int from, int count) {
    clear();
    const int D = a.head_dim, bs = a.block_size, W = a.sliding_window;
    const int64_t q_start = a.query_start_loc[w.seq];
    const int q_len = a.query_start_loc[w.seq + 1] - static_cast<int>(q_start);
    const int pos0 = a.seq_lens[w.seq] - q_len + w.q_begin;
    const int lo = std::max(from, W > 0 ? std::max(0, pos0 - W + 1) : 0);
    const int hi = std::min(lo + count, pos0 + w.q_count);
    const int32_t* table = a.block_tables + w.seq * a.block_table_stride;
    const E* key_cache = static_cast<const E*>(a.key_cache);
    const E* value_cache = static_cast<const E*>(a.value_cache);
    for (int b = lo / bs; b <= (hi - 1) / bs && n_ + 2 <= kMaxRuns; ++b) {
      const int first = std::max(lo, b * bs), end = std::min(hi, (b + 1) * bs);
      if (end <= first) continue;
      const int64_t at = ((static_cast<int64_t>(table[b]) * a.num_kv_heads + kvh) * bs + (first - b * bs)) * D;
      const int64_t bytes = (static_cast<int64_t>(end - first) * D * static_cast<int64_t>(sizeof(E)) + 63) / 64 * 64;
      for (const E* cache : {key_cache, value_cache}) {
        const char* p = reinterpret_cast<const char*>(cache + at);
        runs_[n_++] = {p, p + bytes};
      }
    }
    at_ = Cursor{n_ > 0 ? runs_[0].p : nullptr, n_ > 0 ? runs_[0].end : nullptr, 0, 1, runs_, n_};
  }

  // Spreads the queued lines over about `steps` calls of Cursor::step().
  void pace(int64_t steps) {
    int64_t lines = 0;
    for (int r = 0; r < n_; ++r) lines += (runs_[r].end - runs_[r].p) / 64;
    at_.per = static_cast<int>(std::max<int64_t>(1, (lines + steps - 1) / std::max<int64_t>(steps, 1)));
  }

  struct Run {
    const char* p;
    const char* end;
  };

  // The queue's read position. A loop that drains the queue takes a copy (cursor()), steps it and
  // hands it back (resume()): kept in registers, it costs a compare per step; stepping a member in
  // memory instead made every step wait on the previous one's store (5 us a SmolLM2 layer at
  // batch 8, all of it with the KV in cache).
  struct Cursor {
    const char* p;
    const char* end;
    int run, per;
    const Run* runs;
    int n;
    [[gnu::always_inline]] inline void step() {
      for (int k = 0; k < per && p != nullptr; ++k) {
        __builtin_prefetch(p, 0, 2);  // prefetcht1: into L2, where the next unit's loads find it
        p += 64;
        if (p >= end) {
          ++run;
          p = run < n ? runs[run].p : nullptr;
          end = run < n ? runs[run].end : nullptr;
        }
      }
    }
  };
  Cursor cursor() const { return at_; }
  void resume(const Cursor& c) { at_ = c; }
  // n steps at once (a loop that does not interleave them with its loads).
  void steps(int64_t n) {
    Cursor c = at_;
    for (int64_t i = 0; i < n; ++i) c.step();
    at_ = c;
  }

  // For a driver's queue_next(): claims the thread's next unit (claim(), run_units) and queues
  // the first two spans of 64 positions it reads.
  template <class E, class Claim>
  void queue_next(const PagedAttentionArgs& a, const Claim& claim) {
    const int64_t next = claim();
    if (next < 0) return;
    const WorkItem& w = a.items[next / a.num_kv_heads];
    queue<E>(a, w, static_cast<int>(next % a.num_kv_heads), w.part >= 0 ? w.part * kPartition : 0, 2 * kSpan);
  }

 private:
  static constexpr int kMaxRuns = 40;  // 20 blocks: two 64-position spans of 16-position blocks, misaligned
  Run runs_[kMaxRuns];
  int n_ = 0;
  Cursor at_{};
};

// Runs unit(u, thread, claim) for every (item, KV head) unit u = item * num_kv_heads + kv_head of
// `a`, on `threads` threads (1: this thread, with no team of one to set up; maybe_parallel.h).
// Dynamic scheduling, one unit at a time: units differ wildly in cost (a decode against the last
// tile of a long prefill) and the host orders them heaviest first, so the tail is short. A unit
// may call claim() (at most once matters: later calls return the same) to learn the unit its
// thread runs next, -1 if none, so that it can prefetch that unit's KV (NextUnitPrefetch); a unit
// that does not ask gets its successor claimed when it ends, as a plain dynamic schedule would.
// Claiming late in a unit keeps the balance of dynamic scheduling. Units are independent: which
// thread runs one never changes its result. (A static cyclic split for steps of decodes, each
// thread prefetching its next unit's first span into L2 in one burst, measured no faster:
// bench/RESULTS.md, session 27; spreading the prefetch over the current unit's loads is what paid.)
template <class Unit>
void run_units(const PagedAttentionArgs& a, int threads, const Unit& unit) {
  const int64_t units = a.num_items * a.num_kv_heads;
  if (threads <= 1) {
    for (int64_t u = 0; u < units; ++u) unit(u, 0, [&] { return u + 1 < units ? u + 1 : int64_t{-1}; });
    return;
  }
  std::atomic<int64_t> counter{0};
  // (On a decode step's crew, crew.h, the crew runs the units: no region of its own.)
  team_region(threads, [&](int thread, int) {
    int64_t u = counter.fetch_add(1, std::memory_order_relaxed);
    while (u < units) {
      int64_t next = -1;
      unit(u, thread, [&] {
        if (next < 0) next = counter.fetch_add(1, std::memory_order_relaxed);
        return next < units ? next : int64_t{-1};
      });
      u = next < 0 ? counter.fetch_add(1, std::memory_order_relaxed) : next;
    }
  });
}

}  // namespace pagewire::cpu
