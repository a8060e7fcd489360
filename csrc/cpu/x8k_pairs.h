// The K-quant x8 kernels' 512-bit bodies, VNNI build only (x8k_body.h includes this file inside its
// namespaces' reach, after the 256-bit bodies it mirrors): two adjacent groups of eight weight rows
// per vector, for several activation rows, where these kernels are bound by compute. Every lane runs
// its 256-bit body's instructions in the same order, so the floats are the same bit for bit
// (RESULTS, session 24).
#pragma once

#include "pair_lanes.h"

namespace q4k {

// Two adjacent groups (16 weight rows) at once, for several activation rows (VNNI build only):
// lanes 0-7 of each 512-bit vector hold group g's rows, lanes 8-15 group g + 1's. Every lane runs
// group_k's instructions in group_k's order (vpdpbusd, vpmulld, int32 -> fp32, the FMAs), only
// twice as wide, so every output is the same float bit for bit, with half the instructions per
// activation row: at several rows these kernels are bound by compute, not memory (RESULTS,
// session 24). `gb` is the byte stride from one group to the next.
using pairs::broadcast4x16;
using pairs::halves2;
using pairs::load2;
// A pshufb control of lane_bytes' kind for 512 bits (pshufb works within each 128-bit lane).
inline __m512i wide(__m256i control) { return _mm512_broadcast_i64x4(control); }

template <int MB>
void group_k2(const Q8SumActivations& x, int64_t m0, const uint8_t* w, int64_t gb, const float* bias, float* out,
              int64_t ldo) {
  const int64_t nb = x.K / 32, nsb = x.K / kQ4_KBlock;
  const __m512i mask = _mm512_set1_epi8(0x0F), six = _mm512_set1_epi8(0x3F), top = _mm512_set1_epi8(0x30);
  const int8_t* xq[MB];
  const float* xd[MB];
  const float* xs[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xs[m] = x.s + (m0 + m) * nb;
  }
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const bool far = far_pairs();
  for (int64_t s = 0; s < nsb; ++s, w += kGroupBytes) {
    const uint8_t* w1 = w + gb;
    prefetch_pair<8, _MM_HINT_T1, prefetch_q4k>(w, kGroupBytes, s, nsb, gb, far);
    const __m512i a = load2(w + 32, w1 + 32), b = load2(w + 64, w1 + 64), c = load2(w + 96, w1 + 96);
    const __m512i sc_lo = _mm512_and_si512(a, six);
    const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(c, mask), _mm512_and_si512(_mm512_srli_epi32(a, 2), top));
    const __m512i mn_lo = _mm512_and_si512(b, six);
    const __m512i mn_hi =
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(c, 4), mask), _mm512_and_si512(_mm512_srli_epi32(b, 2), top));
    __m512 sa[MB];
    for (int m = 0; m < MB; ++m) sa[m] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int cc = 0; cc < 4; ++cc) {
      __m512i lo32[MB], hi32[MB];
      for (int m = 0; m < MB; ++m) lo32[m] = hi32[m] = _mm512_setzero_si512();
      const uint8_t* wc0 = w + kCodes + 32 * 8 * cc;
      const uint8_t* wc1 = w1 + kCodes + 32 * 8 * cc;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i v = load2(wc0 + 32 * j, wc1 + 32 * j);
        const __m512i lo = _mm512_and_si512(v, mask);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        for (int m = 0; m < MB; ++m) {
          const int8_t* xb = xq[m] + (s * 8 + 2 * cc) * 32 + 4 * j;
          lo32[m] = _mm512_dpbusd_epi32(lo32[m], lo, broadcast4x16(xb));
          hi32[m] = _mm512_dpbusd_epi32(hi32[m], hi, broadcast4x16(xb + 32));
        }
      }
      const __m512i src = cc < 2 ? sc_lo : sc_hi;
      const __m512i sc0 = _mm512_shuffle_epi8(src, wide(word_of_byte((2 * cc) % 4)));
      const __m512i sc1 = _mm512_shuffle_epi8(src, wide(word_of_byte((2 * cc + 1) % 4)));
      for (int m = 0; m < MB; ++m) {
        const int64_t blk = s * 8 + 2 * cc;
        sa[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(lo32[m], sc0)), _mm512_set1_ps(xd[m][blk]), sa[m]);
        sa[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(hi32[m], sc1)), _mm512_set1_ps(xd[m][blk + 1]),
                                sa[m]);
      }
    }
    __m512 ma[MB];
    for (int m = 0; m < MB; ++m) ma[m] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512 mn = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(j < 4 ? mn_lo : mn_hi, wide(word_of_byte(j % 4))));
      for (int m = 0; m < MB; ++m) ma[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[m][s * 8 + j]), ma[m]);
    }
    const __m512 d = halves2(w, w1), dmin = halves2(w + 16, w1 + 16);
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm512_fmadd_ps(d, sa[m], acc[m]);
      acc[m] = _mm512_fnmadd_ps(dmin, ma[m], acc[m]);
    }
  }
  const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + (m0 + m) * ldo, _mm512_add_ps(acc[m], bv));
}

}  // namespace q4k

