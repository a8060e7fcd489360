// AVX512-BF16 micro-kernels for bf16 paged attention: QK^T and PV as _mm512_dpbf16_ps dot products
// over pairs, so K and V are used in their storage type (no fp32 widening) and each instruction does
// 32 multiply-adds instead of 16.
//
// Layouts (all in the per-thread Scratch buffers, which are sized for fp32 and so have room):
//   q   raw bf16 query rows, row r at (float*)q + r * D, unscaled (the scale is applied to scores)
//   kt  [D/2][kSpan] dwords: kt[dp][j] = (K[j][2dp], K[j][2dp+1]), a 32-bit transpose of the K rows
//   v   [n/2][D/16][32] bf16: for key pair jp and 16-wide d chunk, (V[2jp][d], V[2jp+1][d]) pairs
//   p   probabilities converted in place to bf16 pairs, dword jp of row r = (P[r][2jp], P[r][2jp+1])
//
// Include only inside the AVX-512 target region (see avx512_util.h).
#pragma once

#include "x86_target.h"  // <immintrin.h>, or nothing in emulated builds

#include <algorithm>
#include <cstdint>

#include "avx512_util.h"

namespace pagewire::cpu {
namespace {

inline const uint32_t* dwords(const void* p) { return static_cast<const uint32_t*>(p); }

// The next span's K and V lines are prefetched into L2 (prefetcht1, locality 2), not L1: a span's K
// and V at D = 64 are 16 KiB, so the next span's beside this one's and the scratch (kt, v: 16 KiB)
// overflowed a 32 KiB L1 and evicted what the loads and products were about to read. SmolLM2's heads
// (9 / 3 of 64) with K and V from DRAM (/tmp/s36/attn.py, bench/RESULTS.md session 36): 8 sequences
// x 400 positions 180-185 -> 130-146 us, one x 1000 64 -> 44-45, 16 x 300 262 -> 201-207; with K and V
// in cache, and at 8 x 96, level.

// kt[dp][j] for j < n (zero up to the next multiple of 16); D % 16 == 0, so D/2 is 8 mod 16 at worst.
// Each load of a K line is paired with a prefetch of the same line of the next span (pf_rows).
inline void load_k_bf16(const Bf16* const* k_rows, int n, int D, float* kt, const Bf16* const* pf_rows, int pf_n,
                        NextUnitPrefetch& next) {
  const int DP = D / 2;
  NextUnitPrefetch::Cursor at = next.cursor();
  for (int c = 0; c < n; c += 16) {
    for (int dp0 = 0; dp0 < DP; dp0 += 16) {
      const int w = std::min(16, DP - dp0);
      const __mmask16 mask = static_cast<__mmask16>((1u << w) - 1);
      __m512 x[16];
      for (int j = 0; j < 16; ++j) {
        x[j] = c + j < n ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(mask, dwords(k_rows[c + j]) + dp0))
                         : _mm512_setzero_ps();
        if (c + j < pf_n) __builtin_prefetch(dwords(pf_rows[c + j]) + dp0, 0, 2);
        if (c + j < n) at.step();  // one 64-byte line of K per load
      }
      transpose16(x);
      for (int i = 0; i < w; ++i) _mm512_store_ps(kt + (dp0 + i) * kSpan + c, x[i]);
    }
  }
  next.resume(at);
}

// v pairs for keys [0, n); a missing partner of an odd last key is zero (its probability is 0 too,
// but 0 * NaN from an unwritten slot would still poison the sum).
inline void load_v_bf16(const Bf16* const* v_rows, int n, int D, float* v, const Bf16* const* pf_rows, int pf_n,
                        NextUnitPrefetch& next) {
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo_idx = _mm512_load_si512(kLo), hi_idx = _mm512_load_si512(kHi);
  const int chunks = D / 16;
  NextUnitPrefetch::Cursor at = next.cursor();
  for (int jp = 0; jp < (n + 1) / 2; ++jp) {
    const Bf16* a_row = v_rows[2 * jp];
    const Bf16* b_row = 2 * jp + 1 < n ? v_rows[2 * jp + 1] : nullptr;
    float* dst = v + static_cast<int64_t>(jp) * chunks * 16;
    for (int d0 = 0; d0 < D; d0 += 32) {
      const int rem = std::min(32, D - d0);
      const __mmask32 mask = rem == 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << rem) - 1);
      const __m512i a = _mm512_maskz_loadu_epi16(mask, a_row + d0);
      const __m512i b = b_row != nullptr ? _mm512_maskz_loadu_epi16(mask, b_row + d0) : _mm512_setzero_si512();
      if (2 * jp < pf_n) __builtin_prefetch(pf_rows[2 * jp] + d0, 0, 2);
      if (2 * jp + 1 < pf_n) __builtin_prefetch(pf_rows[2 * jp + 1] + d0, 0, 2);
      at.step(), at.step();  // a 64-byte line of each of two V rows
      _mm512_store_si512(dst + (d0 / 16) * 16, _mm512_permutex2var_epi16(a, lo_idx, b));
      if (rem > 16) _mm512_store_si512(dst + (d0 / 16 + 1) * 16, _mm512_permutex2var_epi16(a, hi_idx, b));
    }
  }
  next.resume(at);
}

