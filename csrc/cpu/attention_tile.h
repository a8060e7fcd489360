// The ISA-independent part of the CPU paged-attention kernel: one (query tile, KV head) work unit
// with a flash-style online softmax over 16-position KV chunks, templated on the micro-kernels.
//
// Included by exactly one .cpp per ISA (attention_generic.cpp, attention_avx512.cpp); everything
// here has internal linkage so each inclusion compiles with that file's target options and
// nothing is merged across ISAs by the linker.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "attention_kernel.h"
#include "elem.h"

namespace pagewire::cpu {
namespace {

constexpr int kChunk = 16;  // KV positions per inner step: one AVX-512 register of fp32 scores

// Per-thread fp32 scratch, allocated once per parallel region. Rows are (token, head) pairs of a tile.
struct Scratch {
  float* q;    // [rows, D] scaled queries
  float* acc;  // [rows, D] unnormalised output
  float* s;    // [rows, kChunk] scores, then probabilities
  float* kt;   // [D, kChunk] transposed K chunk
  float* v;    // [kChunk, D] V chunk
  float* m;    // [rows] running max
  float* l;    // [rows] running sum of exp
  float* alpha;  // [rows] rescale factor of acc for the current chunk
  void* base;

  Scratch(int64_t rows, int64_t D) {
    const int64_t r16 = (rows + 15) / 16 * 16;
    const int64_t floats = 2 * r16 * D + r16 * kChunk + 2 * D * kChunk + 3 * r16;
    base = std::aligned_alloc(64, static_cast<size_t>(floats) * sizeof(float));
    if (base == nullptr) throw std::bad_alloc();
    float* p = static_cast<float*>(base);
    q = p, p += r16 * D;
    acc = p, p += r16 * D;
    s = p, p += r16 * kChunk;
    kt = p, p += D * kChunk;
    v = p, p += D * kChunk;
    m = p, p += r16;
    l = p, p += r16;
    alpha = p;
  }
  ~Scratch() { std::free(base); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

template <class Isa, class E>
void attend_tile(const PagedAttentionArgs& a, const WorkItem& w, int kvh, Scratch& s) {
  const int G = a.num_heads / a.num_kv_heads, D = a.head_dim, bs = a.block_size, W = a.sliding_window;
  const int rows = w.q_count * G;
  const int64_t q_start = a.query_start_loc[w.seq];
  const int q_len = a.query_start_loc[w.seq + 1] - static_cast<int>(q_start);
  const int pos0 = a.seq_lens[w.seq] - q_len + w.q_begin;  // absolute position of the tile's first token
  const int pos_last = pos0 + w.q_count - 1;

  // Row r = t * G + g: token t of the tile, query head kvh * G + g.
  const E* query = static_cast<const E*>(a.query);
  for (int t = 0; t < w.q_count; ++t) {
    for (int g = 0; g < G; ++g) {
      const E* src = query + (q_start + w.q_begin + t) * a.q_stride_t + (kvh * G + g) * a.q_stride_h;
      Isa::load_q(src, D, a.scale, s.q + static_cast<int64_t>(t * G + g) * D);
    }
  }
  std::fill(s.acc, s.acc + static_cast<int64_t>(rows) * D, 0.f);
  std::fill(s.m, s.m + rows, -std::numeric_limits<float>::infinity());
  std::fill(s.l, s.l + rows, 0.f);

  // Union of the rows' visible ranges; positions outside it are never loaded, so stale or
  // uninitialised cache slots (possibly NaN) cannot leak into P @ V.
  const int kv_lo = W > 0 ? std::max(0, pos0 - W + 1) : 0;
  const int kv_hi = pos_last + 1;
  const int32_t* table = a.block_tables + w.seq * a.block_table_stride;
  const int64_t tile_elems = static_cast<int64_t>(bs) * D;  // one contiguous (block, kv_head) tile
  const E* key_cache = static_cast<const E*>(a.key_cache);
  const E* value_cache = static_cast<const E*>(a.value_cache);

  for (int b = kv_lo / bs; b <= (kv_hi - 1) / bs; ++b) {
    const int64_t tile = (static_cast<int64_t>(table[b]) * a.num_kv_heads + kvh) * tile_elems;
    for (int off = 0; off < bs; off += kChunk) {
      const int base = b * bs + off;
      const int j_lo = std::max(0, kv_lo - base);
      const int j_hi = std::min({kChunk, bs - off, kv_hi - base});
      if (j_lo >= j_hi) continue;
      Isa::load_k(key_cache + tile + static_cast<int64_t>(off) * D, j_lo, j_hi, D, s.kt);
      Isa::load_v(value_cache + tile + static_cast<int64_t>(off) * D, j_lo, j_hi, D, s.v);
      Isa::qk(s.q, rows, D, s.kt, s.s);

      // A chunk visible to every row in full needs no masking (the common case in long contexts).
      const bool full = j_lo == 0 && j_hi == kChunk && base + kChunk - 1 <= pos0 && (W <= 0 || pos_last - base < W);
      for (int r = 0; r < rows; ++r) {
        float* srow = s.s + r * kChunk;
        if (!full) {
          const int pq = pos0 + r / G;
          const int hi = std::min(j_hi, pq - base + 1);
          const int lo = W > 0 ? std::max(j_lo, pq - W + 1 - base) : j_lo;
          for (int j = 0; j < kChunk; ++j) {
            if (j < lo || j >= hi) srow[j] = -std::numeric_limits<float>::infinity();
          }
        }
        Isa::softmax_step(srow, s.m + r, s.l + r, s.alpha + r);
      }
      Isa::pv(s.s, s.alpha, rows, D, s.v, s.acc);
    }
  }

  E* out = static_cast<E*>(a.out);
  for (int t = 0; t < w.q_count; ++t) {
    for (int g = 0; g < G; ++g) {
      const int r = t * G + g;
      E* dst = out + (q_start + w.q_begin + t) * a.out_stride_t + (kvh * G + g) * a.out_stride_h;
      // l > 0: every query sees at least its own position.
      Isa::store_o(s.acc + static_cast<int64_t>(r) * D, 1.f / s.l[r], D, dst);
    }
  }
}

template <class Isa, class E>
void run_paged_attention(const PagedAttentionArgs& a) {
  const int G = a.num_heads / a.num_kv_heads;
  const int64_t units = a.num_items * a.num_kv_heads;
  // Scratch is allocated before the parallel region so an allocation failure throws on the
  // calling thread instead of terminating inside OpenMP.
  const int threads = units > 1 ? omp_get_max_threads() : 1;
  std::vector<std::unique_ptr<Scratch>> scratch;
  for (int i = 0; i < threads; ++i) {
    scratch.push_back(std::make_unique<Scratch>(static_cast<int64_t>(a.max_tile_tokens) * G, a.head_dim));
  }
  // Dynamic scheduling: units differ wildly in cost (a decode vs. the last tile of a long prefill);
  // the host orders items heaviest first so the tail is short.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t u = 0; u < units; ++u) {
    attend_tile<Isa, E>(a, a.items[u / a.num_kv_heads], static_cast<int>(u % a.num_kv_heads),
                        *scratch[omp_get_thread_num()]);
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
