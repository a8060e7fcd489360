// Small-batch bf16 GEMV/GEMM on AVX512-BF16 over the interleaved x8 layout (linear_kernel.h): a
// thread's share of the weight is one sequential stream, where the row-layout kernel
// (linear_avx512.cpp) reads eight rows side by side. On an AMD EPYC Zen 5 (2 cores) it moved
// 1.2-1.6x the row layout's bytes at M = 1 and 1.1-1.4x at 8-16 rows (0.76-1.25x at 2 and 4), and
// from 24 to 128 rows took 0.70-1.02x the time of ATen's GEMM on the row layout (bench/RESULTS.md,
// session 25). With the next span prefetched and long K split (session 26): 0.57-0.66x at 16 rows,
// 0.71-1.03x at 64 and 1.07-1.28x at 256.
//
// Arithmetic: exactly the row-layout kernel's per output (bf16_avx512.h). A 512-bit load of the
// x8 layout holds one 16-value chunk of two rows; x's chunk is broadcast to both halves, so each
// vdpbf16ps accumulates pair sums for two rows in eight lanes each. Even chunks go to one
// accumulator, odd chunks to another: lane j of the even one then holds what lane j of the row
// kernel's 32-wide accumulator holds, and lane j of the odd one its lane 8 + j, added in the same
// order. The epilogue joins the halves into that 16-lane accumulator and finishes it with the same
// store4, so the result is bitwise the row-layout kernel's for every M, tile and thread count
// (deterministic mode and exact speculation rely on it).
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16z_layout.h"  // (before the target switch: its inline functions are shared with baseline files)
#include "linear_kernel.h"
#include "team_kernel.h"  // (before the target switch: std headers)
#include "x86_target.h"

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
PAGEWIRE_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx512bf16,fma")

#include "bf16_avx512.h"

