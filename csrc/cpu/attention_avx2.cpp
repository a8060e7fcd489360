// AVX2+FMA+F16C paged attention for CPUs without AVX-512 (Zen 2/3, Haswell to Alder Lake): one
// (query tile, KV head) work unit at a time, flash-style online softmax over KV spans of kSpan
// positions, fp32 accumulation. Compiled for that ISA via a target pragma and called by
// attention.cpp only when cpu::active_isa() is at least Isa::kAvx2 and head_dim % 8 == 0.
//
// Batch invariance, by construction: a query row's result is bit-identical whatever the batch, the
// row's place in it, the tile it lands in, and whether it is computed in a prefill, a prefill
// chunk or as a decode token. The engine's deterministic mode relies on this (issue 14). It holds
// because every piece of per-row arithmetic depends on that row alone:
//   - KV spans start at absolute multiples of kSpan (position 0, kSpan, 2 kSpan, ..), never at
//     the tile's first visible position, so each row meets the same spans in the same order;
//   - a score is one row's dot product with one key: 8-lane FMAs over d in order, then a fixed
//     add tree ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)); no sum runs across rows;
//   - the softmax of a row reads only its own scores; the columns it cannot see are -inf, so extra
//     spans or columns that a bigger tile adds contribute max(.., -inf) and + 0.0, which are exact;
//   - P @ V accumulates each (row, d) lane over the span's positions in order; positions a row
//     cannot see have p = 0, and acc + 0 * v == acc exactly. Positions below the tile's lowest
//     window start, and padding columns, are never read from the cache: they point at a zero row
//     (so stale or unwritten slots, possibly NaN, cannot leak in). Positions a tile does read are
//     tokens of this sequence up to its last query, all written before the call.
//   - past kPartition positions (attention_kernel.h) the online softmax restarts at every absolute
//     multiple of it and the partitions merge in position order through fold_row, whether one
//     unit runs them in turn or, for a few long decodes, one unit each and merge_partitions after.
// Register blocking (rows x columns of QK, rows x d-vectors of PV) changes which rows share a
// load, never the order of any row's own operations.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

// Headers first: inline functions they define must keep the baseline ISA.
#include "attention_kernel.h"
#include "elem.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "attention_avx2_ops.h"

namespace pagewire::cpu {
namespace {

// kSpan (attention_kernel.h): eight 8-lane vectors per score row.

// Tiles of at most this many (token, head) rows read 16-bit K/V straight from the cache (see
// attend_tile).
constexpr int kDirectRows = 8;

// Per-thread fp32 scratch, allocated once per call. Rows are (token, head) pairs of a tile.
struct Scratch {
  float* q;      // [rows, D] scaled queries
  float* acc;    // [rows, D] unnormalised output
  float* s;      // [rows, kSpan] scores, then probabilities
  float* k;      // [kSpan, D] the span's keys widened to fp32 (16-bit caches, large tiles)
  float* v;      // [kSpan, D] the span's values widened to fp32 (16-bit caches, large tiles)
  float* zero;   // [D] zeros: the row of every position a tile does not read
  float* m;      // [rows] running max
  float* l;      // [rows] running sum of exp
  float* alpha;  // [rows] rescale factor of acc for the current span
  float* acc_t;  // [rows, D]: the finished partitions merged (fold_row), when a tile's context spans several
  float* m_t;    // [rows] their running max
  float* l_t;    // [rows] their sum of exp
  void* base;
  NextUnitPrefetch next;  // the thread's next unit's first KV lines (attention_kernel.h)

