// The x8 kernels' 512-bit bodies for Q4_0, Q4_1 and Q8_0, VNNI build only (x8_body.h includes this
// file after the 256-bit bodies it mirrors): two adjacent groups of eight weight rows per vector,
// lanes 0-7 group g's rows and lanes 8-15 group g + 1's, for the tiles of several activation rows
// that for_each_group hands a pair of groups (NG = 2).
//
// Why: from two rows up these kernels are bound by how many vpdpbusd a core issues, and on the
// AMD EPYC Zen 5 measured (bench/RESULTS.md, session 25) a 512-bit vpdpbusd issues at the 256-bit
// one's rate, about 4.4 G/s a core with 24 chains in flight and 2.4-2.6 G/s with 8: the same
// instructions do twice the work. Each block's integer sum is also split over two chains (low and
// high nibbles; Q8_0: even and odd chunks), so a tile of four rows keeps eight chains in flight
// (four chains each gained nothing more); integer addition is exact, so the split changes no sum.
//
// Every lane then runs group4's / group8's floating-point steps in their order (int32 -> fp32, the
// scales' FMAs, the bias), so every output is the same float, bit for bit, as the 256-bit bodies
// and the AVX2 build (tests/kernels/test_interleaved.py natively, test_emulated_x8_vnni.py emulated).
#pragma once

#include "pair_lanes.h"

namespace x8pair {

using pairs::broadcast4x16;
using pairs::halves2;
using pairs::load2;

// group4<T, MB, 2>'s outputs for groups g (at w) and g + 1 (at w + group_bytes).
template <Q4Type T, int MB>
__attribute__((noinline)) void group4_2(const Q8SumActivations& x, const float* xc, int64_t m0, const uint8_t* w,
                                        int64_t group_bytes, const float* bias, float* out, int64_t ldo) {
  constexpr int kScaleBytes = T == Q4Type::kQ4_0 ? 16 : 32;
  constexpr int kBlockBytes = kScaleBytes + 128;
  const int64_t nb = x.K / 32;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const int8_t* xq[MB];
  const float* xd[MB];
  const float* xo[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xo[m] = xc + (m0 + m) * nb;
  }
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t ahead = pair_prefetch_bytes();  // (x8_body.h)
  const bool skip = pair_skips_other_stream();
  for (int64_t b = 0; b < nb; ++b, w += kBlockBytes) {
    const uint8_t* w1 = w + group_bytes;
    const int64_t a = pair_ahead(b * kBlockBytes, group_bytes, ahead, skip);
    prefetch_ahead<kBlockBytes>(w, a);
    prefetch_ahead<kBlockBytes>(w1, a);
    __m512i slo[MB], shi[MB];
    for (int m = 0; m < MB; ++m) slo[m] = shi[m] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i v = load2(w + kScaleBytes + 32 * c, w1 + kScaleBytes + 32 * c);
      const __m512i lo = _mm512_and_si512(v, mask);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xb = xq[m] + b * 32 + 4 * c;
        slo[m] = _mm512_dpbusd_epi32(slo[m], lo, broadcast4x16(xb));
        shi[m] = _mm512_dpbusd_epi32(shi[m], hi, broadcast4x16(xb + 16));
      }
    }
    const __m512 wd = halves2(w, w1);
    for (int m = 0; m < MB; ++m) {
      const __m512 xdm = _mm512_set1_ps(xd[m][b]), xom = _mm512_set1_ps(xo[m][b]);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(slo[m], shi[m]));
      if constexpr (T == Q4Type::kQ4_0) {
        acc[m] = _mm512_fmadd_ps(wd, _mm512_fmadd_ps(dot, xdm, xom), acc[m]);
      } else {
        const __m512 wm = halves2(w + 16, w1 + 16);
        acc[m] = _mm512_fmadd_ps(wd, _mm512_mul_ps(dot, xdm), acc[m]);
        acc[m] = _mm512_fmadd_ps(wm, xom, acc[m]);
      }
    }
  }
  const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + (m0 + m) * ldo, _mm512_add_ps(acc[m], bv));
}

// group8<MB, 2>'s outputs for groups g (at w) and g + 1 (at w + group_bytes): the weight's bytes as
// w + 128 and each block's chains started at xo's -128 * sum(x) (x8_body.h block_offsets), so one
// vpdpbusd per activation row and chunk gives sum(w * x), the 256-bit body's integer.
template <int MB>
__attribute__((noinline)) void group8_2(const Q8Activations& x, const int32_t* xo, int64_t m0, const uint8_t* w,
                                        int64_t group_bytes, const float* bias, float* out, int64_t ldo) {
  constexpr int kBlockBytes = 16 + 8 * 32;
  const int64_t nb = x.K / kQ8Block;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* xq[MB];
  const float* xd[MB];
  const int32_t* xoff[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xoff[m] = xo + (m0 + m) * nb;
  }
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t ahead = pair_prefetch_bytes();  // (x8_body.h)
  const bool skip = pair_skips_other_stream();
  for (int64_t b = 0; b < nb; ++b, w += kBlockBytes) {
    const uint8_t* w1 = w + group_bytes;
    const int64_t a = pair_ahead(b * kBlockBytes, group_bytes, ahead, skip);
    prefetch_ahead<kBlockBytes>(w, a);
    prefetch_ahead<kBlockBytes>(w1, a);
    __m512i s[2][MB];  // even and odd chunks; the even chain starts at the block's offset
    for (int m = 0; m < MB; ++m) {
      s[0][m] = _mm512_set1_epi32(xoff[m][b]);
      s[1][m] = _mm512_setzero_si512();
    }
    for (int c = 0; c < 8; ++c) {
      const __m512i u = _mm512_xor_si512(load2(w + 16 + 32 * c, w1 + 16 + 32 * c), flip);  // w + 128
      for (int m = 0; m < MB; ++m) {
        s[c & 1][m] = _mm512_dpbusd_epi32(s[c & 1][m], u, broadcast4x16(xq[m] + b * 32 + 4 * c));
      }
    }
    const __m512 wd = halves2(w, w1);
    for (int m = 0; m < MB; ++m) {
      const __m512 xdm = _mm512_set1_ps(xd[m][b]);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s[0][m], s[1][m]));
      acc[m] = _mm512_fmadd_ps(wd, _mm512_mul_ps(dot, xdm), acc[m]);
    }
  }
  const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + (m0 + m) * ldo, _mm512_add_ps(acc[m], bv));
}

}  // namespace x8pair
