// The ISA-independent part of the CPU paged-attention kernel: one (query tile, KV head) work unit
// with a flash-style online softmax over KV spans of up to 64 positions, templated on the
// micro-kernels (an Isa struct: load_q, load_k, load_v, qk, cap_scores, mask_row, softmax_step, pv,
// store_o).
// Buffer layouts are the Isa's business per element type: the driver only passes them along.
//
// Spans start at absolute multiples of 64 (kv_lo below is rounded down), so a row meets the same
// spans whatever tile or prefill chunk it falls in, with or without a sliding window: these
// kernels are batch-invariant (docs/determinism.md), like the AVX2 kernel's own driver
// (attention_avx2.cpp), which aligns its spans the same way. Past kPartition positions
// (attention_kernel.h) the online softmax restarts at every absolute multiple of it and the
// partitions merge in position order (fold_row): one unit does it in turn, or, for a few long
// decodes, one unit per partition and merge_partitions after, with the same bits either way.
//
// Included by exactly one .cpp per ISA (attention_generic.cpp, attention_avx512.cpp); everything
// here has internal linkage so each inclusion compiles with that file's target options and
// nothing is merged across ISAs by the linker.
#pragma once

#include <omp.h>

#include <algorithm>
#include <utility>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "attention_kernel.h"
#include "elem.h"

namespace pagewire::cpu {
namespace {

// kSpan (attention_kernel.h): four 16-lane vectors per score row.
inline int round16(int n) { return (n + 15) / 16 * 16; }

// Per-thread fp32 scratch, allocated once per call. Rows are (token, head) pairs of a tile.
struct Scratch {
  float* q;      // [rows, D] scaled queries
  float* acc;    // [rows, D] unnormalised output
  float* s;      // [rows, kSpan] scores, then probabilities
  float* kt;     // [D, kSpan] transposed K span
  float* v;      // [kSpan, D] V span
  float* m;      // [rows] running max
  float* l;      // [rows] running sum of exp
  float* alpha;  // [rows] rescale factor of acc for the current span
  float* zero;   // [D] zeros: the K/V row of every position below the window (never read from the cache)
  float* acc_t;  // [rows, D]: the finished partitions merged (fold_row), when a tile's context spans several
  float* m_t;    // [rows] their running max
  float* l_t;    // [rows] their sum of exp
  void* base;
  NextUnitPrefetch next;  // the thread's next unit's first KV lines, drained by load_k/load_v

