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

namespace pagewire::cpu {
namespace {

// KV positions per online-softmax step (eight 8-lane vectors per score row): the per-row softmax
// bookkeeping is paid once per 64 positions. Part of the invariance contract above: changing it
// changes results (identically for every batch).
constexpr int kSpan = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Tiles of at most this many (token, head) rows read 16-bit K/V straight from the cache (see
// attend_tile).
constexpr int kDirectRows = 8;

inline int round8(int n) { return (n + 7) & ~7; }

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const Fp16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(Bf16* p, __m256 v) {  // round to nearest even, NaN stays NaN (elem.h's rule)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(Fp16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp(x) for x <= 0 (scores minus their running max) to ~1 ulp; lanes below -87 (including -inf
// from masking) are exactly 0. Cody-Waite reduction x = n ln2 + r, degree-7 Taylor for e^r, 2^n
// built in the exponent bits (n >= -126, so 2^n is a normal number).
inline __m256 exp8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

// The fixed add tree of the invariance contract, for four 8-lane accumulators at once:
// lane i of the result = ((a_i[0]+a_i[1])+(a_i[2]+a_i[3])) + ((a_i[4]+a_i[5])+(a_i[6]+a_i[7])).
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

inline float reduce1(__m256 a) {
  const __m256 z = _mm256_setzero_ps();
  return _mm_cvtss_f32(reduce4(a, z, z, z));
}

inline float hmax(__m256 v) {  // max is exact, so its order does not matter
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// s[r][c0+i] = q[r] . k_rows[c0+i] for R rows and four columns: 4R accumulators, each key vector
// loaded (and widened, for a 16-bit S) once per 8 d and shared by the R rows.
template <int R, class S>
inline void qk_block(const float* q, int D, const S* const* k, float* s) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  }
  for (int d = 0; d < D; d += 8) {
    __m256 kv[4];
    for (int i = 0; i < 4; ++i) kv[i] = load8(k[i] + d);
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * D + d);
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_fmadd_ps(qv, kv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) _mm_storeu_ps(s + r * kSpan, reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

// Scores of `rows` rows against ncols (a multiple of 8) keys: blocks of three rows (12 of the 16
// registers accumulate), then a block of the remainder.
// Each block of four columns also takes `steps` steps of the next unit's prefetch (at).
template <class S>
inline void qk(const float* q, int rows, int D, const S* const* k_rows, int ncols, float* s,
               NextUnitPrefetch::Cursor& at, int steps) {
  for (int c = 0; c < ncols; c += 4) {
    for (int i = 0; i < steps; ++i) at.step();
    int r = 0;
    for (; r + 3 <= rows; r += 3) qk_block<3, S>(q + r * D, D, k_rows + c, s + r * kSpan + c);
    if (rows - r == 2) qk_block<2, S>(q + r * D, D, k_rows + c, s + r * kSpan + c);
    if (rows - r == 1) qk_block<1, S>(q + r * D, D, k_rows + c, s + r * kSpan + c);
  }
}

// s[r][c] = cap * tanh(s[r][c] / cap) for `rows` rows of ncols (a multiple of 8) scores: logit
// soft-capping. tanh|y| = (1 - e) / (1 + e) with e = exp(-2|y|) <= 1 (exp8's domain), the sign put
// back from y; absolute error ~1e-7 * cap. Elementwise, so it keeps the invariance contract.
inline void cap_scores(float* s, int rows, int ncols, float cap) {
  const __m256 c = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.f / cap);
  const __m256 one = _mm256_set1_ps(1.f), m2 = _mm256_set1_ps(-2.f), sign = _mm256_set1_ps(-0.f);
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < ncols; j += 8) {
      float* p = s + r * kSpan + j;
      const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(p), inv);
      const __m256 e = exp8(_mm256_mul_ps(m2, _mm256_andnot_ps(sign, y)));
      const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
      _mm256_storeu_ps(p, _mm256_mul_ps(c, _mm256_or_ps(t, _mm256_and_ps(sign, y))));
    }
  }
}

// Scores outside [lo, hi) become -inf.
inline void mask_row(float* srow, int ncols, int lo, int hi) {
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  const __m256i lo_v = _mm256_set1_epi32(lo), hi_v = _mm256_set1_epi32(hi);
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int c = 0; c < ncols; c += 8) {
    // visible = idx >= lo && idx < hi  <=>  !(lo > idx) && (hi > idx)
    const __m256i vis = _mm256_andnot_si256(_mm256_cmpgt_epi32(lo_v, idx), _mm256_cmpgt_epi32(hi_v, idx));
    _mm256_storeu_ps(srow + c, _mm256_blendv_ps(ninf, _mm256_loadu_ps(srow + c), _mm256_castsi256_ps(vis)));
    idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8));
  }
}

