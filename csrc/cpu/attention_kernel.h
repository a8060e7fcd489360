// The torch-free interface between the paged_attention op (attention.cpp) and its ISA-specific
// kernels (attention_generic.cpp, attention_avx2.cpp, attention_avx512.cpp): raw pointers, strides
// and a work list.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

namespace pagewire::cpu {

enum class ElemType : int { kFloat32, kBFloat16, kFloat16 };

// One unit of parallel work: q_count consecutive query tokens of one sequence (all query heads
// of one KV head are processed together, so the unit is really (item, kv_head)).
struct WorkItem {
  int32_t seq;
  int32_t q_begin;  // first query token of the tile, relative to the sequence's new tokens
  int32_t q_count;
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
};

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

// Runs unit(u, thread) for every (item, KV head) unit u = item * num_kv_heads + kv_head of `a`, on
// `threads` threads (1: this thread, with no team of one to set up; maybe_parallel.h). Dynamic
// scheduling, one unit at a time: units differ wildly in cost (a decode against the last tile of a
// long prefill) and the host orders them heaviest first, so the tail is short. Units are
// independent: which thread runs one never changes its result. (A static cyclic split for steps of
// decodes, each thread prefetching its next unit's KV into L2, measured no faster in one process,
// modes alternating: 55-64 us a SmolLM2 layer at batch 8 against 57-64; bench/RESULTS.md,
// session 27.)
template <class Unit>
void run_units(const PagedAttentionArgs& a, int threads, const Unit& unit) {
  const int64_t units = a.num_items * a.num_kv_heads;
  if (threads > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t u = 0; u < units; ++u) unit(u, omp_get_thread_num());
  } else {
    for (int64_t u = 0; u < units; ++u) unit(u, 0);
  }
}

}  // namespace pagewire::cpu