namespace pagewire::cpu {
namespace {

constexpr int64_t kRows = kBf16Interleave;  // rows per group
constexpr int64_t kChunkValues = 16 * kRows;  // one chunk of a group: 128 values, 256 bytes
// Bytes ahead of its loads that the first tile's pass prefetches. On the Zen 5, alternating builds in
// one session: 8 KiB against 1 KiB moved 1.18-1.60x against 1.13-1.46x the row layout's bytes at
// M = 1 and 1.04-1.20x against 0.97-1.11x at M = 2 (bench/RESULTS.md, session 25).
constexpr int64_t kPrefetchBytes = 8192;
// Above 128 chunks (K > 2048: a group over 32 KiB, which with x's tile no longer stays in the Zen 5's
// 48 KiB L1 between tiles) a group is taken in K spans of at most 96 chunks, every tile over one span
// before the next, the accumulators parked between spans. At 256 rows that cut the time against
// torch's GEMM on the row layout from 1.56-1.66x to 1.17-1.28x for K = 2816-8192; 64-chunk spans
// were slower (1.31-1.41x), and splitting K = 2048 cost 1.05x -> 1.25x (bench/RESULTS.md, session 26).
constexpr int64_t kSplitChunks = 128;
constexpr int64_t kSpanChunks = 96;

// x's 16 values of one chunk in both 256-bit halves (one per row of a weight vector's pair).
inline __m512bh x_chunk(const uint16_t* x) {
  return (__m512bh)_mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

inline __m512bh w_pair(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// A tile's accumulators: per x row, an even-chunk and an odd-chunk accumulator for each of the
// four row pairs. A span that does not start at chunk 0 resumes them from state; one that does not
// end at the last chunk parks them there, so a split K adds in the same order as one pass.
template <int MB>
inline void start_acc(__m512 (&acc)[MB][4][2], int64_t c0, const float* state) {
  for (int m = 0; m < MB; ++m) {
    for (int q = 0; q < 4; ++q) {
      for (int e = 0; e < 2; ++e) acc[m][q][e] = _mm512_setzero_ps();
    }
  }
  if (c0 == 0) return;
  for (int m = 0; m < MB; ++m) {
    for (int q = 0; q < 4; ++q) {
      for (int e = 0; e < 2; ++e) acc[m][q][e] = _mm512_loadu_ps(state + ((m * 4 + q) * 2 + e) * 16);
    }
  }
}

// After chunks [.., c1): park the accumulators (c1 < chunks) or finish the eight outputs of each x row.
template <int MB>
inline void finish_acc(__m512 (&acc)[MB][4][2], const uint16_t* bias, uint16_t* out, int64_t ldo) {
  for (int m = 0; m < MB; ++m) {
    // Row 2q's 16 lanes: the even accumulator's low half, then the odd one's; row 2q + 1: the high halves.
    __m512 rows[kRows];
    for (int q = 0; q < 4; ++q) {
      rows[2 * q] = _mm512_shuffle_f32x4(acc[m][q][0], acc[m][q][1], 0x44);
      rows[2 * q + 1] = _mm512_shuffle_f32x4(acc[m][q][0], acc[m][q][1], 0xEE);
    }
    store4(*reinterpret_cast<const __m512(*)[4]>(&rows[0]), bias, out + m * ldo);
    store4(*reinterpret_cast<const __m512(*)[4]>(&rows[4]), bias != nullptr ? bias + 4 : nullptr, out + m * ldo + 4);
  }
}

template <int MB>
inline void end_acc(__m512 (&acc)[MB][4][2], int64_t c1, int64_t chunks, float* state, const uint16_t* bias,
                    uint16_t* out, int64_t ldo) {
  if (c1 == chunks) {
    finish_acc<MB>(acc, bias, out, ldo);
    return;
  }
  for (int m = 0; m < MB; ++m) {
    for (int q = 0; q < 4; ++q) {
      for (int e = 0; e < 2; ++e) _mm512_storeu_ps(state + ((m * 4 + q) * 2 + e) * 16, acc[m][q][e]);
    }
  }
}

// K % 32 == 16: the last chunk (x8 layout at p). The row kernel's last, masked step adds zero pairs
// to lanes 8-15.
template <int MB>
inline void odd_chunk(__m512 (&acc)[MB][4][2], const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t c) {
  const __m512bh zero = (__m512bh)_mm512_setzero_si512();
  for (int m = 0; m < MB; ++m) {
    const __m512bh xv = x_chunk(x + m * ldx + c * 16);
    for (int q = 0; q < 4; ++q) {
      acc[m][q][0] = _mm512_dpbf16_ps(acc[m][q][0], xv, w_pair(p + q * 32));
      acc[m][q][1] = _mm512_dpbf16_ps(acc[m][q][1], zero, zero);
    }
  }
}

// The group's eight rows against MB rows of x over chunks [c0, c1) of K (MB = 3: 24 accumulators +
// 3 x vectors + 1 weight).
// pf / pf_end: bytes to prefetch into L2 during this pass, spread over its iterations (the next
// span, so that the tile that streams it finds it in L2 instead of memory).
template <int MB>
inline void group_tile(const uint16_t* x, int64_t ldx, const uint16_t* g, int64_t K, int64_t c0, int64_t c1,
                       float* state, const uint16_t* bias, uint16_t* out, int64_t ldo, bool prefetch,
                       const char* pf, const char* pf_end) {
  __m512 acc[MB][4][2];
  start_acc<MB>(acc, c0, state);
  const int64_t iters = (c1 - c0) / 2;
  const int64_t pf_per_iter = iters > 0 ? ((pf_end - pf) / 64 + iters - 1) / iters : 0;
  int64_t c = c0;
  for (; c + 2 <= c1; c += 2) {
    const uint16_t* p = g + c * kChunkValues;
    if (kPrefetchBytes > 0 && prefetch) {
      for (int64_t l = 0; l < 512; l += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes + l, _MM_HINT_T0);
      }
    }
    for (int64_t l = 0; l < pf_per_iter && pf < pf_end; ++l, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
    for (int e = 0; e < 2; ++e) {
      __m512bh xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = x_chunk(x + m * ldx + (c + e) * 16);
      for (int q = 0; q < 4; ++q) {
        const __m512bh w = w_pair(p + e * kChunkValues + q * 32);
        for (int m = 0; m < MB; ++m) acc[m][q][e] = _mm512_dpbf16_ps(acc[m][q][e], xv[m], w);
      }
    }
  }
  if (c < c1) odd_chunk<MB>(acc, x, ldx, g + c * kChunkValues, c);
  end_acc<MB>(acc, c1, K / 16, state, bias, out, ldo);
}

inline void group_rows(const uint16_t* x, int64_t ldx, const uint16_t* g, int64_t K, int64_t c0, int64_t c1,
                       float* state, const uint16_t* bias, uint16_t* out, int64_t ldo, int64_t rows, bool prefetch,
                       const char* pf, const char* pf_end) {
  switch (rows) {
    case 3:
      group_tile<3>(x, ldx, g, K, c0, c1, state, bias, out, ldo, prefetch, pf, pf_end);
      break;
    case 2:
      group_tile<2>(x, ldx, g, K, c0, c1, state, bias, out, ldo, prefetch, pf, pf_end);
      break;
    default:
      group_tile<1>(x, ldx, g, K, c0, c1, state, bias, out, ldo, prefetch, pf, pf_end);
      break;
  }
}

// How a call takes its M rows of x and K: tiles of at most three x rows, the first three (the pass
// that streams the group from memory does the most work per byte), then the rest balanced: 4 -> 3 + 1,
// 8 -> 3 + 3 + 2; K in spans when a group is over 32 KiB (K > 2048) and several tiles pass over it:
// equal spans of at most 96 chunks (24 KiB of the group), even so that chunk parity picks the same
// accumulator.
struct Passes {
  int64_t M, passes, chunks, span;
  Passes(int64_t M_, int64_t K, int64_t split = kSplitChunks, int64_t most = kSpanChunks)
      : M(M_), passes((M_ + 2) / 3), chunks(K / 16), span(K / 16) {
    if (passes > 1 && chunks > split) {
      const int64_t spans = (chunks + most - 1) / most;
      span = ((chunks + spans - 1) / spans + 1) / 2 * 2;
    }
  }
  int64_t rows(int64_t t) const {
    return t == 0 ? std::min<int64_t>(3, M) : (M - 3) / (passes - 1) + (t - 1 < (M - 3) % (passes - 1) ? 1 : 0);
  }
  // Each tile's parked accumulators (8 per x row) between spans: the calling thread's own buffer.
  float* state() const {
    thread_local std::vector<float> buffer;
    if (span == chunks) return nullptr;
    if (static_cast<int64_t>(buffer.size()) < passes * 3 * 8 * 16) buffer.resize(passes * 3 * 8 * 16);
    return buffer.data();
  }
};

// Every tile over chunks [c0, c1) of one x8 group g. With `prefetch` the first tile streams the
// span from memory (so prefetches ahead) and the later ones fetch `next` (the bytes the next span's
// first tile will read) into L2 between them, each its share of next_bytes; without, g is in cache
// and every tile takes a share.
inline void span_tiles(const Passes& P, const uint16_t* x, int64_t ldx, const uint16_t* g, int64_t K, int64_t c0,
                       int64_t c1, float* state, const uint16_t* b, uint16_t* out, int64_t ldo, bool prefetch,
                       const char* next, int64_t next_bytes) {
  int64_t m = 0;
  const int64_t sharers = prefetch ? P.passes - 1 : P.passes;
  for (int64_t t = 0; t < P.passes; ++t) {
    const int64_t rows = P.rows(t);
    const char* pf = next;
    const char* pf_end = next;
    const int64_t share = prefetch ? t - 1 : t;
    if (share >= 0) {
      pf = next + next_bytes * share / sharers;
      pf_end = next + next_bytes * (share + 1) / sharers;
    }
    group_rows(x + m * ldx, ldx, g, K, c0, c1, state != nullptr ? state + t * 3 * 8 * 16 : nullptr, b, out + m * ldo,
               ldo, rows, prefetch && t == 0, pf, pf_end);
    m += rows;
  }
}

// ---- The packed layout (bf16z_layout.h) ----

// Row pair q of the packed step at p: wa = its x8 words of the step's first chunk, wb of its second.
// The codes' upper 256 bits are the same 32 bytes shifted right by 4 within each 16-bit word (a
// byte's high nibble to its low one; the and drops what the word's upper byte brought down).
inline void unpack_pair(const uint8_t* p, int q, __m512i table, __m512i& wa, __m512i& wb) {
  const __m512i lo = _mm512_loadu_si512(p + q * 64);
  const __m512i codes =
      _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + bf16z::kCodesAt + q * 32)));
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i idx = _mm512_and_si512(_mm512_srlv_epi16(codes, shift), _mm512_set1_epi8(0x0F));
  const __m512i hi = _mm512_shuffle_epi8(table, idx);
  wa = _mm512_unpacklo_epi8(lo, hi);
  wb = _mm512_unpackhi_epi8(lo, hi);
}

// vpshufb's tables: table q holds row 2q's 16 high bytes in 128-bit lanes 0 and 1, row 2q + 1's in 2 and 3.
inline void load_tables(const bf16z::Group& G, __m512i (&table)[4]) {
  for (int q = 0; q < 4; ++q) {
    const __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(G.tables + q * 32)));
    const __m256i hi =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(G.tables + q * 32 + 16)));
    table[q] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