// Online-softmax update of one row: scores become probabilities relative to the new running max;
// *alpha moves the row's accumulator to that max (applied in pv). Sums run over the 8-lane vectors
// in column order, then the fixed tree: trailing all-masked vectors add exact zeros.
inline void softmax_row(float* srow, int ncols, float* m, float* l, float* alpha) {
  __m256 mv = _mm256_set1_ps(*m);
  for (int c = 0; c < ncols; c += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(srow + c));
  const float mx = hmax(mv);
  if (mx == kNegInf) {  // nothing visible to this row yet
    for (int c = 0; c < ncols; c += 8) _mm256_storeu_ps(srow + c, _mm256_setzero_ps());
    *alpha = 1.f;
    return;
  }
  const __m256 mb = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (int c = 0; c < ncols; c += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(srow + c), mb));
    _mm256_storeu_ps(srow + c, p);
    sum = _mm256_add_ps(sum, p);
  }
  *alpha = std::exp(*m - mx);
  *l = *l * *alpha + reduce1(sum);
  *m = mx;
}

// acc[r][d0 + 8i ..] = alpha[r] * acc + sum_{j0 <= j < j1} p[r][j] * v_rows[j][d0 + 8i ..], j in
// order, for R rows and NV 8-lane vectors of d.
template <int R, int NV, class S>
inline void pv_block(const float* p, const float* alpha, int D, const S* const* v, int j0, int j1, int d0,
                     float* acc) {
  __m256 a[R][NV];
  for (int r = 0; r < R; ++r) {
    const __m256 al = _mm256_set1_ps(alpha[r]);
    for (int i = 0; i < NV; ++i) a[r][i] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d0 + 8 * i), al);
  }
  for (int j = j0; j < j1; ++j) {
    __m256 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load8(v[j] + d0 + 8 * i);
    for (int r = 0; r < R; ++r) {
      const __m256 pj = _mm256_broadcast_ss(p + r * kSpan + j);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm256_fmadd_ps(pj, vv[i], a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + r * D + d0 + 8 * i, a[r][i]);
  }
}

template <int R, class S>
inline void pv_rows(const float* p, const float* alpha, int D, const S* const* v, int j0, int j1, float* acc) {
  int d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) pv_block<R, 4, S>(p, alpha, D, v, j0, j1, d0, acc);
  switch ((D - d0) / 8) {
    case 3:
      pv_block<R, 3, S>(p, alpha, D, v, j0, j1, d0, acc);
      break;
    case 2:
      pv_block<R, 2, S>(p, alpha, D, v, j0, j1, d0, acc);
      break;
    case 1:
      pv_block<R, 1, S>(p, alpha, D, v, j0, j1, d0, acc);
      break;
    default:
      break;
  }
}

template <class S>
inline void pv(const float* p, const float* alpha, int rows, int D, const S* const* v, int j0, int j1,
               float* acc) {
  int r = 0;
  for (; r + 2 <= rows; r += 2) pv_rows<2, S>(p + r * kSpan, alpha + r, D, v, j0, j1, acc + r * D);
  if (r < rows) pv_rows<1, S>(p + r * kSpan, alpha + r, D, v, j0, j1, acc + r * D);
}

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
  const int threads = units > 1 ? omp_get_max_threads() : 1;
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