  Scratch(int64_t rows, int64_t D) {
    const int64_t r8 = (rows + 7) / 8 * 8;
    const int64_t floats = 3 * r8 * D + r8 * kSpan + 2 * D * kSpan + D + 5 * r8;
    base = std::aligned_alloc(64, static_cast<size_t>((floats * 4 + 63) / 64 * 64));
    if (base == nullptr) throw std::bad_alloc();
    float* p = static_cast<float*>(base);
    q = p, p += r8 * D;
    acc = p, p += r8 * D;
    s = p, p += r8 * kSpan;
    k = p, p += D * kSpan;
    v = p, p += D * kSpan;
    zero = p, p += D;
    m = p, p += r8;
    l = p, p += r8;
    alpha = p, p += r8;
    acc_t = p, p += r8 * D;
    m_t = p, p += r8;
    l_t = p;
    std::fill(zero, zero + D, 0.f);
  }
  ~Scratch() { std::free(base); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// always_inline: GCC may treat an out-of-line function holding only prefetches as const and drop
// its calls (attention_tile.h saw it happen).
template <class E>
[[gnu::always_inline]] inline void prefetch_row(const E* row, int D) {
  const char* c = reinterpret_cast<const char*>(row);
  const int64_t bytes = static_cast<int64_t>(D) * static_cast<int64_t>(sizeof(E));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// dst = acc * inv_l, rounded to E: a row's output.
template <class E>
inline void store_row(const float* acc, float inv_l, int D, E* dst) {
  const __m256 s = _mm256_set1_ps(inv_l);
  for (int d = 0; d < D; d += 8) store8(dst + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), s));
}

// queue_next() is called once, as the last two spans begin: it claims the thread's next unit and
// queues its first KV lines in s.next, drained while those spans' K and V are read.
template <class E, class QueueNext>
void attend_tile(const PagedAttentionArgs& a, const WorkItem& w, int kvh, Scratch& s, const QueueNext& queue_next) {
  const int G = a.num_heads / a.num_kv_heads, D = a.head_dim, bs = a.block_size, W = a.sliding_window;
  const int rows = w.q_count * G;
  const int64_t q_start = a.query_start_loc[w.seq];
  const int q_len = a.query_start_loc[w.seq + 1] - static_cast<int>(q_start);
  const int pos0 = a.seq_lens[w.seq] - q_len + w.q_begin;  // absolute position of the tile's first token
  const int pos_last = pos0 + w.q_count - 1;

  const int32_t* table = a.block_tables + w.seq * a.block_table_stride;
  const E* key_cache = static_cast<const E*>(a.key_cache);
  const E* value_cache = static_cast<const E*>(a.value_cache);
  auto offset_of = [&](int pos) {
    return ((static_cast<int64_t>(table[pos / bs]) * a.num_kv_heads + kvh) * bs + pos % bs) * D;
  };
  // Positions [kv_lo, kv_hi) are read from the cache: the union of the rows' visible ranges (a
  // split tile's unit, w.part >= 0: only those in its partition, attention_kernel.h kPartition).
  const int kv_lo = W > 0 ? std::max(0, pos0 - W + 1) : 0;
  const int kv_hi = w.part >= 0 ? std::min(pos_last + 1, (w.part + 1) * kPartition) : pos_last + 1;
  // Absolute alignment: see the invariance contract.
  const int first_span = w.part >= 0 ? std::max(kv_lo / kSpan * kSpan, w.part * kPartition) : kv_lo / kSpan * kSpan;

  const E* query = static_cast<const E*>(a.query);
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int t = 0; t < w.q_count; ++t) {
    for (int g = 0; g < G; ++g) {
      const E* src = query + (q_start + w.q_begin + t) * a.q_stride_t + (kvh * G + g) * a.q_stride_h;
      float* dst = s.q + static_cast<int64_t>(t * G + g) * D;
      for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(load8(src + d), scale));
    }
  }
  PartitionRows part{s.m, s.l, s.acc, s.m_t, s.l_t, s.acc_t, rows, D};
  part.start();