// One or two x rows straight from the packed group, all of K: each step unpacked in registers and
// added as group_tile adds the x8 layout's (same accumulators, same order), so the same bits.
// Steps are 384 or 512 bytes, so the stream is prefetched by each step's own size.
template <int MB>
inline void packed_tile(const uint16_t* x, int64_t ldx, const bf16z::Group& G, int64_t K, const uint16_t* bias,
                        uint16_t* out, int64_t ldo, uint16_t* keep = nullptr) {
  __m512 acc[MB][4][2];
  start_acc<MB>(acc, 0, nullptr);
  __m512i table[4];
  load_tables(G, table);
  const uint8_t* p = G.steps;
  const int64_t c1 = K / 16;
  for (int64_t s = 0; s < c1 / 2; ++s) {
    const bool raw = G.is_raw(s);
    const int64_t bytes = G.step_bytes(s);
    for (int64_t l = 0; l < bytes; l += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes + l, _MM_HINT_T0);
    }
    __m512bh x0[MB], x1[MB];
    for (int m = 0; m < MB; ++m) {
      x0[m] = x_chunk(x + m * ldx + 2 * s * 16);
      x1[m] = x_chunk(x + m * ldx + (2 * s + 1) * 16);
    }
    for (int q = 0; q < 4; ++q) {
      __m512i wa, wb;
      if (raw) {  // rare: the x8 layout's two chunks
        wa = _mm512_loadu_si512(p + q * 64);
        wb = _mm512_loadu_si512(p + 256 + q * 64);
      } else {
        unpack_pair(p, q, table[q], wa, wb);
      }
      if (keep != nullptr) {  // the x8 copy later tiles read
        _mm512_storeu_si512(keep + (2 * s * kRows + 2 * q) * 16, wa);
        _mm512_storeu_si512(keep + ((2 * s + 1) * kRows + 2 * q) * 16, wb);
      }
      for (int m = 0; m < MB; ++m) {
        acc[m][q][0] = _mm512_dpbf16_ps(acc[m][q][0], x0[m], (__m512bh)wa);
        acc[m][q][1] = _mm512_dpbf16_ps(acc[m][q][1], x1[m], (__m512bh)wb);
      }
    }
    p += bytes;
  }
  if (c1 % 2) {
    odd_chunk<MB>(acc, x, ldx, reinterpret_cast<const uint16_t*>(p), c1 - 1);
    if (keep != nullptr) std::memcpy(keep + (c1 - 1) * kChunkValues, p, kChunkValues * 2);
  }
  finish_acc<MB>(acc, bias, out, ldo);
}

