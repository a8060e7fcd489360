// The bodies of the x8 interleaved kernels (Q8_0, Q4_0, Q4_1; layouts in quant_kernel.h and
// quant4_kernel.h), compiled twice: linear_x8_avx2.cpp (PAGEWIRE_X8_VNNI 0: maddubs pair sums in
// 16 bits, widened by madd) and linear_x8_vnni.cpp (PAGEWIRE_X8_VNNI 1: AVX-512 VNNI's 256-bit
// vpdpbusd, four u8 x s8 products per 32-bit lane in one instruction). The integer sums are the
// same either way (no 16-bit sum can saturate, see group4 and group8), so both builds give the
// same floats, bit for bit; the VNNI build spends about half the vector operations per block,
// which matters where the kernel is bound by the vector pipes (several activation rows) rather
// than by memory. The including file sets the target ISA around this header and defines the
// entry points; everything here is in an anonymous namespace (one copy per build).
//
// Each 32-bit lane carries one weight row, so a block needs no horizontal sum and no scale
// shuffle; see linear_x8_avx2.cpp for the scheme and its measurements.
#pragma once
#ifndef PAGEWIRE_X8_VNNI
#error "define PAGEWIRE_X8_VNNI (0 or 1) before including x8_body.h"
#endif

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_features.h"  // (the including file includes it first, before its target switch)
#include "quant4_kernel.h"
#include "quant_kernel.h"
#include "team_kernel.h"

namespace pagewire::cpu {
namespace {

// How far ahead of its loads a group prefetches, and into which cache level. The hardware
// prefetcher alone leaves 15-20 % of the DRAM bandwidth unused.
//  * AVX2 build (tuned on a Zen 3): about four Q8_0 or eight Q4_0 blocks of the group, into L1.
//  * VNNI build (tuned on an AMX Xeon, session 20): twice as far, into L2 (prefetcht1). A/B in
//    one process, decode steps alternating: Llama-1B Q4_0 28.3 ms against 32.8 with the AVX2
//    build's setting, SmolLM2 Q4_0 4.22 against 4.39 (bench/RESULTS.md).
//  * VNNI build on AMD (a Zen 5, session 25), single groups (NG = 1: one sequential stream through
//    consecutive groups): 9 KiB ahead. Batch-1 steps alternating in one process: Llama-1B Q4_0
//    9.05 against 10.97 ms, Q8_0 16.03 against 17.22, SmolLM2 Q4_0 2.34 against 2.60, Q8_0 2.77
//    against 3.14; 18 and 36 KiB gained nothing more. Pairs of groups (NG = 2): below.
#if PAGEWIRE_X8_VNNI
constexpr int64_t kPrefetchBytes = 2304;
constexpr int kPrefetchHint = _MM_HINT_T1;
inline int64_t stream_prefetch_bytes() { return is_amd() ? 9216 : kPrefetchBytes; }

// Pairs of groups (NG = 2) read two streams a group apart. On AMD (the Zen 5, session 26) each
// stream prefetches 9 KiB ahead too, and where that passes its group's end, the next pair's group
// at the same distance rather than the other stream's group (already being read): Q8_0 / Q4_0 at
// 8 rows took 0.58-0.72x / 0.27-0.42x the row layout's time against 0.86-1.08x / 0.35-0.62x with
// 2,304 bytes and no skip, whose 9 KiB landed in the other stream (session 25). Elsewhere 2,304
// (the Xeon's value, not re-measured).
inline int64_t pair_prefetch_bytes() { return is_amd() ? 9216 : kPrefetchBytes; }
inline bool pair_skips_other_stream() { return is_amd(); }
// Rows from which a unit takes a pair of groups. At 2 rows on AMD the single stream with its far
// prefetch won (Q8_0 x8 / row layout 0.81-0.92x against 0.99-1.07x as pairs, Q4_0 0.53-0.69x
// against 0.53-0.91x); at 3 rows pairs won (Q4_0 0.29-0.37x against 0.38-0.45x).
inline int64_t pair_min_rows() { return is_amd() ? 3 : 2; }
// Whether the 4-bit pairs take tiles of eight activation rows (group4_2<T, 8>: sixteen vpdpbusd
// chains in flight where a tile of four keeps eight, each weight byte unpacked once for eight rows)
// before tiles of four. On AMD (the Zen 5, session 27) from K = 1024: one process, the two
// alternating, a batch-8 step took 0.86-0.90x the time on Llama-1B Q4_0 / Q4_1 (0.97x at 16 rows)
// and 0.97x on SmolLM2 (only its K = 1536 down projection qualifies); at K = 576 the short
// blocks lost (SmolLM2's Q4 steps 1.05-1.12x with every matrix on eight-row tiles), and Q8_0's
// eight-row tile spills registers (1.2-1.5x slower: group8_2 keeps to four). Elsewhere not measured,
// so off. Which tile a row falls in changes no output (for_each_group).
inline bool eight_row_tiles(int64_t K) { return is_amd() && K >= 1024; }
#else
constexpr int64_t kPrefetchBytes = 1152;
constexpr int kPrefetchHint = _MM_HINT_T0;
inline int64_t stream_prefetch_bytes() { return kPrefetchBytes; }
inline int64_t pair_prefetch_bytes() { return kPrefetchBytes; }
inline bool pair_skips_other_stream() { return false; }
inline int64_t pair_min_rows() { return 2; }
#endif

// The distance for a pair's stream at byte `into` of its group: past the group's end, skip the
// other stream's group when `skip` (pair_skips_other_stream).
inline int64_t pair_ahead(int64_t into, int64_t group_bytes, int64_t ahead, bool skip) {
  return skip && into + ahead >= group_bytes ? ahead + group_bytes : ahead;
}

// Prefetches the Bytes bytes at p + ahead, one instruction per 64-byte line.
template <int Bytes>
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* p, int64_t ahead = kPrefetchBytes) {
  for (int off = 0; off < Bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + ahead + off), static_cast<_mm_hint>(kPrefetchHint));
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);  // a vpbroadcastd from memory: a load, no ALU operation
}