namespace q6k {

// Two adjacent groups per 512-bit vector, as q4k::group_k2 (lanes 8-15 group g + 1's rows): every
// lane runs group_q6's VNNI instructions in its order, so the same floats bit for bit.
template <int MB>
void group_q62(const Q8SumActivations& x, const int32_t* x16, int64_t m0, const uint8_t* w, int64_t gb,
               const float* bias, float* out, int64_t ldo) {
  const int64_t nb = x.K / 32, nsb = x.K / kQ4_KBlock, n16 = x.K / 16;
  const __m512i mask = _mm512_set1_epi8(0x0F), lowbits = _mm512_set1_epi8(0x33), highbits = _mm512_set1_epi8(-0x34);
  const int8_t* xq[MB];
  const float* xd[MB];
  const int32_t* xs[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xs[m] = x16 + (m0 + m) * n16;
  }
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  // On a Zen 4 both streams six super-blocks ahead into L2, as group_q6's single stream
  // (far_q6_into_l2): a Llama-1B Q4_K_M batch-8 step took 38.3-42.9 ms against 43.9-47.5 with four
  // into L1 (bench/RESULTS.md, session 31).
  const bool far = far_pairs(), l2 = far_q6_into_l2();
  for (int64_t s = 0; s < nsb; ++s, w += kGroupBytes) {
    const uint8_t* w1 = w + gb;
    if (l2) {
      prefetch_pair<6, _MM_HINT_T1, prefetch_next>(w, kGroupBytes, s, nsb, gb, true);
    } else {
      prefetch_pair<4, _MM_HINT_T0, prefetch_next>(w, kGroupBytes, s, nsb, gb, far);
    }
    __m512 sa[MB];
    for (int m = 0; m < MB; ++m) sa[m] = _mm512_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      for (int t = 0; t < 4; ++t) {
        const int j = 4 * h + t;
        __m512i i32[MB];
        for (int m = 0; m < MB; ++m) i32[m] = _mm512_setzero_si512();
        for (int hh = 0; hh < 2; ++hh) {
          const int idx = 2 * j + hh;
          const int so = kScales + 32 * (idx / 4);
          const __m512i sc32 =
              _mm512_srai_epi32(_mm512_shuffle_epi8(q4k::load2(w + so, w1 + so), q4k::wide(top_byte(idx % 4))), 24);
          __m512i p32[MB];
          for (int m = 0; m < MB; ++m) p32[m] = _mm512_set1_epi32(xs[m][s * 16 + idx]);  // the offset (group_q6)
          for (int c = 4 * hh; c < 4 * hh + 4; ++c) {  // group_q6's (pair, u) in order
            const int lo_at = kQl + 32 * (16 * h + 8 * (t % 2) + c), hi_at = kQh + 32 * (8 * h + c);
            const __m512i ql = q4k::load2(w + lo_at, w1 + lo_at);
            const __m512i qh = q4k::load2(w + hi_at, w1 + hi_at);
            // q6_codes' select: field t of qh at bits 4-5 with zeros above, ql's nibble below.
            const __m512i fields = _mm512_and_si512(qh, t % 2 == 0 ? lowbits : highbits);
            const __m512i hi = t == 0   ? _mm512_slli_epi16(fields, 4)
                               : t == 1 ? _mm512_slli_epi16(fields, 2)
                               : t == 2 ? fields
                                        : _mm512_srli_epi16(fields, 2);
            const __m512i nib = t < 2 ? ql : _mm512_srli_epi16(ql, 4);
            const __m512i codes = _mm512_ternarylogic_epi32(mask, nib, hi, 0xCA);
            for (int m = 0; m < MB; ++m) {
              p32[m] = _mm512_dpbusd_epi32(p32[m], codes, q4k::broadcast4x16(xq[m] + j * 32 + s * 256 + 4 * c));
            }
          }
          for (int m = 0; m < MB; ++m) i32[m] = _mm512_add_epi32(i32[m], _mm512_mullo_epi32(p32[m], sc32));
        }
        for (int m = 0; m < MB; ++m) {
          sa[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32[m]), _mm512_set1_ps(xd[m][s * 8 + j]), sa[m]);
        }
      }
    }
    const __m512 d = q4k::halves2(w, w1);
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(d, sa[m], acc[m]);
  }
  const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + (m0 + m) * ldo, _mm512_add_ps(acc[m], bv));
}

}  // namespace q6k