// A packed group into row layout (row r at dst + r * K).
inline void unpack_rows(const bf16z::Group& G, int64_t K, uint16_t* dst) {
  __m512i table[4];
  load_tables(G, table);
  const uint8_t* p = G.steps;
  const int64_t chunks = K / 16;
  auto put = [&](int64_t c, int q, __m512i w) {  // chunk c of rows 2q and 2q + 1
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * q * K + c * 16), _mm512_castsi512_si256(w));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (2 * q + 1) * K + c * 16), _mm512_extracti64x4_epi64(w, 1));
  };
  for (int64_t s = 0; s < chunks / 2; ++s) {
    const bool raw = G.is_raw(s);
    const int64_t bytes = G.step_bytes(s);
    for (int64_t l = 0; l < bytes; l += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes + l, _MM_HINT_T0);
    }
    for (int q = 0; q < 4; ++q) {
      __m512i wa, wb;
      if (raw) {
        wa = _mm512_loadu_si512(p + q * 64);
        wb = _mm512_loadu_si512(p + 256 + q * 64);
      } else {
        unpack_pair(p, q, table[q], wa, wb);
      }
      put(2 * s, q, wa);
      put(2 * s + 1, q, wb);
    }
    p += bytes;
  }
  if (chunks % 2) {
    for (int q = 0; q < 4; ++q) put(chunks - 1, q, _mm512_loadu_si512(p + q * 64));
  }
}

}  // namespace