  Scratch(int64_t rows, int64_t D) {
    const int64_t r16 = (rows + 15) / 16 * 16;
    const int64_t floats = 3 * r16 * D + r16 * kSpan + 2 * D * kSpan + 5 * r16 + D;
    base = std::aligned_alloc(64, static_cast<size_t>(floats) * sizeof(float));
    if (base == nullptr) throw std::bad_alloc();
    float* p = static_cast<float*>(base);
    q = p, p += r16 * D;
    acc = p, p += r16 * D;
    s = p, p += r16 * kSpan;
    kt = p, p += D * kSpan;
    v = p, p += D * kSpan;
    m = p, p += r16;
    l = p, p += r16;
    alpha = p, p += r16;
    acc_t = p, p += r16 * D;
    m_t = p, p += r16;
    l_t = p, p += r16;
    zero = p;
    std::fill(zero, zero + D, 0.f);
  }
  ~Scratch() { std::free(base); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// always_inline matters: GCC marks an out-of-line function holding only prefetches as const and
// deletes every call to it (it did, silently, before this attribute).
[[gnu::always_inline]] inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// queue_next() is called once, as the last two spans begin: it claims the thread's next unit and
// queues its KV in s.next, which load_k/load_v then drain.
template <class Isa, class E, class QueueNext>
void attend_tile(const PagedAttentionArgs& a, const WorkItem& w, int kvh, Scratch& s, const QueueNext& queue_next) {
  const int G = a.num_heads / a.num_kv_heads, D = a.head_dim, bs = a.block_size, W = a.sliding_window;
  const int rows = w.q_count * G;
  const int64_t q_start = a.query_start_loc[w.seq];
  const int q_len = a.query_start_loc[w.seq + 1] - static_cast<int>(q_start);
  const int pos0 = a.seq_lens[w.seq] - q_len + w.q_begin;  // absolute position of the tile's first token
  const int pos_last = pos0 + w.q_count - 1;

  const int32_t* table = a.block_tables + w.seq * a.block_table_stride;
  const int64_t tile_elems = static_cast<int64_t>(bs) * D;  // one contiguous (block, kv_head) tile
  const E* key_cache = static_cast<const E*>(a.key_cache);
  const E* value_cache = static_cast<const E*>(a.value_cache);
  auto tile_of = [&](int b) { return (static_cast<int64_t>(table[b]) * a.num_kv_heads + kvh) * tile_elems; };
  // Union of the rows' visible ranges, its start rounded down to a multiple of kSpan; positions
  // at or beyond the sequence's length, or before the first row's window, are never loaded, so
  // stale or uninitialised cache slots (possibly NaN) cannot leak into P @ V.
  // The rounding makes every row's spans [64 j, 64 (j + 1)) whatever tile it falls in, so a
  // sliding-window row's online-softmax steps (and so its rounding) do not depend on how its
  // sequence was cut into tiles and prefill chunks: spans wholly outside a row's window or past
  // its position are exact no-ops for it (docs/determinism.md).
  // Positions below win_lo (the first row's window start) are not read at all: they point at a
  // zero row, as in the AVX2 kernel, so a sliding-window group's block table may hold no block
  // there (the allocator returned those blocks to the pool, server/engine/kv_groups.py).
  const int win_lo = W > 0 ? std::max(0, pos0 - W + 1) : 0;
  // A split tile (w.part >= 0) reads only its partition; the spans keep their absolute starts.
  const int kv_lo = w.part >= 0 ? std::max(win_lo / kSpan * kSpan, w.part * kPartition) : win_lo / kSpan * kSpan;
  const int kv_hi = w.part >= 0 ? std::min(pos_last + 1, (w.part + 1) * kPartition) : pos_last + 1;
  // Physical blocks are scattered, so the hardware prefetcher cannot guess the next tile. The first
  // span is requested here, overlapping the Q load; later spans are prefetched a line per load
  // while the previous span is read. Measured on a bf16 decode batch (64 seqs x ~300 ctx, one
  // thread, caches in DRAM): no prefetch 3.8 ms, one burst per span 2.8 ms, interleaved 1.5 ms
  // (1.1 ms with the caches in L3).
  for (int b = std::max(win_lo, kv_lo) / bs; b <= (std::min(kv_lo + kSpan, kv_hi) - 1) / bs; ++b) {
    prefetch_bytes(key_cache + tile_of(b), tile_elems * sizeof(E));
    prefetch_bytes(value_cache + tile_of(b), tile_elems * sizeof(E));
  }

  // Row r = t * G + g: token t of the tile, query head kvh * G + g.
  const E* query = static_cast<const E*>(a.query);
  for (int t = 0; t < w.q_count; ++t) {
    for (int g = 0; g < G; ++g) {
      const E* src = query + (q_start + w.q_begin + t) * a.q_stride_t + (kvh * G + g) * a.q_stride_h;
      Isa::load_q(src, D, a.scale, s.q + static_cast<int64_t>(t * G + g) * D);
    }
  }
  PartitionRows part{s.m, s.l, s.acc, s.m_t, s.l_t, s.acc_t, rows, D};
  part.start();

  // Row pointers of this span and the next: one pointer per position, because spans may straddle
  // blocks and blocks need not be 16-aligned. The next span's rows are prefetched line by line from
  // inside load_k/load_v, interleaved with this span's loads.
  const E* rows_buf[4][kSpan];
  const E** k_rows = rows_buf[0];
  const E** v_rows = rows_buf[1];
  const E** k_next = rows_buf[2];
  const E** v_next = rows_buf[3];
  const E* zero_row = reinterpret_cast<const E*>(s.zero);  // all-zero bits are 0 in every type
  auto fill_rows = [&](int p0, const E** kr, const E** vr) {
    const int n = std::min(kSpan, kv_hi - p0);
    int j = 0;
    for (; j < n && p0 + j < win_lo; ++j) kr[j] = vr[j] = zero_row;
    for (int pos = p0 + j, b = pos / bs, off = pos % bs; j < n; ++j) {
      const int64_t at = tile_of(b) + static_cast<int64_t>(off) * D;
      kr[j] = key_cache + at;
      vr[j] = value_cache + at;
      if (++off == bs) off = 0, ++b;
    }
    return n;
  };
  int n = fill_rows(kv_lo, k_rows, v_rows);  // positions in this span
  s.next.clear();
  bool queued = false;
  const int64_t lines_per_row = (static_cast<int64_t>(D) * sizeof(E) + 63) / 64;
  for (int p0 = kv_lo; p0 < kv_hi; p0 += kSpan) {
    if (p0 != kv_lo && p0 % kPartition == 0) part.end_partition();
    if (!queued && p0 + 2 * kSpan >= kv_hi) {
      queued = true;
      queue_next();
      s.next.pace(2 * (kv_hi - p0) * lines_per_row);  // K and V lines left to load
    }
    const int n_next = p0 + kSpan < kv_hi ? fill_rows(p0 + kSpan, k_next, v_next) : 0;
    const int nw = round16(n);  // columns computed (padding columns are masked)
    Isa::load_k(k_rows, n, D, s.kt, k_next, n_next, s.next);
    Isa::load_v(v_rows, n, D, s.v, v_next, n_next, s.next);
    Isa::template qk<E>(s.q, rows, D, s.kt, nw, s.s, a.scale);
    // Soft-capping is elementwise on each row's own scores, so it keeps the invariance above.
    if (a.softcap > 0.f) Isa::cap_scores(s.s, rows, nw, a.softcap);

    // A span visible to every row in full needs no masking (the common case in long contexts).
    const bool full = n == nw && p0 + n - 1 <= pos0 && (W <= 0 || pos_last - p0 < W);
    for (int r = 0; r < rows; ++r) {
      float* srow = s.s + r * kSpan;
      if (!full) {
        const int pq = pos0 + r / G;
        const int hi = std::min(n, pq - p0 + 1);
        const int lo = W > 0 ? std::max(0, pq - W + 1 - p0) : 0;
        Isa::mask_row(srow, nw, lo, hi);
      }
      Isa::softmax_step(srow, nw, s.m + r, s.l + r, s.alpha + r);
    }
    Isa::template pv<E>(s.s, s.alpha, rows, D, s.v, n, s.acc);
    std::swap(k_rows, k_next);
    std::swap(v_rows, v_next);
    n = n_next;
  }

  if (w.part >= 0) return part.store_partials(a, w, kvh);  // one partition of a split tile
  part.finish();
  const float *acc = part.out_acc(), *m = part.out_m(), *l = part.out_l();
  E* out = static_cast<E*>(a.out);
  for (int t = 0; t < w.q_count; ++t) {
    for (int g = 0; g < G; ++g) {
      const int r = t * G + g;
      E* dst = out + (q_start + w.q_begin + t) * a.out_stride_t + (kvh * G + g) * a.out_stride_h;
      // l > 0: every query sees at least its own position.
      Isa::store_o(acc + static_cast<int64_t>(r) * D, sink_inv_l(m[r], l[r], a.sinks, kvh * G + g), D, dst);
    }
  }
}

template <class Isa, class E>
void run_paged_attention(const PagedAttentionArgs& a) {
  const int G = a.num_heads / a.num_kv_heads;
  const int64_t units = a.num_items * a.num_kv_heads;
  // Scratch is allocated (when it must grow) before the parallel region, so an allocation failure
  // throws on the calling thread instead of terminating inside OpenMP.
  const int threads = units > 1 ? (a.threads > 0 ? a.threads : omp_get_max_threads()) : 1;
  const std::vector<std::unique_ptr<Scratch>>& scratch =
      kept_scratch<Scratch>(threads, static_cast<int64_t>(a.max_tile_tokens) * G, a.head_dim);
  const int kvh = a.num_kv_heads;
  run_units(a, threads, [&](int64_t u, int thread, const auto& claim) {
    Scratch& s = *scratch[thread];
    attend_tile<Isa, E>(a, a.items[u / kvh], static_cast<int>(u % kvh), s, [&] { s.next.template queue_next<E>(a, claim); });
  });
  if (a.num_merges > 0) {
    merge_partitions(a, [&](const float* acc, float m, float l, int head, int64_t q_row) {
      Isa::store_o(acc, sink_inv_l(m, l, a.sinks, head), a.head_dim,
                   static_cast<E*>(a.out) + q_row * a.out_stride_t + head * a.out_stride_h);
    });
  }
}

template <class Isa>
void dispatch_paged_attention(const PagedAttentionArgs& a) {
  switch (a.dtype) {
    case ElemType::kFloat32:
      run_paged_attention<Isa, float>(a);
      break;
    case ElemType::kBFloat16:
      run_paged_attention<Isa, Bf16>(a);
      break;
    case ElemType::kFloat16:
      run_paged_attention<Isa, Fp16>(a);
      break;
  }
}

}  // namespace
}  // namespace pagewire::cpu
