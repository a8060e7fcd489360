// The x8 group kernels of Q5_0, Q5_1 and IQ4_NL (group) and of IQ4_XS and the grid types held in its
// layout (group_xs; layouts in quant4_kernel.h), part of x8_body.h and
// compiled with it twice: the AVX2 build (PAGEWIRE_X8_VNNI 0, maddubs) and the AVX-512 VNNI one
// (256-bit vpdpbusd). Included inside x8_body.h's anonymous namespace, after its helpers.
//
// The three keep their own bytes (22, 24 and 18 per 32 values), where they used to be rewritten at
// load into Q8_0's 34 (Q5_0, IQ4_NL) or dequantised to bf16's 64 (Q5_1): a single stream reads
// 1.4-2.7x fewer bytes. Per 32-byte chunk of codes (eight values of each of the eight rows):
//  * Q5: the nibbles as Q4_0's, each ORed with its fifth bit, which the layout's rearranged qh word
//    gives in two shifts and a mask per half (shared by every activation row); codes 0..31, so the
//    unsigned x signed products are those of Q4 with one more bit. AVX2: a chunk's two maddubs
//    (pairs at most 2 * 31 * 127, their sum 15,748) are widened by one madd per chunk, as a block's
//    four chunks could pass 32,767 in 16 bits. The offset term is Q4_0's with 16 (Q5_0: -16 d xs)
//    or Q4_1's (Q5_1: m xs).
//  * IQ4_NL: one byte shuffle turns a nibble into its signed level. AVX2 takes Q8_0's route (|w|
//    times x with w's sign moved onto it, each maddubs widened alone: a pair can reach
//    2 * 127 * 127); VNNI looks up level + 128 (unsigned) and starts each block's chain at -128
//    times the block's activation codes, as Q8_0's VNNI build does. Either way the block's integer
//    is sum(level * x), and the epilogue is Q8_0's (acc += d * (dot * xd)): the same floats as the
//    Q8_0 blocks the loader used to transcode IQ4_NL into.
// Every integer sum is exact in both builds, so they give the same floats, bit for bit.
//
// On AVX2 (16 vector registers) a unit is one group (NG = 1): a second group's codes and fifth
// bits (or IQ4_NL's levels and their magnitudes) and sums would not fit beside four activation
// rows. The VNNI build has 32 and takes pairs, as group4 does.
#pragma once