// An empty asm that claims to change v: the compiler must keep v in a register as it is here.
// Without it GCC reassociates a block's chain of 16-bit adds into a tree, schedules every
// maddubs of the block first, and spills their results to the stack (about 20 stores and reloads
// per block at MB = 4); pinning each accumulator after each chunk keeps the chain, and the
// integer sums (exact, no saturation) are the same whatever the order.
// (Emulated builds: the vector is a struct in memory, and there is no register to pin it to.)
#ifdef PAGEWIRE_X86_EMULATE
inline void pin(__m256i&) {}
#else
inline void pin(__m256i& v) { __asm__("" : "+x"(v)); }
#endif

// Activation rows [m0, m0 + MB) times NG consecutive groups of eight 4-bit weight rows (group j's
// bytes at w + j * group_bytes) -> out[m][0..8 * NG). Each broadcast activation chunk feeds the
// NG groups' maddubs: on Zen 3 vpbroadcastd from memory takes an FP pipe like the maddubs and adds,
// and those pipes are the limit once several rows share a group, so NG = 2 saves about a sixth of
// the vector operations (and the per-block activation scale broadcasts are shared too).
// xc: per (row, block) the offset term's activation factor (Q4_0: -8 * xs; Q4_1: xs).
// noinline: inlined into for_each_group's lambda, GCC versions and unrolls the block loop into
// several copies with spills; out of line each (MB, NG) gets one clean loop.
template <Q4Type T, int MB, int NG>
__attribute__((noinline)) void group4(const Q8SumActivations& x, const float* xc, int64_t m0, const uint8_t* w, int64_t group_bytes,
            const float* bias, float* out, int64_t ldo) {
  constexpr int kScaleBytes = T == Q4Type::kQ4_0 ? 16 : 32;  // d (and m) of the eight rows
  constexpr int kBlockBytes = kScaleBytes + 128;             // eight rows' block
  const int64_t nb = x.K / 32;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xq[MB];
  const float* xd[MB];
  const float* xo[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xo[m] = xc + (m0 + m) * nb;
  }
  const int64_t ahead = NG == 1 ? stream_prefetch_bytes() : pair_prefetch_bytes();
  const bool skip = NG == 2 && pair_skips_other_stream();
  __m256 acc[NG][MB];
  for (int j = 0; j < NG; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += kBlockBytes) {
    {
      const int64_t a = NG == 1 ? ahead : pair_ahead(b * kBlockBytes, group_bytes, ahead, skip);
      for (int j = 0; j < NG; ++j) prefetch_ahead<kBlockBytes>(w + j * group_bytes, a);
    }
    __m256i s16[NG][MB];
    for (int j = 0; j < NG; ++j)
      for (int m = 0; m < MB; ++m) s16[j][m] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i lo[NG], hi[NG];
      for (int j = 0; j < NG; ++j) {
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * group_bytes + kScaleBytes + 32 * c));
        lo[j] = _mm256_and_si256(v, mask);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      }
      for (int m = 0; m < MB; ++m) {
        const int8_t* xb = xq[m] + b * 32 + 4 * c;
        const __m256i x0 = broadcast4(xb), x1 = broadcast4(xb + 16);
        for (int j = 0; j < NG; ++j) {
#if PAGEWIRE_X8_VNNI
          // u8 codes x s8 activations, four products per lane straight into 32 bits.
          s16[j][m] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s16[j][m], lo[j], x0), hi[j], x1);
