// Q6_K's 256-bit body of the interleaved x8 layout (the scheme is in x8k_body.h's header comment),
// built twice with it: x8k_body.h includes this file inside its namespaces, after Q4_K's body and the
// helpers both share (broadcast4, load256, the prefetch distances), with PAGEWIRE_X8_VNNI set.
#pragma once

namespace q6k {

constexpr int kGroupBytes = kQ4Interleave * kQ6_KBlockBytes;  // one super-block of eight rows
constexpr int kScales = 16, kQl = 16 + 128, kQh = kQl + 1024;   // where the group's parts start



// pshufb control: byte k of each 32-bit lane into the high byte of both of its 16-bit halves (the
// low bytes zeroed), so that an arithmetic shift right by 8 sign-extends it into each half.
inline __m256i high_bytes(int k) {
  const uint32_t p = 0x80u | static_cast<uint32_t>(k) << 8 | 0x80u << 16 | static_cast<uint32_t>(k) << 24;
  return _mm256_add_epi8(_mm256_set1_epi32(static_cast<int32_t>(p)),
                         _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808, 0x0C0C0C0C));
}

#if PAGEWIRE_X8_VNNI
// Byte k of each 32-bit lane into the lane's top byte (the rest zeroed): an arithmetic shift right
// by 24 then sign-extends it into the whole lane.
inline __m256i top_byte(int k) {
  const uint32_t p = 0x808080u | static_cast<uint32_t>(k) << 24;
  return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(p)),
                          _mm256_setr_epi32(0, 0x04000000, 0x08000000, 0x0C000000, 0, 0x04000000, 0x08000000, 0x0C000000));
}

// Chunk c's 6-bit codes of sub-block quarter T (values 4c..4c+3 of each row), from its ql bytes
// (low nibbles for T < 2, high for T >= 2) and qh bytes (2-bit field T). qh's fields 0 and 2 are
// kept by 0x33, 1 and 3 by 0xCC, and a 16-bit shift puts field T at bits 4-5 of each byte with
// zeros above; what the shift carries across a byte lands in the next byte's low four bits, which
// the select takes from ql: mask ? nibble : high bits, one vpternlogd. (The AVX2 build's and/or
// form gives the same bytes.)
template <int T>
inline __m256i q6_codes(const uint8_t* ql_at, const uint8_t* qh_at) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i fields = _mm256_and_si256(load256(qh_at), _mm256_set1_epi8(T % 2 == 0 ? 0x33 : -0x34));
  const __m256i hi = T == 0   ? _mm256_slli_epi16(fields, 4)
                     : T == 1 ? _mm256_slli_epi16(fields, 2)
                     : T == 2 ? fields
                              : _mm256_srli_epi16(fields, 2);
  const __m256i ql = load256(ql_at);
  const __m256i nib = T < 2 ? ql : _mm256_srli_epi16(ql, 4);
  return _mm256_ternarylogic_epi32(mask, nib, hi, 0xCA);
}
#endif

// Activation rows [m0, m0 + MB) times one group of eight Q6_K weight rows -> out[m][0..8).
// x16: per activation row, each 16 activation codes' sum as prepare_q6_sums leaves it (K / 16).
template <int MB>
void group_q6(const Q8SumActivations& x, const int32_t* x16, int64_t m0, const uint8_t* w, const float* bias,
              float* out, int64_t ldo) {
  const int64_t nb = x.K / 32, nsb = x.K / kQ4_KBlock, n16 = x.K / 16;
#if !PAGEWIRE_X8_VNNI
  const __m256i mask = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);  // (VNNI: q6_codes)