namespace q5nl {

template <Q4Type T>
constexpr bool kNonLinear = T == Q4Type::kIQ4_NL;
template <Q4Type T>
constexpr int kScaleBytes = T == Q4Type::kQ5_1 ? 32 : 16;  // d (and m) of the eight rows
template <Q4Type T>
constexpr int kHighBytes = kNonLinear<T> ? 0 : 32;  // the rearranged fifth bits
template <Q4Type T>
constexpr int kBlockBytes = kScaleBytes<T> + kHighBytes<T> + 128;  // eight rows' block

// Groups per unit from two activation rows up (pair_min_rows): see the header comment.
constexpr int kMaxGroups = PAGEWIRE_X8_VNNI ? 2 : 1;

// Activation rows [m0, m0 + MB) times NG consecutive groups of eight weight rows -> out[m][0..8 NG).
// xc: per (row, block) the offset term's activation factor (Q5_0: -16 xs; Q5_1: xs; unused for
// IQ4_NL); xo: IQ4_NL's block_offsets (VNNI build, x8_body.h).
template <Q4Type T, int MB, int NG>
__attribute__((noinline)) void group(const Q8SumActivations& x, const float* xc, [[maybe_unused]] const int32_t* xo,
                                     int64_t m0, const uint8_t* w, int64_t group_bytes, const float* bias, float* out,
                                     int64_t ldo) {
  constexpr bool nl = kNonLinear<T>;
  constexpr int codes_at = kScaleBytes<T> + kHighBytes<T>;
  const int64_t nb = x.K / 32;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  [[maybe_unused]] const __m256i five = _mm256_set1_epi8(0x10);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  // IQ4_NL's levels by nibble: signed for AVX2's sign route, + 128 (unsigned) for vpdpbusd.
  [[maybe_unused]] const __m256i lut = _mm256_broadcastsi128_si256(
#if PAGEWIRE_X8_VNNI
      _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, static_cast<char>(129), static_cast<char>(141),
                    static_cast<char>(153), static_cast<char>(166), static_cast<char>(181), static_cast<char>(197),
                    static_cast<char>(217), static_cast<char>(241))
#else
      _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
#endif
  );
  const int8_t* xq[MB];
  const float* xd[MB];
  const float* xom[MB];
  [[maybe_unused]] const int32_t* xoff[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xom[m] = xc + (m0 + m) * nb;
    xoff[m] = xo != nullptr ? xo + (m0 + m) * nb : nullptr;
  }
  const int64_t ahead = NG == 1 ? stream_prefetch_bytes() : pair_prefetch_bytes();
  const bool skip = NG == 2 && pair_skips_other_stream();
  __m256 acc[NG][MB];
  for (int j = 0; j < NG; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += kBlockBytes<T>) {
    {
      const int64_t a = NG == 1 ? ahead : pair_ahead(b * kBlockBytes<T>, group_bytes, ahead, skip);
      for (int j = 0; j < NG; ++j) prefetch_ahead<kBlockBytes<T>>(w + j * group_bytes, a);
    }
    __m256i s32[NG][MB];
    for (int j = 0; j < NG; ++j) {
      for (int m = 0; m < MB; ++m) {
#if PAGEWIRE_X8_VNNI
        s32[j][m] = nl ? _mm256_set1_epi32(xoff[m][b]) : _mm256_setzero_si256();
#else
        s32[j][m] = _mm256_setzero_si256();
#endif
      }
    }
    for (int c = 0; c < 4; ++c) {
      __m256i lo[NG], hi[NG];
      [[maybe_unused]] __m256i alo[NG], ahi[NG];
      for (int j = 0; j < NG; ++j) {
        const uint8_t* wj = w + j * group_bytes;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + codes_at + 32 * c));
        lo[j] = _mm256_and_si256(v, mask);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        if constexpr (nl) {
          lo[j] = _mm256_shuffle_epi8(lut, lo[j]);
          hi[j] = _mm256_shuffle_epi8(lut, hi[j]);
#if !PAGEWIRE_X8_VNNI
          alo[j] = _mm256_abs_epi8(lo[j]);
          ahi[j] = _mm256_abs_epi8(hi[j]);
#endif
        } else {
          // Byte i of a row's qh word holds at bit c the fifth bit of value 4c + i and at bit 4 + c
          // that of value 16 + 4c + i: shifted to bit 4 (16-bit shifts; the mask drops what
          // crossed from the neighbouring byte).
          const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + kScaleBytes<T>));
          lo[j] = _mm256_or_si256(lo[j], _mm256_and_si256(_mm256_slli_epi16(qh, 4 - c), five));
          hi[j] = _mm256_or_si256(hi[j], _mm256_and_si256(_mm256_srli_epi16(qh, c), five));
        }
      }
      for (int m = 0; m < MB; ++m) {
        const int8_t* xb = xq[m] + b * 32 + 4 * c;
        const __m256i x0 = broadcast4(xb), x1 = broadcast4(xb + 16);
        for (int j = 0; j < NG; ++j) {
#if PAGEWIRE_X8_VNNI
          s32[j][m] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s32[j][m], lo[j], x0), hi[j], x1);
#else
          if constexpr (nl) {
            const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(alo[j], _mm256_sign_epi8(x0, lo[j])), ones);
            const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(ahi[j], _mm256_sign_epi8(x1, hi[j])), ones);
            s32[j][m] = _mm256_add_epi32(s32[j][m], _mm256_add_epi32(p0, p1));
          } else {
            const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], x0), _mm256_maddubs_epi16(hi[j], x1));
            s32[j][m] = _mm256_add_epi32(s32[j][m], _mm256_madd_epi16(p16, ones));
          }