#else
          s16[j][m] = _mm256_add_epi16(
              s16[j][m], _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], x0), _mm256_maddubs_epi16(hi[j], x1)));
#endif
          pin(s16[j][m]);
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m256 xdm = _mm256_set1_ps(xd[m][b]), xom = _mm256_set1_ps(xo[m][b]);
      for (int j = 0; j < NG; ++j) {
        const uint8_t* wj = w + j * group_bytes;
        const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj)));
#if PAGEWIRE_X8_VNNI
        const __m256 dot = _mm256_cvtepi32_ps(s16[j][m]);  // already 32-bit sums
#else
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[j][m], ones));
#endif
        if constexpr (T == Q4Type::kQ4_0) {
          acc[j][m] = _mm256_fmadd_ps(wd, _mm256_fmadd_ps(dot, xdm, xom), acc[j][m]);
        } else {
          const __m256 wm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj + 16)));
          acc[j][m] = _mm256_fmadd_ps(wd, _mm256_mul_ps(dot, xdm), acc[j][m]);
          acc[j][m] = _mm256_fmadd_ps(wm, xom, acc[j][m]);
        }
      }
    }
  }
  for (int j = 0; j < NG; ++j) {
    const __m256 bv = bias != nullptr ? _mm256_loadu_ps(bias + 8 * j) : _mm256_setzero_ps();
    for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + (m0 + m) * ldo + 8 * j, _mm256_add_ps(acc[j][m], bv));
  }
}

#if PAGEWIRE_X8_VNNI
// Q8_0 on VNNI: vpdpbusd multiplies unsigned by signed bytes, and a Q8_0 weight is signed. The AVX2
// build makes |w| the unsigned side and gives x w's sign (vpsignb, one more operation per activation
// row and chunk; AVX-512 has no vpsignb at all). Here the weight's bytes become w + 128 (one xor
// per chunk, shared by every row) and each block's chain starts at -128 times the block's activation
// codes, so it ends at sum(w * x): the same integer as the AVX2 build's (no 16-bit step on either
// side that could saturate: at most 32 * 255 * 127 a lane), so the same floats, bit for bit.
// Per calling thread (each thread of a fused_linear team computes its own: M * K byte adds, about
// 0.3 us at eight rows of 576), per (row, 32-value block): -128 times the block's activation codes.
// Q8_0's chains here, and IQ4_NL's and IQ4_XS's (x8_q5nl_body.h, whose levels are made unsigned the
// same way), start there.
// (Span 16: per 16-value half instead, for the x16 layout's two chains a block.)
template <int Span = kQ8Block>
inline const int32_t* block_offsets(const int8_t* q, int64_t M, int64_t K) {
  thread_local std::vector<int32_t> offsets;
  const int64_t nb = K / Span;
  if (static_cast<int64_t>(offsets.size()) < M * nb) offsets.resize(M * nb);
  for (int64_t i = 0; i < M * nb; ++i) {
    const int8_t* b = q + i * Span;  // span i of the [M, K] codes (K is whole blocks)
    int32_t sum = 0;
    for (int k = 0; k < Span; ++k) sum += b[k];
    offsets[i] = -128 * sum;
  }
  return offsets.data();
}
#endif