#endif
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
  const bool far = far_streams(), l2 = far_q6_into_l2();
  for (int64_t s = 0; s < nsb; ++s, w += kGroupBytes) {
    if (l2) {
      prefetch_ahead<6, _MM_HINT_T1>(w, kGroupBytes);
    } else if (far) {
      prefetch_ahead<4, _MM_HINT_T0>(w, kGroupBytes);
    } else {
      prefetch_next(w, kGroupBytes);
    }
    __m256 sa[MB];
    for (int m = 0; m < MB; ++m) sa[m] = _mm256_setzero_ps();
    // Unrolled whole, so that quarter t's shifts are chosen at compile time: rolled, GCC kept the
    // loops' index arithmetic and the selects in scalar code, and the VNNI body took 1.45x as long
    // with the group's weights in cache (bench/RESULTS.md session 31).
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const int j = 4 * h + t;  // the sub-block (32 values)
        __m256i i32[MB];
        for (int m = 0; m < MB; ++m) i32[m] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int hh = 0; hh < 2; ++hh) {
          const int idx = 2 * j + hh;
#if PAGEWIRE_X8_VNNI
          // Each row's scale of half idx as a whole 32-bit lane (one shuffle, one shift). Each
          // row's chain starts at the codes' offset, -32 * (sum of the half's activation codes),
          // and adds the half's four chunks by vpdpbusd (|sum| <= 16 * 63 * 128 + 32 * 2048); one
          // vpmulld by the scale then gives scale * (sum of (code - 32) * x): the integer that the
          // AVX2 build's madds of 16-bit pair sums and its offset madd add up to.
          const __m256i sc32 = _mm256_srai_epi32(
              _mm256_shuffle_epi8(load256(w + kScales + 32 * (idx / 4)), top_byte(idx % 4)), 24);
          __m256i p32[MB];
          for (int m = 0; m < MB; ++m) p32[m] = _mm256_set1_epi32(xs[m][s * 16 + idx]);
#pragma GCC unroll 4
          for (int c = 4 * hh; c < 4 * hh + 4; ++c) {  // values 4c..4c+3 of the sub-block
            const uint8_t* ql_at = w + kQl + 32 * (16 * h + 8 * (t % 2) + c);
            const uint8_t* qh_at = w + kQh + 32 * (8 * h + c);
            const __m256i codes = t == 0   ? q6_codes<0>(ql_at, qh_at)
                                  : t == 1 ? q6_codes<1>(ql_at, qh_at)
                                  : t == 2 ? q6_codes<2>(ql_at, qh_at)
                                           : q6_codes<3>(ql_at, qh_at);
            for (int m = 0; m < MB; ++m) {
              p32[m] = _mm256_dpbusd_epi32(p32[m], codes, broadcast4(xq[m] + j * 32 + s * 256 + 4 * c));
            }
          }
          for (int m = 0; m < MB; ++m) i32[m] = _mm256_add_epi32(i32[m], _mm256_mullo_epi32(p32[m], sc32));
#else
          // Scale 2j + hh of each row, sign-extended into both 16-bit halves of its lane: a shuffle
          // puts the byte in each half's high byte, an arithmetic shift brings it down.
          const __m256i sc = _mm256_srai_epi16(
              _mm256_shuffle_epi8(load256(w + kScales + 32 * (idx / 4)), high_bytes(idx % 4)), 8);
          for (int pair = 0; pair < 2; ++pair) {
            __m256i p16[MB];
            for (int m = 0; m < MB; ++m) p16[m] = _mm256_setzero_si256();
            for (int u = 0; u < 2; ++u) {
              const int c = 4 * hh + 2 * pair + u;  // values 4c..4c+3 of the sub-block
              const __m256i ql = load256(w + kQl + 32 * (16 * h + 8 * (t % 2) + c));
              const __m256i qh = load256(w + kQh + 32 * (8 * h + c));
              const __m256i lo = t < 2 ? _mm256_and_si256(ql, mask) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), mask);
              const __m256i hi = t == 0   ? _mm256_slli_epi16(qh, 4)
                                 : t == 1 ? _mm256_slli_epi16(qh, 2)
                                 : t == 2 ? qh
                                          : _mm256_srli_epi16(qh, 2);
              const __m256i codes = _mm256_or_si256(lo, _mm256_and_si256(hi, top));
              for (int m = 0; m < MB; ++m) {
                const __m256i xb = broadcast4(xq[m] + j * 32 + s * 256 + 4 * c);
                p16[m] = _mm256_add_epi16(p16[m], _mm256_maddubs_epi16(codes, xb));
              }
            }
            for (int m = 0; m < MB; ++m) i32[m] = _mm256_add_epi32(i32[m], _mm256_madd_epi16(p16[m], sc));
          }
          // The codes' offset: - scale * 32 * (sum of the half's activation codes), as one madd of
          // the scale by 16 * sum in both 16-bit halves (|16 * sum| <= 32,768: prepared per call).
          for (int m = 0; m < MB; ++m) {
            i32[m] = _mm256_sub_epi32(i32[m], _mm256_madd_epi16(sc, _mm256_set1_epi32(xs[m][s * 16 + idx])));
          }
#endif
        }
        for (int m = 0; m < MB; ++m) {
          sa[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[m]), _mm256_set1_ps(xd[m][s * 8 + j]), sa[m]);
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_fmadd_ps(d, sa[m], acc[m]);
  }
  const __m256 bv = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + (m0 + m) * ldo, _mm256_add_ps(acc[m], bv));
}

// Each 16 activation codes' sum (n16 of them), as the offset term reads it: AVX2 build, 16 * the
// sum in both 16-bit halves (a madd by a scale in both halves gives scale * 32 * sum; |16 * sum| <=
// 32,768); VNNI build, -32 * the sum, where each row's vpdpbusd chain starts.
inline void prepare_q6_sums(const int8_t* q, int64_t n16, int32_t* out) {
  for (int64_t i = 0; i < n16; ++i) {
    int32_t sum = 0;
    for (int k = 0; k < 16; ++k) sum += q[i * 16 + k];
#if PAGEWIRE_X8_VNNI
    out[i] = -32 * sum;
#else
    const uint32_t half = static_cast<uint16_t>(static_cast<int16_t>(16 * sum));
    out[i] = static_cast<int32_t>(half | half << 16);
#endif
  }
}

}  // namespace q6k