#endif
          pin(s32[j][m]);
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m256 xdm = _mm256_set1_ps(xd[m][b]);
      for (int j = 0; j < NG; ++j) {
        const uint8_t* wj = w + j * group_bytes;
        const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj)));
        const __m256 dot = _mm256_cvtepi32_ps(s32[j][m]);
        if constexpr (T == Q4Type::kQ5_0) {
          acc[j][m] = _mm256_fmadd_ps(wd, _mm256_fmadd_ps(dot, xdm, _mm256_set1_ps(xom[m][b])), acc[j][m]);
        } else if constexpr (T == Q4Type::kQ5_1) {
          const __m256 wm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj + 16)));
          acc[j][m] = _mm256_fmadd_ps(wd, _mm256_mul_ps(dot, xdm), acc[j][m]);
          acc[j][m] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xom[m][b]), acc[j][m]);
        } else {
          acc[j][m] = _mm256_fmadd_ps(wd, _mm256_mul_ps(dot, xdm), acc[j][m]);
        }
      }
    }
  }
  for (int j = 0; j < NG; ++j) {
    const __m256 bv = bias != nullptr ? _mm256_loadu_ps(bias + 8 * j) : _mm256_setzero_ps();
    for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + (m0 + m) * ldo + 8 * j, _mm256_add_ps(acc[j][m], bv));
  }
}

// IQ4_XS (x8 layout in quant4_kernel.h): IQ4_NL's route per 32-value sub-block, with the sub-block's
// 6-bit scale (less 32) applied to its integer sum. The AVX2 build's widening madd multiplies by
// the scale instead of by ones (the scale in both 16-bit halves of the row's lane); the VNNI
// build's chain is multiplied once by vpmulld. |scale * sum| <= 32 * 32 * 127 * 127 < 2^24, so the
// integers are exact, equal in both builds, and exact as fp32; then acc += (d * xd) * that, per
// sub-block. The scales are decoded for the eight rows at once from the layout's scales_l words and
// scales_h halves: a shift, two masks, an or and a subtraction per sub-block, shared by every
// activation row.
constexpr int kXsGroupBytes = kQ4Interleave * kIq4xsBlockBytes;  // one super-block of eight rows
constexpr int kXsCodes = 64;                                       // where a super-block's codes start

// pshufb control: in each row's 32-bit lane, the lane's bytes k and k + 1 twice (a 16-bit field of
// the lane in both halves); `stride` 2 reads a 16-byte vector of 16-bit fields instead (row r's at
// 2r, the same 16 bytes broadcast to both 128-bit halves).
inline __m256i dup16(int k, int stride) {
  alignas(32) int8_t c[32];
  for (int r = 0; r < 8; ++r) {  // (pshufb indexes within each 128-bit half: rows 4-7 in the upper)
    const int at = stride == 4 ? 4 * (r % 4) + k : 2 * r + k;
    c[4 * r] = c[4 * r + 2] = static_cast<int8_t>(at);
    c[4 * r + 1] = c[4 * r + 3] = static_cast<int8_t>(at + 1);
  }
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(c));
}

// Bits b and b + 1 of each 16-bit (AVX2) or 32-bit (VNNI) field moved to bits 4 and 5 (the caller
// masks). b is a constant once the sub-block loop is unrolled.
inline __m256i bits_to_4(__m256i v, int b) {
#if PAGEWIRE_X8_VNNI
  return b < 4 ? _mm256_slli_epi32(v, 4 - b) : b > 4 ? _mm256_srli_epi32(v, b - 4) : v;
#else
  return b < 4 ? _mm256_slli_epi16(v, 4 - b) : b > 4 ? _mm256_srli_epi16(v, b - 4) : v;
#endif
}

// Activation rows [m0, m0 + MB) times NG consecutive groups of eight IQ4_XS-layout weight rows ->
// out[m][0..8 NG), of type t (IQ4_XS or a grid type held in its layout: the type's sixteen levels
// and its power-of-two level scale f, which multiplies each super-block's eight d -- exactly -- and
// so every product after). xo: block_offsets (VNNI build, x8_body.h).
template <int MB, int NG>
__attribute__((noinline)) void group_xs(Q4Type t, const Q8SumActivations& x, [[maybe_unused]] const int32_t* xo,
                                        int64_t m0, const uint8_t* w, int64_t group_bytes, const float* bias,
                                        float* out, int64_t ldo) {
  const int64_t nb = x.K / 32, nsb = x.K / kQ4_KBlock;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m128i levels = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q_levels(t)));
  const __m256 f = _mm256_set1_ps(q_level_scale(t));
#if PAGEWIRE_X8_VNNI
  // level + 128 (unsigned), by code
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_xor_si128(levels, _mm_set1_epi8(static_cast<char>(0x80))));
  const __m256i low4 = _mm256_set1_epi32(0x0F), top2 = _mm256_set1_epi32(0x30), bias32 = _mm256_set1_epi32(32);