// Activation rows [m0, m0 + MB) times NG consecutive groups of eight Q8_0 weight rows (group j's
// bytes at w + j * group_bytes) -> out[m][0..8 * NG); NG = 2 shares each broadcast as in group4.
template <int MB, int NG>
__attribute__((noinline)) void group8(const Q8Activations& x, [[maybe_unused]] const int32_t* xo, int64_t m0,
                                      const uint8_t* w, int64_t group_bytes, const float* bias, float* out,
                                      int64_t ldo) {
  constexpr int kBlockBytes = 16 + 8 * 32;  // eight rows' d, then eight chunks of codes
  const int64_t nb = x.K / kQ8Block;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xq[MB];
  const float* xd[MB];
  [[maybe_unused]] const int32_t* xoff[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
#if PAGEWIRE_X8_VNNI
    xoff[m] = xo + (m0 + m) * nb;
#endif
  }
  const int64_t ahead = NG == 1 ? stream_prefetch_bytes() : pair_prefetch_bytes();
  const bool skip = NG == 2 && pair_skips_other_stream();
  __m256 acc[NG][MB];
  for (int j = 0; j < NG; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm256_setzero_ps();
#if PAGEWIRE_X8_VNNI
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#endif
  for (int64_t b = 0; b < nb; ++b, w += kBlockBytes) {
    {
      const int64_t a = NG == 1 ? ahead : pair_ahead(b * kBlockBytes, group_bytes, ahead, skip);
      for (int j = 0; j < NG; ++j) prefetch_ahead<kBlockBytes>(w + j * group_bytes, a);
    }
    __m256i s32[NG][MB];
    for (int j = 0; j < NG; ++j) {
      for (int m = 0; m < MB; ++m) {
#if PAGEWIRE_X8_VNNI
        s32[j][m] = _mm256_set1_epi32(xoff[m][b]);  // -128 * the block's activation codes (block_offsets)
#else
        s32[j][m] = _mm256_setzero_si256();
#endif
      }
    }
    for (int c = 0; c < 8; ++c) {
      __m256i v[NG], aw[NG];
      for (int j = 0; j < NG; ++j) {
        v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * group_bytes + 16 + 32 * c));
#if PAGEWIRE_X8_VNNI
        aw[j] = _mm256_xor_si256(v[j], flip);  // w + 128 as u8
#else
        aw[j] = _mm256_abs_epi8(v[j]);
#endif
      }
      for (int m = 0; m < MB; ++m) {
        const __m256i xb = broadcast4(xq[m] + b * 32 + 4 * c);
        for (int j = 0; j < NG; ++j) {
#if PAGEWIRE_X8_VNNI
          // (w + 128) * x, the chain started at -128 * sum(x): sum(w * x) exactly (no 16-bit step).
          s32[j][m] = _mm256_dpbusd_epi32(s32[j][m], aw[j], xb);
#else
          // |w| * (x with w's sign): pairs at most 2 * 127 * 128, so the 16-bit sums never saturate.
          const __m256i p16 = _mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xb, v[j]));
          s32[j][m] = _mm256_add_epi32(s32[j][m], _mm256_madd_epi16(p16, ones));
#endif
          pin(s32[j][m]);
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m256 xdm = _mm256_set1_ps(xd[m][b]);
      for (int j = 0; j < NG; ++j) {
        const __m256 wd =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * group_bytes)));
        acc[j][m] = _mm256_fmadd_ps(wd, _mm256_mul_ps(_mm256_cvtepi32_ps(s32[j][m]), xdm), acc[j][m]);
      }
    }
  }
  for (int j = 0; j < NG; ++j) {
    const __m256 bv = bias != nullptr ? _mm256_loadu_ps(bias + 8 * j) : _mm256_setzero_ps();
    for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + (m0 + m) * ldo + 8 * j, _mm256_add_ps(acc[j][m], bv));
  }
}

#include "x8_q5nl_body.h"  // q5nl::group: Q5_0, Q5_1 and IQ4_NL; q5nl::group_xs: IQ4_XS

#if PAGEWIRE_X8_VNNI
#include "x8_pairs.h"  // group4_2, group8_2: a pair of groups per 512-bit vector
#endif

// Every whole group of eight weight rows (group_bytes each) against all M activation rows: units
// of NG consecutive groups (the last unit one group when the count is odd), and per unit row tiles
// of eight (pairs, EightRowTiles, where eight_row_tiles(K)), then of four, then one of the 1-3 rows
// left: tile(std::integral_constant<int, MB>, std::integral_constant<int,
// ng>, m0, unit's bytes, unit's bias or nullptr, unit's first output column). Static schedule: each
// thread streams one contiguous slice of the weight. Which tile or unit an output lands in changes
// only which loads it shares, never its instructions (batch invariance).
constexpr int64_t kGroupRows = 8;
static_assert(kQ4Interleave == kGroupRows && kQ8Interleave == kGroupRows, "one group size for both layouts");