void linear_bf16x8_avx512(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                          int64_t ldo, int64_t M, int64_t N, int64_t K) {
  const int64_t groups = N / kRows;
  const Passes P(M, K);
  const int64_t span_bytes = P.span * kChunkValues * 2;
  // Static schedule: each thread streams one contiguous run of groups (the first tile reads the
  // group from memory, the others from L1/L2). Threads from 64 K multiply-adds, as every linear kernel.
  // (team_for: on a decode step's crew, crew.h, the crew takes the shares.)
  team_for(groups, N * K * M >= 65536, [&](int64_t gi) {
    float* state = P.state();
    const uint16_t* g = w + gi * kRows * K;
    for (int64_t c0 = 0; c0 < P.chunks; c0 += P.span) {
      const int64_t c1 = std::min(P.chunks, c0 + P.span);
      // The next span's bytes (the group's next K span, or the next group: the thread's groups are
      // one contiguous stream), fetched into L2 over this span's tiles after the first. The first
      // tile of a span then reads L2, not memory: at 16 rows on the Zen 5 that took 0.57-0.62x the
      // time of torch's GEMM against 0.71-0.91x without (bench/RESULTS.md, session 26).
      span_tiles(P, x, ldx, g, K, c0, c1, state, bias != nullptr ? bias + gi * kRows : nullptr, out + gi * kRows, ldo,
                 true, reinterpret_cast<const char*>(g + c1 * kChunkValues), span_bytes);
    }
  });
  const int64_t done = groups * kRows;  // the last N % 8 rows, in row layout: the row kernel itself
  if (done < N) {
    linear_bf16_avx512(x, ldx, w + done * K, bias != nullptr ? bias + done : nullptr, out + done, ldo, M, N - done, K);
  }
}

namespace bf16z {

// Rows up to which the packed kernel reads the packed bytes straight, two x rows a pass (each pass
// after the first from L1 / L2). On the Zen 4 (2 cores), against the x8 kernel on the same matrix
// from memory, 2048-5632 x 2048-5632: 0.72-0.84x the time at one row, 0.61-0.70x at two, 0.75-0.84x
// at three and four; at six rows this way 0.87-1.04x and at eight 1.04-1.22x. More rows: the first
// pair's pass also stores the unpacked group as an x8 copy (in L1 / L2), and the x8 tiles take the
// other rows from it: 0.95-1.19x the x8 kernel's time from 8 to 64 rows, where unpacking in a pass
// of its own took 1.04-1.25x and spans of 32-128 chunks (parked accumulators) 1.0-1.9x
// (bench/RESULTS.md, session 46).
constexpr int64_t kPackedDirectRows = 4;

void linear_bf16z_avx512(const uint16_t* x, int64_t ldx, const uint8_t* packed, const uint16_t* bias, uint16_t* out,
                         int64_t ldo, int64_t M) {
  const Header& h = header(packed);
  const int64_t N = h.n, K = h.k, groups = h.groups;
  // The x8 tiles after the first pair (never split in K spans: a whole group of K = 5632, 88 KiB,
  // still sits in L2).
  const Passes P(M - 2, K, K, K);
  team_for(groups, N * K * M >= 65536, [&](int64_t gi) {
    const Group G(packed, gi, K);
    const uint16_t* b = bias != nullptr ? bias + gi * kRows : nullptr;
    if (M <= kPackedDirectRows) {  // straight from the packed bytes, x rows two at a time
      for (int64_t m = 0; m < M; m += 2) {
        if (M - m >= 2) {
          packed_tile<2>(x + m * ldx, ldx, G, K, b, out + m * ldo + gi * kRows, ldo);
        } else {
          packed_tile<1>(x + m * ldx, ldx, G, K, b, out + m * ldo + gi * kRows, ldo);
        }
      }
      return;
    }
    // More rows: the first pair's pass unpacks the group into this thread's x8 copy of it (in L1 /
    // L2), which the x8 tiles then read for the other rows as linear_bf16x8_avx512 reads a group,
    // fetching the next group's packed bytes into L2 meanwhile (else the next first pass waits on
    // memory).
    uint16_t* group = group_scratch(K);
    packed_tile<2>(x, ldx, G, K, b, out + gi * kRows, ldo, group);
    const bool last = gi + 1 == groups;
    const uint8_t* next = packed + (last ? h.total : group_at(packed)[gi + 1]);
    const int64_t next_bytes = last ? 0 : (G.steps - G.tables) + P.chunks / 2 * kPackedStepBytes;
    span_tiles(P, x + 2 * ldx, ldx, group, K, 0, P.chunks, nullptr, b, out + 2 * ldo + gi * kRows, ldo, false,
               reinterpret_cast<const char*>(next), next_bytes);
  });
  const int64_t done = groups * kRows;
  if (done < N) {
    linear_bf16_avx512(x, ldx, reinterpret_cast<const uint16_t*>(packed + h.tail_at), bias != nullptr ? bias + done : nullptr,
                       out + done, ldo, M, N - done, K);
  }
}

void unpack_bf16z_avx512(const uint8_t* packed, int64_t g0, int64_t g1, uint16_t* dst) {
  const int64_t K = header(packed).k;
  for (int64_t g = g0; g < g1; ++g) unpack_rows(Group(packed, g, K), K, dst + (g - g0) * kRows * K);
}

}  // namespace bf16z
}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