#else
  const __m256i lut = _mm256_broadcastsi128_si256(levels);
  const __m256i low4 = _mm256_set1_epi16(0x0F), top2 = _mm256_set1_epi16(0x30), bias32 = _mm256_set1_epi16(32);
  const __m256i ctl_lo = dup16(0, 4), ctl_hi = dup16(2, 4), ctl_h = dup16(0, 2);
#endif
  const int8_t* xq[MB];
  const float* xd[MB];
  [[maybe_unused]] const int32_t* xoff[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xoff[m] = xo != nullptr ? xo + (m0 + m) * nb : nullptr;
  }
  const int64_t ahead = NG == 1 ? stream_prefetch_bytes() : pair_prefetch_bytes();
  const bool skip = NG == 2 && pair_skips_other_stream();
  __m256 acc[NG][MB];
  for (int j = 0; j < NG; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s, w += kXsGroupBytes) {
    {
      const int64_t a = NG == 1 ? ahead : pair_ahead(s * kXsGroupBytes, group_bytes, ahead, skip);
      for (int j = 0; j < NG; ++j) prefetch_ahead<kXsGroupBytes>(w + j * group_bytes, a);
    }
    __m256 d[NG];
    __m256i lw[NG][2], hw[NG];  // the scales' sources: low nibbles (sub-blocks 0-3 / 4-7), top bits
    for (int j = 0; j < NG; ++j) {
      const uint8_t* wj = w + j * group_bytes;
      d[j] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj))), f);
      const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + 16));
#if PAGEWIRE_X8_VNNI
      lw[j][0] = lw[j][1] = l;
      hw[j] = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj + 48)));
#else
      lw[j][0] = _mm256_shuffle_epi8(l, ctl_lo);
      lw[j][1] = _mm256_shuffle_epi8(l, ctl_hi);
      hw[j] = _mm256_shuffle_epi8(
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj + 48))), ctl_h);
#endif
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const int64_t blk = s * 8 + i;
      __m256i sc[NG];
      for (int j = 0; j < NG; ++j) {
#if PAGEWIRE_X8_VNNI
        const __m256i nib = _mm256_and_si256(_mm256_srli_epi32(lw[j][0], 4 * i), low4);
#else
        const __m256i nib = _mm256_and_si256(_mm256_srli_epi16(lw[j][i / 4], 4 * (i % 4)), low4);
#endif
        const __m256i ls = _mm256_or_si256(nib, _mm256_and_si256(bits_to_4(hw[j], 2 * i), top2));
#if PAGEWIRE_X8_VNNI
        sc[j] = _mm256_sub_epi32(ls, bias32);
#else
        sc[j] = _mm256_sub_epi16(ls, bias32);
#endif
      }
      __m256i s32[NG][MB];
      for (int j = 0; j < NG; ++j) {
        for (int m = 0; m < MB; ++m) {
#if PAGEWIRE_X8_VNNI
          s32[j][m] = _mm256_set1_epi32(xoff[m][blk]);
#else
          s32[j][m] = _mm256_setzero_si256();
#endif
        }
      }
      for (int c = 0; c < 4; ++c) {
        __m256i lo[NG], hi[NG];
        [[maybe_unused]] __m256i alo[NG], ahi[NG];
        for (int j = 0; j < NG; ++j) {
          const __m256i v = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(w + j * group_bytes + kXsCodes + 128 * i + 32 * c));
          lo[j] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, mask));
          hi[j] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
#if !PAGEWIRE_X8_VNNI
          alo[j] = _mm256_abs_epi8(lo[j]);
          ahi[j] = _mm256_abs_epi8(hi[j]);
#endif
        }
        for (int m = 0; m < MB; ++m) {
          const int8_t* xb = xq[m] + blk * 32 + 4 * c;
          const __m256i x0 = broadcast4(xb), x1 = broadcast4(xb + 16);
          for (int j = 0; j < NG; ++j) {
#if PAGEWIRE_X8_VNNI
            s32[j][m] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s32[j][m], lo[j], x0), hi[j], x1);
#else
            const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(alo[j], _mm256_sign_epi8(x0, lo[j])), sc[j]);
            const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(ahi[j], _mm256_sign_epi8(x1, hi[j])), sc[j]);
            s32[j][m] = _mm256_add_epi32(s32[j][m], _mm256_add_epi32(p0, p1));