template <int NG, bool EightRowTiles = false, class Tile>
void for_each_group(int64_t M, int64_t K, int64_t N, int64_t group_bytes, const uint8_t* w, const float* bias,
                    float* out, const Tile& tile) {
  const int64_t groups = N / kGroupRows;
  const int64_t units = (groups + NG - 1) / NG;
  const auto unit = [&](int64_t u) {
    const int64_t g = u * NG;
    const uint8_t* wg = w + g * group_bytes;
    const float* bg = bias != nullptr ? bias + g * kGroupRows : nullptr;
    float* og = out + g * kGroupRows;
    const auto rows = [&](auto ng) {
      int64_t m = 0;
#if PAGEWIRE_X8_VNNI
      if constexpr (decltype(ng)::value == 2 && EightRowTiles) {
        if (eight_row_tiles(K)) {
          for (; m + 8 <= M; m += 8) tile(std::integral_constant<int, 8>{}, ng, m, wg, bg, og);
        }
      }
#endif
      for (; m + 4 <= M; m += 4) tile(std::integral_constant<int, 4>{}, ng, m, wg, bg, og);
      // The 1-3 rows left in one tile: one more read of the unit's weights, not two.
      switch (M - m) {
        case 3:
          tile(std::integral_constant<int, 3>{}, ng, m, wg, bg, og);
          break;
        case 2:
          tile(std::integral_constant<int, 2>{}, ng, m, wg, bg, og);
          break;
        case 1:
          tile(std::integral_constant<int, 1>{}, ng, m, wg, bg, og);
          break;
        default:
          break;
      }
    };
    if (g + NG <= groups) {
      rows(std::integral_constant<int, NG>{});
    } else {
      rows(std::integral_constant<int, 1>{});
    }
  };
  team_for(units, N * K * M >= 65536, unit);  // team_kernel.h: a team's share, or a region
}

// x8_q5nl_body.h's units over every group: q5nl::kMaxGroups groups a unit where pairs pay (as run4
// below), else one.
template <class Tile>
void run_q5nl_units(const Q8SumActivations& x, int64_t N, int64_t group_bytes, const uint8_t* w, const float* bias,
                    float* out, const Tile& tile) {
  if (q5nl::kMaxGroups == 2 && x.M >= pair_min_rows() && N / kGroupRows >= 2 * team_threads()) {
    for_each_group<q5nl::kMaxGroups>(x.M, x.K, N, group_bytes, w, bias, out, tile);
  } else {
    for_each_group<1>(x.M, x.K, N, group_bytes, w, bias, out, tile);
  }
}

// Q5_0, Q5_1 and IQ4_NL (x8_q5nl_body.h group).
template <Q4Type T>
void run_q5nl(const Q8SumActivations& x, const float* xc, const uint8_t* w, const float* bias, float* out,
              int64_t ldo, int64_t N) {
  const int64_t group_bytes = kQ4Interleave * (x.K / 32) * q4_block_bytes(T);
  const int32_t* xo = nullptr;
#if PAGEWIRE_X8_VNNI
  if constexpr (T == Q4Type::kIQ4_NL) xo = block_offsets(x.q, x.M, x.K);
#endif
  run_q5nl_units(x, N, group_bytes, w, bias, out, [&](auto mb, auto ng, int64_t m, const uint8_t* wg, const float* bg,
                                                      float* og) {
    q5nl::group<T, decltype(mb)::value, decltype(ng)::value>(x, xc, xo, m, wg, group_bytes, bg, og, ldo);
  });
}

// IQ4_XS and the grid types held in its layout (group_xs), or the x16 layout's IQ2_XS, IQ2_S and
// IQ1_M (group_x16; VNNI chains from 16-value spans): type t, a super-block of eight rows at a time.
void run_iq4xs(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
               int64_t N) {
  const bool x16 = q_is_x16(t);
  const int64_t group_bytes = kQ4Interleave * (x.K / kQ4_KBlock) * q4_block_bytes(t);
  const int32_t* xo = nullptr;
#if PAGEWIRE_X8_VNNI
  xo = x16 ? block_offsets<16>(x.q, x.M, x.K) : block_offsets(x.q, x.M, x.K);
#endif
  run_q5nl_units(x, N, group_bytes, w, bias, out, [&](auto mb, auto ng, int64_t m, const uint8_t* wg, const float* bg,
                                                      float* og) {
    constexpr int MB = decltype(mb)::value, NG = decltype(ng)::value;
    if (x16) {
      q5nl::group_x16<MB, NG>(t, x, xo, m, wg, group_bytes, bg, og, ldo);
    } else {
      q5nl::group_xs<MB, NG>(t, x, xo, m, wg, group_bytes, bg, og, ldo);
    }
  });
}

