// Q2_K's 256-bit body of the interleaved x8 layout (quant4_kernel.h), built twice with x8k_body.h
// (which includes this file inside its namespaces, after the helpers they share: broadcast4,
// load256, the prefetch distances, halves_of_byte / word_of_byte and scaled), with PAGEWIRE_X8_VNNI
// set. Q2_K was dequantised to the serving dtype at load (16 bits a value against its 2.625), and a
// Q2_K file decoded at half llama.cpp's speed.
//
// Each 32-bit lane carries one of the group's eight rows, as for Q4_K:
//  * one 32-byte chunk holds four code bytes of each row, and each byte four 2-bit codes: the same
//    four values (4c..4c+3) of four consecutive 32-value blocks, one per bit pair. One shift and
//    four masks give four code vectors (unsigned: blocks 0 and 2's codes 0..3, blocks 1 and 3's
//    four times theirs, left at bits 2-3), each against its block's four activation bytes
//    (broadcast by the load): maddubs pair sums in 16 bits (AVX2: a 16-value sub-block's four
//    chunks add to at most 4 * 2 * 12 * 127 = 12,192) or vpdpbusd sums (VNNI);
//  * per 16-value sub-block one madd (AVX2) or vpmulld (VNNI) by its 4-bit scale, picked for the
//    eight rows by one shuffle from the layout's scale vectors (|scale * dot| <= 2 * 15 * 12,192:
//    the same exact integer in both builds), then one int32 -> fp32 and one FMA by the activation
//    block's scale (a quarter of it for blocks 1 and 3);
//  * the mins' term per sub-block: its 4-bit min times the activation codes' sum over its 16
//    values times their block's scale (prepared once per call, prepare_q2_sums), one FMA;
//  * once per super-block the rows' d and dmin.
#pragma once

namespace q2k {

constexpr int kGroupBytes = kQ4Interleave * kQ2_KBlockBytes;  // one super-block of eight rows
constexpr int kScales = 32, kCodes = 160;                      // where the group's parts start

// Per activation row, each 16 codes' sum times its 32-value block's scale (K / 16 floats a row).
inline void prepare_q2_sums(const Q8SumActivations& x, float* out) {
  const int64_t n16 = x.K / 16;
  for (int64_t i = 0; i < x.M * n16; ++i) {
    int32_t sum = 0;
    for (int k = 0; k < 16; ++k) sum += x.q[i * 16 + k];
    out[i] = x.d[i / 2] * static_cast<float>(sum);  // (i / 2: [M, K / 32] is the same walk)
  }
}

// Activation rows [m0, m0 + MB) times one group of eight Q2_K weight rows -> out[m][0..8).
// s16: prepare_q2_sums's floats.
template <int MB>
void group_q2(const Q8SumActivations& x, const float* s16, int64_t m0, const uint8_t* w, const float* bias,
              float* out, int64_t ldo) {
  const int64_t nb = x.K / 32, nsb = x.K / kQ4_KBlock, n16 = x.K / 16;
  const __m256i three = _mm256_set1_epi8(3), twelve = _mm256_set1_epi8(12), low4 = _mm256_set1_epi8(0x0F);
  const int8_t* xq[MB];
  const float* xd[MB];
  const float* xs[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xs[m] = s16 + (m0 + m) * n16;
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
    __m256 sa[MB], ma[MB];
    for (int m = 0; m < MB; ++m) sa[m] = ma[m] = _mm256_setzero_ps();
    // Unrolled whole, so that every shift and shuffle control is a constant.
#pragma GCC unroll 2
    for (int n = 0; n < 2; ++n) {  // values 128n..128n + 127: blocks 4n..4n + 3
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // each block's 16-value half h: chunks 4h..4h + 3
        __m256i dot[4][MB];
        for (int j = 0; j < 4; ++j)
          for (int m = 0; m < MB; ++m) dot[j][m] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 4 * h; c < 4 * h + 4; ++c) {
          const __m256i v = load256(w + kCodes + 32 * (8 * n + c));
          // Blocks 1 and 3's codes stay at bits 2-3 (four times the code): one shift and four masks
          // where shifting each pair down took three shifts and four masks.
          const __m256i v4 = _mm256_srli_epi16(v, 4);
          const __m256i q[4] = {_mm256_and_si256(v, three), _mm256_and_si256(v, twelve), _mm256_and_si256(v4, three),
                                _mm256_and_si256(v4, twelve)};
          for (int m = 0; m < MB; ++m) {
            const int8_t* xb = xq[m] + s * 256 + 128 * n + 4 * c;
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
          const int sb = 8 * n + 2 * j + h;  // the 16-value sub-block: its scale / min byte
          const __m256i raw = _mm256_and_si256(load256(w + kScales + 32 * (sb / 4)), low4);
#if PAGEWIRE_X8_VNNI
          const __m256i sc = _mm256_shuffle_epi8(raw, q4k::word_of_byte(sb % 4));
#else
          const __m256i sc = _mm256_shuffle_epi8(raw, q4k::halves_of_byte(sb % 4));
#endif
          for (int m = 0; m < MB; ++m) {
            // (odd j: the integer is four times the sum, exact in fp32, and xd / 4 is exact too,
            // so the product is the one of the sum and xd, rounded once)
            sa[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4k::scaled(dot[j][m], sc)),
                                    _mm256_set1_ps(xd[m][s * 8 + 4 * n + j] * (j % 2 == 1 ? 0.25f : 1.f)), sa[m]);
          }
        }
      }
    }
    // The mins' term: sum over sub-blocks of min * (activation block's d * the 16 codes' sum).
#pragma GCC unroll 16
    for (int sb = 0; sb < 16; ++sb) {
      const __m256i raw = _mm256_and_si256(_mm256_srli_epi16(load256(w + kScales + 32 * (sb / 4)), 4), low4);
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(raw, q4k::word_of_byte(sb % 4)));
      for (int m = 0; m < MB; ++m) ma[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[m][s * 16 + sb]), ma[m]);
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm256_fmadd_ps(d, sa[m], acc[m]);
      acc[m] = _mm256_fnmadd_ps(dmin, ma[m], acc[m]);
    }
  }
  const __m256 bv = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + (m0 + m) * ldo, _mm256_add_ps(acc[m], bv));
}

}  // namespace q2k
