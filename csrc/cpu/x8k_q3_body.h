// Q3_K's 256-bit body of the interleaved x8 layout (quant4_kernel.h), built twice with x8k_body.h
// (which includes this file inside its namespaces, after the helpers it shares with Q2_K's and
// Q6_K's bodies: broadcast4, load256, the prefetch distances, q6k::high_bytes / top_byte), with
// PAGEWIRE_X8_VNNI set. Q3_K had no kernel: its blocks were transcoded at load into the Q6_K blocks
// that say the same values, 210 bytes per 256 values against its own 110.
//
// Each 32-bit lane carries one of the group's eight rows:
//  * the layout keeps a row's eight 3-bit codes of one value position (the same position in each of
//    the super-block's eight 32-value blocks) in three bytes, A, B and C (quant4_kernel.h), so a
//    32-byte chunk of a plane holds four positions of each row. Six blocks' codes are a nibble of a
//    plane, one mask or a shift and a mask; the last two blocks' codes are gathered from bits 3 and
//    7 of the three planes by three shifts, three masks and two ors, then split as a nibble pair.
//    Per four positions the first half's four blocks take 6 operations and the second's 14,
//    shared by every activation row. (GGUF's planes, qs and hmask, took 18-19: a shift and a mask
//    of each and an or per code; RESULTS, session 43.)
//  * each code vector against its block's four activation bytes (broadcast by the load): maddubs
//    pair sums in 16 bits (AVX2) or vpdpbusd sums (VNNI). The codes' offset of 4 starts each
//    16-value sub-block's sums: at -2 * (its 16 activation codes' sum) in both 16-bit halves (AVX2:
//    the halves add to sum((code - 4) * x); each stays within 8 * 7 * 128 + 2 * 2048) or at -4 times
//    it (VNNI), prepared once per call (prepare_q3_sums);
//  * per sub-block one madd (AVX2) or vpmulld (VNNI) by its signed 6-bit scale (sc - 32), picked for
//    the eight rows by one shuffle and one shift from the scale vectors, which are decoded once per
//    super-block from the layout's three words of packed scales: the same exact integer in both
//    builds; then one int32 -> fp32 and one FMA by the activation block's scale;
//  * once per super-block the rows' d.
#pragma once

namespace q3k {

constexpr int kGroupBytes = kQ4Interleave * kQ3_KBlockBytes;  // one super-block of eight rows
constexpr int kScales = 16, kPlanes = 112, kPlane = 256;       // where the group's parts start

// Per activation row, each 16 codes' sum as a sub-block's sums start from: AVX2 build, -2 * the sum
// in both 16-bit halves (|2 * sum| <= 4,096); VNNI build, -4 * the sum. [M, K / 16].
inline void prepare_q3_sums(const int8_t* q, int64_t n16, int32_t* out) {
  for (int64_t i = 0; i < n16; ++i) {
    int32_t sum = 0;
    for (int k = 0; k < 16; ++k) sum += q[i * 16 + k];
#if PAGEWIRE_X8_VNNI
    out[i] = -4 * sum;
#else
    const uint32_t half = static_cast<uint16_t>(static_cast<int16_t>(-2 * sum));
    out[i] = static_cast<int32_t>(half | half << 16);
#endif
  }
}

// A plane chunk's two nibble codes: bits 0-2 (Hi false) or 4-6 (Hi true) of each byte (16-bit
// shifts: what crosses from the neighbouring byte the mask drops).
template <bool Hi>
inline __m256i nibble_code(__m256i v, __m256i seven) {
  return _mm256_and_si256(Hi ? _mm256_srli_epi16(v, 4) : v, seven);
}

// Activation rows [m0, m0 + MB) times one group of eight Q3_K weight rows -> out[m][0..8).
// x16: prepare_q3_sums's integers.
template <int MB>
void group_q3(const Q8SumActivations& x, const int32_t* x16, int64_t m0, const uint8_t* w, const float* bias,
              float* out, int64_t ldo) {
  const int64_t nb = x.K / 32, nsb = x.K / kQ4_KBlock, n16 = x.K / 16;
  const __m256i seven = _mm256_set1_epi8(7), low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30),
                bias32 = _mm256_set1_epi8(32);
  const int8_t* xq[MB];
  const float* xd[MB];
  const int32_t* xs[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xs[m] = x16 + (m0 + m) * n16;
  }
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const bool far = far_streams();
  for (int64_t s = 0; s < nsb; ++s, w += kGroupBytes) {
    if (far) {
      prefetch_ahead<8, _MM_HINT_T1>(w, kGroupBytes);
    } else {
      prefetch_ahead<2, _MM_HINT_T0>(w, kGroupBytes);
    }
    // The sixteen 6-bit scales of every row, one signed byte each (sc - 32), four vectors of four
    // sub-blocks (q3_k_scale's rule): low nibbles from words 0 and 1, top bits from word 2.
    const __m256i a = load256(w + kScales), b = load256(w + kScales + 32), c = load256(w + kScales + 64);
    const __m256i sv[4] = {
        _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi16(c, 4), top2)), bias32),
        _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(b, low4), _mm256_and_si256(_mm256_slli_epi16(c, 2), top2)), bias32),
        _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4), _mm256_and_si256(c, top2)), bias32),
        _mm256_sub_epi8(
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low4), _mm256_and_si256(_mm256_srli_epi16(c, 2), top2)),
            bias32)};
    __m256 sa[MB];
    for (int m = 0; m < MB; ++m) sa[m] = _mm256_setzero_ps();
    // Unrolled whole, so that every shift and shuffle control is a constant.