#endif
            pin(s32[j][m]);
          }
        }
      }
      for (int m = 0; m < MB; ++m) {
        const __m256 xdm = _mm256_set1_ps(xd[m][blk]);
        for (int j = 0; j < NG; ++j) {
#if PAGEWIRE_X8_VNNI
          const __m256i dot = _mm256_mullo_epi32(s32[j][m], sc[j]);
#else
          const __m256i dot = s32[j][m];
#endif
          acc[j][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d[j], xdm), acc[j][m]);
        }
      }
    }
  }
  for (int j = 0; j < NG; ++j) {
    const __m256 bv = bias != nullptr ? _mm256_loadu_ps(bias + 8 * j) : _mm256_setzero_ps();
    for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + (m0 + m) * ldo + 8 * j, _mm256_add_ps(acc[j][m], bv));
  }
}

// IQ2_XS, IQ2_S and IQ1_M in the x16 layout (quant4_kernel.h): group_xs's route with a scale per 16-value
// half. A chunk's low nibbles are values 4c..4c+3 (the first half) and its high nibbles 16 + 4c..
// (the second), so each half keeps its own chain: VNNI's two chains start at -128 times their 16
// activation codes (block_offsets<16>) and are multiplied by their 2 l + 1 (two vpmulld); AVX2's
// widening madds multiply by them instead of by ones. |(2 l + 1) * sum| <= 31 * 16 * 43 * 127 per
// half, so both builds' integers are exact and equal, and exact in fp32; then acc += (d f * xd) *
// that per 32-value sub-block, as group_xs.
constexpr int kX16GroupBytes = kQ4Interleave * kIq4x16BlockBytes;  // one super-block of eight rows
constexpr int kX16Codes = 80;                                        // where a super-block's codes start

// pshufb control: in each row's 32-bit lane, the lane's byte k zero-extended into both 16-bit halves.
inline __m256i byte_to_halves(int k) {
  alignas(32) int8_t c[32];
  for (int r = 0; r < 8; ++r) {
    c[4 * r] = c[4 * r + 2] = static_cast<int8_t>(4 * (r % 4) + k);
    c[4 * r + 1] = c[4 * r + 3] = -128;  // (zero)
  }
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(c));
}

// Activation rows [m0, m0 + MB) times NG consecutive groups of eight x16-layout weight rows of type
// t -> out[m][0..8 NG). xo: block_offsets<16> (VNNI build).
template <int MB, int NG>
__attribute__((noinline)) void group_x16(Q4Type t, const Q8SumActivations& x, [[maybe_unused]] const int32_t* xo,
                                         int64_t m0, const uint8_t* w, int64_t group_bytes, const float* bias,
                                         float* out, int64_t ldo) {
  const int64_t nb = x.K / 32, nsb = x.K / kQ4_KBlock;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m128i levels = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q_levels(t)));
  const __m256 f = _mm256_set1_ps(q_level_scale(t));
#if PAGEWIRE_X8_VNNI
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_xor_si128(levels, _mm_set1_epi8(static_cast<char>(0x80))));
  const __m256i low4 = _mm256_set1_epi32(0x0F), one = _mm256_set1_epi32(1);
#else
  const __m256i lut = _mm256_broadcastsi128_si256(levels);
  const __m256i low4 = _mm256_set1_epi16(0x0F), one = _mm256_set1_epi16(1);