template <Q4Type T>
void run4_groups(const Q8SumActivations& x, const float* xc, const uint8_t* w, int64_t group_bytes, const float* bias,
                 float* out, int64_t ldo, int64_t N) {
  const auto tile = [&](auto mb, auto ng, int64_t m, const uint8_t* wg, const float* bg, float* og) {
#if PAGEWIRE_X8_VNNI
    if constexpr (decltype(ng)::value == 2) {  // the pair in one 512-bit vector: the same floats
      x8pair::group4_2<T, decltype(mb)::value>(x, xc, m, wg, group_bytes, bg, og, ldo);
      return;
    }
#endif
    group4<T, decltype(mb)::value, decltype(ng)::value>(x, xc, m, wg, group_bytes, bg, og, ldo);
  };
  // (EightRowTiles: group4_2 from eight rows where eight_row_tiles; run8's group8_2 stays at four.)
  // Pairs of groups unless that would leave a thread without one (small N), or below
  // pair_min_rows (one row; two on AMD): there
  // the kernel streams the weight from memory, and one group per unit keeps each thread on one
  // sequential stream (pairs cost single-stream decode 13 %: 172 -> 150 tok/s on SmolLM2 Q4_1, two
  // threads). The results are the same either way, only the split of the work changes.
  if (x.M >= pair_min_rows() && N / kGroupRows >= 2 * team_threads()) {
    for_each_group<2, true>(x.M, x.K, N, group_bytes, w, bias, out, tile);
  } else {
    for_each_group<1>(x.M, x.K, N, group_bytes, w, bias, out, tile);
  }
}

template <Q4Type T>
void run4(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t N) {
  const int64_t nb = x.K / 32;
  const int64_t group_bytes = kQ4Interleave * nb * q4_block_bytes(T);
  const float* xc = x.s;
  if constexpr (T == Q4Type::kQ4_0 || T == Q4Type::kQ5_0) {
    // Per calling thread (the engine thread), reused across calls. Read through a plain pointer
    // inside the parallel loop: the worker threads have thread_locals of their own.
    thread_local std::vector<float> offset;
    if (static_cast<int64_t>(offset.size()) < x.M * nb) offset.resize(x.M * nb);
    const float zero = T == Q4Type::kQ4_0 ? -8.f : -16.f;
    for (int64_t i = 0; i < x.M * nb; ++i) offset[i] = zero * x.s[i];  // exact: a power of two
    xc = offset.data();
  }
  if constexpr (T == Q4Type::kQ5_0 || T == Q4Type::kQ5_1 || T == Q4Type::kIQ4_NL) {
    run_q5nl<T>(x, xc, w, bias, out, ldo, N);
  } else {
    run4_groups<T>(x, xc, w, group_bytes, bias, out, ldo, N);
  }
}

void run8(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t N) {
  const int64_t group_bytes = kQ8Interleave * (x.K / kQ8Block) * kQ8BlockBytes;
  const int32_t* xo = nullptr;
#if PAGEWIRE_X8_VNNI
  xo = block_offsets(x.q, x.M, x.K);
#endif
  const auto tile = [&](auto mb, auto ng, int64_t m, const uint8_t* wg, const float* bg, float* og) {
#if PAGEWIRE_X8_VNNI
    if constexpr (decltype(ng)::value == 2) {  // as run4
      x8pair::group8_2<decltype(mb)::value>(x, xo, m, wg, group_bytes, bg, og, ldo);
      return;
    }
#endif
    group8<decltype(mb)::value, decltype(ng)::value>(x, xo, m, wg, group_bytes, bg, og, ldo);
  };
  if (x.M >= pair_min_rows() && N / kGroupRows >= 2 * team_threads()) {  // as in run4
    for_each_group<2>(x.M, x.K, N, group_bytes, w, bias, out, tile);
  } else {
    for_each_group<1>(x.M, x.K, N, group_bytes, w, bias, out, tile);
  }
}

}  // namespace

}  // namespace pagewire::cpu