  // The cache rows of a span, one offset per position (spans may straddle blocks, and blocks need
  // not be 8-aligned); -1 for a position the tile does not read.
  int64_t off_buf[2][kSpan];
  int64_t* offs = off_buf[0];
  int64_t* next = off_buf[1];
  auto fill_offsets = [&](int p0, int64_t* o) {
    const int n = std::min(kSpan, kv_hi - p0);
    for (int j = 0; j < n; ++j) o[j] = p0 + j >= kv_lo ? offset_of(p0 + j) : -1;
    return n;
  };
  int n = fill_offsets(first_span, offs);
  // Physical blocks are scattered, so the hardware prefetcher cannot guess the next span: the
  // first is requested here, each later one while the previous span is computed (a row at a time
  // inside the widening loop, or in one burst before it when K and V are read directly).
  for (int j = 0; j < n; ++j) {
    if (offs[j] >= 0) prefetch_row(key_cache + offs[j], D), prefetch_row(value_cache + offs[j], D);
  }
  // Small tiles (decodes) read K and V straight from the cache, widening in registers; larger
  // ones widen each span once into fp32 scratch that their row blocks then share. Widening is
  // exact, so both give the same bits (the invariance test compares a decode with a prefill).
  const bool direct = std::is_same_v<E, float> || rows <= kDirectRows;
  const E* zero_e = reinterpret_cast<const E*>(s.zero);  // all-zero bits are 0 in every type
  const E* k_src[kSpan];
  const E* v_src[kSpan];
  const float* k_rows[kSpan];
  const float* v_rows[kSpan];
  s.next.clear();
  bool queued = false;
  const int lines_per_row = static_cast<int>((static_cast<int64_t>(D) * sizeof(E) + 63) / 64);
  for (int p0 = first_span; p0 < kv_hi; p0 += kSpan) {
    if (p0 != first_span && p0 % kPartition == 0) part.end_partition();
    if (!queued && p0 + 2 * kSpan >= kv_hi) {
      queued = true;
      queue_next();
      s.next.pace(2 * (kv_hi - p0) * lines_per_row);  // K and V lines left to read, one step per line
    }
    NextUnitPrefetch::Cursor at = s.next.cursor();
    const int n_next = p0 + kSpan < kv_hi ? fill_offsets(p0 + kSpan, next) : 0;
    const int ncols = round8(n);
    const int j0 = std::max(0, kv_lo - p0);  // columns below j0 are not read (zero rows)
    if (direct) {
      for (int j = 0; j < ncols; ++j) {
        const bool read = j >= j0 && j < n;
        k_src[j] = read ? key_cache + offs[j] : zero_e;
        v_src[j] = read ? value_cache + offs[j] : zero_e;
      }
      for (int j = 0; j < n_next; ++j) {
        if (next[j] >= 0) prefetch_row(key_cache + next[j], D), prefetch_row(value_cache + next[j], D);
      }
      qk(s.q, rows, D, k_src, ncols, s.s, at, 8 * lines_per_row);  // four K rows and four V rows' worth
    } else {
      for (int j = 0; j < ncols; ++j) {
        if (j >= j0 && j < n) {
          const E* kr = key_cache + offs[j];
          const E* vr = value_cache + offs[j];
          float* kd = s.k + static_cast<int64_t>(j) * D;
          float* vd = s.v + static_cast<int64_t>(j) * D;
          for (int d = 0; d < D; d += 8) {
            _mm256_storeu_ps(kd + d, load8(kr + d));
            _mm256_storeu_ps(vd + d, load8(vr + d));
          }
          k_rows[j] = kd;
          v_rows[j] = vd;
        } else {
          k_rows[j] = v_rows[j] = s.zero;
        }
        if (j < n_next && next[j] >= 0) prefetch_row(key_cache + next[j], D), prefetch_row(value_cache + next[j], D);
        for (int i = 0; i < 2 * lines_per_row; ++i) at.step();
      }
      qk(s.q, rows, D, k_rows, ncols, s.s, at, 0);
    }
    if (a.softcap > 0.f) cap_scores(s.s, rows, ncols, a.softcap);

    // A span every row sees in full needs no mask (the common case in long contexts).
    const bool full = j0 == 0 && n == kSpan && p0 + kSpan - 1 <= pos0 && (W <= 0 || pos_last - p0 < W);
    for (int r = 0; r < rows; ++r) {
      float* srow = s.s + r * kSpan;
      if (!full) {
        const int pq = pos0 + r / G;
        const int hi = std::min(ncols, pq - p0 + 1);
        const int lo = W > 0 ? std::max(0, pq - W + 1 - p0) : 0;
        mask_row(srow, ncols, lo, hi);
      }
      softmax_row(srow, ncols, s.m + r, s.l + r, s.alpha + r);
    }
    if (direct) {
      pv(s.s, s.alpha, rows, D, v_src, j0, n, s.acc);
    } else {
      pv(s.s, s.alpha, rows, D, v_rows, j0, n, s.acc);
    }
    s.next.resume(at);
    std::swap(offs, next);
    n = n_next;
  }

  if (w.part >= 0) return part.store_partials(a, w, kvh);  // one partition of a split tile
  part.finish();
  const float *acc = part.out_acc(), *m = part.out_m(), *l = part.out_l();
  E* out = static_cast<E*>(a.out);
  for (int t = 0; t < w.q_count; ++t) {
    for (int g = 0; g < G; ++g) {
      const int r = t * G + g;
      // l > 0: every query sees at least its own position.
      store_row(acc + static_cast<int64_t>(r) * D, sink_inv_l(m[r], l[r], a.sinks, kvh * G + g), D,
                out + (q_start + w.q_begin + t) * a.out_stride_t + (kvh * G + g) * a.out_stride_h);
    }
  }
}

template <class E>
void run(const PagedAttentionArgs& a) {
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
    attend_tile<E>(a, a.items[u / kvh], static_cast<int>(u % kvh), s, [&] { s.next.template queue_next<E>(a, claim); });
  });
  if (a.num_merges > 0) {
    merge_partitions(a, [&](const float* acc, float m, float l, int head, int64_t q_row) {
      store_row(acc, sink_inv_l(m, l, a.sinks, head), a.head_dim,
                static_cast<E*>(a.out) + q_row * a.out_stride_t + head * a.out_stride_h);
    });
  }
}

}  // namespace

void paged_attention_avx2(const PagedAttentionArgs& args) {
  switch (args.dtype) {
    case ElemType::kFloat32:
      run<float>(args);
      break;
    case ElemType::kBFloat16:
      run<Bf16>(args);
      break;
    case ElemType::kFloat16:
      run<Fp16>(args);
      break;
  }
}

}  // namespace pagewire::cpu

#pragma GCC pop_options
