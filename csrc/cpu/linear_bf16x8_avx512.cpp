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
#include <vector>

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

// The group's eight rows against MB rows of x over chunks [c0, c1) of K: per x row, an even-chunk
// and an odd-chunk accumulator for each of the four row pairs (MB = 3: 24 accumulators + 3 x vectors
// + 1 weight). A span that does not start at chunk 0 resumes the accumulators from state; one that
// does not end at the last chunk parks them there, so a split K adds in the same order as one pass.
// pf / pf_end: bytes to prefetch into L2 during this pass, spread over its iterations (the next
// span, so that the tile that streams it finds it in L2 instead of memory).
template <int MB>
inline void group_tile(const uint16_t* x, int64_t ldx, const uint16_t* g, int64_t K, int64_t c0, int64_t c1,
                       float* state, const uint16_t* bias, uint16_t* out, int64_t ldo, bool prefetch,
                       const char* pf, const char* pf_end) {
  __m512 acc[MB][4][2];
  const int64_t chunks = K / 16;
  if (c0 == 0) {
    for (auto& m : acc) {
      for (auto& q : m) q[0] = q[1] = _mm512_setzero_ps();
    }
  } else {
    for (int m = 0; m < MB; ++m) {
      for (int q = 0; q < 4; ++q) {
        for (int e = 0; e < 2; ++e) acc[m][q][e] = _mm512_loadu_ps(state + ((m * 4 + q) * 2 + e) * 16);
      }
    }
  }
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
  if (c < c1) {  // K % 32 == 16: the row kernel's last, masked step adds zero pairs to lanes 8-15
    const __m512bh zero = (__m512bh)_mm512_setzero_si512();
    const uint16_t* p = g + c * kChunkValues;
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = x_chunk(x + m * ldx + c * 16);
      for (int q = 0; q < 4; ++q) {
        acc[m][q][0] = _mm512_dpbf16_ps(acc[m][q][0], xv, w_pair(p + q * 32));
        acc[m][q][1] = _mm512_dpbf16_ps(acc[m][q][1], zero, zero);
      }
    }
  }
  if (c1 < chunks) {
    for (int m = 0; m < MB; ++m) {
      for (int q = 0; q < 4; ++q) {
        for (int e = 0; e < 2; ++e) _mm512_storeu_ps(state + ((m * 4 + q) * 2 + e) * 16, acc[m][q][e]);
      }
    }
    return;
  }
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

}  // namespace

void linear_bf16x8_avx512(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                          int64_t ldo, int64_t M, int64_t N, int64_t K) {
  const int64_t groups = N / kRows;
  // x rows in tiles of at most three: the first three (the pass that streams the group from memory
  // does the most work per byte), then the rest balanced: 4 -> 3 + 1, 8 -> 3 + 3 + 2.
  const int64_t passes = (M + 2) / 3;
  const int64_t chunks = K / 16;
  // K in spans when a group is over 32 KiB (K > 2048) and several tiles pass over it: equal spans of
  // at most 96 chunks (24 KiB of the group), even so that chunk parity picks the same accumulator.
  int64_t span = chunks;
  if (passes > 1 && chunks > kSplitChunks) {
    const int64_t spans = (chunks + kSpanChunks - 1) / kSpanChunks;
    span = ((chunks + spans - 1) / spans + 1) / 2 * 2;
  }
  const int64_t span_bytes = span * kChunkValues * 2;
  // Static schedule: each thread streams one contiguous run of groups (the first tile reads the
  // group from memory, the others from L1/L2). Threads from 64 K multiply-adds, as every linear kernel.
  // (team_for: on a decode step's crew, crew.h, the crew takes the shares.)
  team_for(groups, N * K * M >= 65536, [&](int64_t gi) {
    // Each tile's parked accumulators (8 per x row) between spans: the thread's own buffer.
    thread_local std::vector<float> state;
    if (span < chunks && static_cast<int64_t>(state.size()) < passes * 3 * 8 * 16) state.resize(passes * 3 * 8 * 16);
    const uint16_t* g = w + gi * kRows * K;
    const uint16_t* b = bias != nullptr ? bias + gi * kRows : nullptr;
    for (int64_t c0 = 0; c0 < chunks; c0 += span) {
      const int64_t c1 = std::min(chunks, c0 + span);
      // The next span's bytes (the group's next K span, or the next group: the thread's groups are
      // one contiguous stream), fetched into L2 over this span's tiles after the first. The first
      // tile of a span then reads L2, not memory: at 16 rows on the Zen 5 that took 0.57-0.62x the
      // time of torch's GEMM against 0.71-0.91x without (bench/RESULTS.md, session 26).
      const char* next = reinterpret_cast<const char*>(g + c1 * kChunkValues);
      int64_t m = 0;
      for (int64_t t = 0; t < passes; ++t) {
        const int64_t rows =
            t == 0 ? std::min<int64_t>(3, M) : (M - 3) / (passes - 1) + (t - 1 < (M - 3) % (passes - 1) ? 1 : 0);
        const char* pf = next;
        const char* pf_end = next;
        if (t > 0) {
          pf = next + span_bytes * (t - 1) / (passes - 1);
          pf_end = next + span_bytes * t / (passes - 1);
        }
        group_rows(x + m * ldx, ldx, g, K, c0, c1, span < chunks ? state.data() + t * 3 * 8 * 16 : nullptr, b, out + m * ldo + gi * kRows, ldo,
                   rows, t == 0, pf, pf_end);
        m += rows;
      }
    }
  });
  const int64_t done = groups * kRows;  // the last N % 8 rows, in row layout: the row kernel itself
  if (done < N) {
    linear_bf16_avx512(x, ldx, w + done * K, bias != nullptr ? bias + done : nullptr, out + done, ldo, M, N - done, K);
  }
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