#endif
  const int8_t* xq[MB];
  const float* xd[MB];
  [[maybe_unused]] const int32_t* xoff[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xoff[m] = xo != nullptr ? xo + (m0 + m) * 2 * nb : nullptr;
  }
  const int64_t ahead = NG == 1 ? stream_prefetch_bytes() : pair_prefetch_bytes();
  const bool skip = NG == 2 && pair_skips_other_stream();
  __m256 acc[NG][MB];
  for (int j = 0; j < NG; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s, w += kX16GroupBytes) {
    {
      const int64_t a = NG == 1 ? ahead : pair_ahead(s * kX16GroupBytes, group_bytes, ahead, skip);
      for (int j = 0; j < NG; ++j) prefetch_ahead<kX16GroupBytes>(w + j * group_bytes, a);
    }
    __m256 d[NG];
    __m256i sv[NG][2];  // the sixteen l: bytes 4v..4v+3 of each row's eight
    for (int j = 0; j < NG; ++j) {
      const uint8_t* wj = w + j * group_bytes;
      d[j] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj))), f);
      sv[j][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + 16));
      sv[j][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + 48));
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const int64_t blk = s * 8 + i;
      __m256i sc[NG][2];  // the two halves' 2 l + 1: per 32-bit lane (VNNI) or in both 16-bit halves (AVX2)
      for (int j = 0; j < NG; ++j) {
#if PAGEWIRE_X8_VNNI
        const __m256i v = _mm256_srli_epi32(sv[j][i / 4], 8 * (i % 4));
        for (int h = 0; h < 2; ++h) {
          const __m256i l = _mm256_and_si256(h == 0 ? v : _mm256_srli_epi32(v, 4), low4);
          sc[j][h] = _mm256_or_si256(_mm256_slli_epi32(l, 1), one);
        }
#else
        const __m256i v = _mm256_shuffle_epi8(sv[j][i / 4], byte_to_halves(i % 4));
        for (int h = 0; h < 2; ++h) {
          const __m256i l = _mm256_and_si256(h == 0 ? v : _mm256_srli_epi16(v, 4), low4);
          sc[j][h] = _mm256_or_si256(_mm256_slli_epi16(l, 1), one);
        }
#endif
      }
      __m256i s32[NG][MB][2];
      for (int j = 0; j < NG; ++j) {
        for (int m = 0; m < MB; ++m) {
#if PAGEWIRE_X8_VNNI
          s32[j][m][0] = _mm256_set1_epi32(xoff[m][2 * blk]);
          s32[j][m][1] = _mm256_set1_epi32(xoff[m][2 * blk + 1]);
#else
          s32[j][m][0] = s32[j][m][1] = _mm256_setzero_si256();
#endif
        }
      }
      for (int c = 0; c < 4; ++c) {
        __m256i lo[NG], hi[NG];
        [[maybe_unused]] __m256i alo[NG], ahi[NG];
        for (int j = 0; j < NG; ++j) {
          const __m256i v = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(w + j * group_bytes + kX16Codes + 128 * i + 32 * c));
          lo[j] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, mask));
          hi[j] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
#if !PAGEWIRE_X8_VNNI
          alo[j] = _mm256_abs_epi8(lo[j]);
          ahi[j] = _mm256_abs_epi8(hi[j]);
#endif
        }
        for (int m = 0; m < MB; ++m) {
          const int8_t* xb = xq[m] + blk * 32 + 4 * c;
          const __m256i x0 = broadcast4(xb), x1 = broadcast4(xb + 16);
          for (int j = 0; j < NG; ++j) {
#if PAGEWIRE_X8_VNNI
            s32[j][m][0] = _mm256_dpbusd_epi32(s32[j][m][0], lo[j], x0);
            s32[j][m][1] = _mm256_dpbusd_epi32(s32[j][m][1], hi[j], x1);
#else
            s32[j][m][0] = _mm256_add_epi32(
                s32[j][m][0], _mm256_madd_epi16(_mm256_maddubs_epi16(alo[j], _mm256_sign_epi8(x0, lo[j])), sc[j][0]));
            s32[j][m][1] = _mm256_add_epi32(
                s32[j][m][1], _mm256_madd_epi16(_mm256_maddubs_epi16(ahi[j], _mm256_sign_epi8(x1, hi[j])), sc[j][1]));
#endif
            pin(s32[j][m][0]);
            pin(s32[j][m][1]);
          }
        }
      }
      for (int m = 0; m < MB; ++m) {
        const __m256 xdm = _mm256_set1_ps(xd[m][blk]);
        for (int j = 0; j < NG; ++j) {
#if PAGEWIRE_X8_VNNI
          const __m256i dot = _mm256_add_epi32(_mm256_mullo_epi32(s32[j][m][0], sc[j][0]),
                                               _mm256_mullo_epi32(s32[j][m][1], sc[j][1]));
#else
          const __m256i dot = _mm256_add_epi32(s32[j][m][0], s32[j][m][1]);
#endif
          acc[j][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d[j], xdm), acc[j][m]);
        }
      }
    }
  }
  for (int j = 0; j < NG; ++j) {
    const __m256 bv = bias != nullptr ? _mm256_loadu_ps(bias + 8 * j) : _mm256_setzero_ps();
    for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + (m0 + m) * ldo + 8 * j, _mm256_add_ps(acc[j][m], bv));
  }
}

}  // namespace q5nl