template <int RB, int NV>
inline void qk_rows_bf16(const float* q, int64_t D, const float* kt, float* s, float scale) {
  __m512 acc[RB][NV];
  const uint32_t* qr[RB];
  for (int r = 0; r < RB; ++r) {
    qr[r] = dwords(q + r * D);
    for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_setzero_ps();
  }
  for (int64_t dp = 0; dp < D / 2; ++dp) {
    __m512bh k[NV];
    for (int i = 0; i < NV; ++i) k[i] = (__m512bh)_mm512_load_si512(kt + dp * kSpan + 16 * i);
    for (int r = 0; r < RB; ++r) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[r][dp]));
      for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], qv, k[i]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < RB; ++r) {
    for (int i = 0; i < NV; ++i) _mm512_store_ps(s + r * kSpan + 16 * i, _mm512_mul_ps(acc[r][i], sc));
  }
}

template <int NV, int RB = 24 / NV>
inline void qk_all_bf16(const float* q, int rows, int64_t D, const float* kt, float* s, float scale) {
  if constexpr (RB > 0) {
    int r = 0;
    if (rows >= RB) {
      for (; r + RB <= rows; r += RB) qk_rows_bf16<RB, NV>(q + r * D, D, kt, s + r * kSpan, scale);
      if (r < rows) qk_all_bf16<NV, RB - 1>(q + r * D, rows - r, D, kt, s + r * kSpan, scale);
    } else {
      qk_all_bf16<NV, RB - 1>(q, rows, D, kt, s, scale);
    }
  }
}

// acc[r][16(c0+i)..] = alpha[r] * acc + sum_jp P2[r][jp] . V2[jp][c0+i] for RB rows, NV d chunks.
template <int RB, int NV>
inline void pv_block_bf16(const float* p, const float* alpha, int64_t D, const float* v, int np, int c0,
                          float* acc) {
  const int chunks = static_cast<int>(D / 16);
  __m512 a[RB][NV];
  for (int r = 0; r < RB; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int i = 0; i < NV; ++i) a[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * (c0 + i)), al);
  }
  for (int jp = 0; jp < np; ++jp) {
    __m512bh vv[NV];
    for (int i = 0; i < NV; ++i) {
      vv[i] = (__m512bh)_mm512_load_si512(v + (static_cast<int64_t>(jp) * chunks + c0 + i) * 16);
    }
    for (int r = 0; r < RB; ++r) {
      const __m512bh pj = (__m512bh)_mm512_set1_epi32(static_cast<int>(dwords(p + r * kSpan)[jp]));
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_dpbf16_ps(a[r][i], pj, vv[i]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + r * D + 16 * (c0 + i), a[r][i]);
  }
}

template <int RB>
inline void pv_rows_bf16(const float* p, const float* alpha, int64_t D, const float* v, int np, float* acc) {
  const int chunks = static_cast<int>(D / 16);
  int c0 = 0;
  for (; c0 + 4 <= chunks; c0 += 4) pv_block_bf16<RB, 4>(p, alpha, D, v, np, c0, acc);
  switch (chunks - c0) {
    case 3:
      pv_block_bf16<RB, 3>(p, alpha, D, v, np, c0, acc);
      break;
    case 2:
      pv_block_bf16<RB, 2>(p, alpha, D, v, np, c0, acc);
      break;
    case 1:
      pv_block_bf16<RB, 1>(p, alpha, D, v, np, c0, acc);
      break;
    default:
      break;
  }
}

template <int RB = 6>
inline void pv_all_bf16(const float* p, const float* alpha, int rows, int64_t D, const float* v, int np,
                        float* acc) {
  if constexpr (RB > 0) {
    int r = 0;
    if (rows >= RB) {
      for (; r + RB <= rows; r += RB) pv_rows_bf16<RB>(p + r * kSpan, alpha + r, D, v, np, acc + r * D);
      if (r < rows) pv_all_bf16<RB - 1>(p + r * kSpan, alpha + r, rows - r, D, v, np, acc + r * D);
    } else {
      pv_all_bf16<RB - 1>(p, alpha, rows, D, v, np, acc);
    }
  }
}

// Rewrites each fp32 probability row's first 2 * np entries as bf16 pairs, in place: chunk c is
// read before its 32 bytes are written, and those bytes lie below every later chunk's input.
inline void probabilities_to_bf16(float* p, int rows, int np) {
  for (int r = 0; r < rows; ++r) {
    float* row = p + r * kSpan;
    for (int c = 0; c < 2 * np; c += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_load_ps(row + c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(row) + c), (__m256i)h);
    }
  }
}

}  // namespace
}  // namespace pagewire::cpu