#pragma GCC unroll 2
    for (int n = 0; n < 2; ++n) {  // values 128n..128n + 127: blocks 4n..4n + 3
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // each block's 16-value half h: chunks 4h..4h + 3
        __m256i dot[4][MB];
        for (int j = 0; j < 4; ++j) {
          for (int m = 0; m < MB; ++m) dot[j][m] = _mm256_set1_epi32(xs[m][s * 16 + 8 * n + 2 * j + h]);
        }
#pragma GCC unroll 4
        for (int cc = 4 * h; cc < 4 * h + 4; ++cc) {
          const __m256i a = load256(w + kPlanes + 32 * cc), b = load256(w + kPlanes + kPlane + 32 * cc);
          __m256i q[4];
          if (n == 0) {  // blocks 0-3: A's and B's nibbles
            q[0] = nibble_code<false>(a, seven);
            q[1] = nibble_code<true>(a, seven);
            q[2] = nibble_code<false>(b, seven);
            q[3] = nibble_code<true>(b, seven);
          } else {  // blocks 4-5: C's nibbles; 6-7: bits 3 and 7 of A, B, C (bits 0, 1, 2 of the code)
            const __m256i c = load256(w + kPlanes + 2 * kPlane + 32 * cc);
            q[0] = nibble_code<false>(c, seven);
            q[1] = nibble_code<true>(c, seven);
            const __m256i t = _mm256_or_si256(
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 3), _mm256_set1_epi8(0x11)),
                                _mm256_and_si256(_mm256_srli_epi16(b, 2), _mm256_set1_epi8(0x22))),
                _mm256_and_si256(_mm256_srli_epi16(c, 1), _mm256_set1_epi8(0x44)));
            q[2] = nibble_code<false>(t, seven);
            q[3] = nibble_code<true>(t, seven);
          }
          for (int m = 0; m < MB; ++m) {
            const int8_t* xb = xq[m] + s * 256 + 128 * n + 4 * cc;
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
#if PAGEWIRE_X8_VNNI
              dot[j][m] = _mm256_dpbusd_epi32(dot[j][m], q[j], broadcast4(xb + 32 * j));
#else
              dot[j][m] = _mm256_add_epi16(dot[j][m], _mm256_maddubs_epi16(q[j], broadcast4(xb + 32 * j)));
#endif
            }
          }
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const int sb = 8 * n + 2 * j + h;  // the 16-value sub-block
#if PAGEWIRE_X8_VNNI
          const __m256i sc = _mm256_srai_epi32(_mm256_shuffle_epi8(sv[sb / 4], q6k::top_byte(sb % 4)), 24);
#else
          const __m256i sc = _mm256_srai_epi16(_mm256_shuffle_epi8(sv[sb / 4], q6k::high_bytes(sb % 4)), 8);
#endif
          for (int m = 0; m < MB; ++m) {
            sa[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4k::scaled(dot[j][m], sc)),
                                    _mm256_set1_ps(xd[m][s * 8 + 4 * n + j]), sa[m]);
          }
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_fmadd_ps(d, sa[m], acc[m]);
  }
  const __m256 bv = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + (m0 + m) * ldo, _mm256_add_ps(acc[m], bv));
}

}  // namespace q3k
