// The Q5_K and Q6_K row-layout kernels' body (layouts in quant4_kernel.h), x Q8 activations with
// their block sums. Included by linear_k56_avx2.cpp and linear_k56_avx512.cpp after their target
// switch; everything here has internal linkage, so each file keeps its own copy for its own ISA.
// kVnni: the unsigned-code dot products of Q5_K through vpdpbusd (AVX-512 VNNI on 256-bit
// registers, one instruction) instead of maddubs + madd.
//
//  * Q5_K is Q4_K with a fifth bit: one 32-byte load gives two sub-blocks' low four bits (low and
//    high nibbles), and the super-block's 32 qh bytes, loaded once, give bit s of each value of
//    sub-block s (one shift and one mask). Codes 0..31 are unsigned, so maddubs / vpdpbusd take
//    them as they are; the min term (-dmin * mn) multiplies the activation block's d * sum, eight
//    sub-blocks per FMA, as in the Q4_K kernel.
//  * Q6_K: a sub-block's codes are four bits of ql and two of qh (shifts and masks), minus 32 for
//    signed values in -32..31; maddubs takes |q| and the activations with q's sign (pairs at most
//    2 * 32 * 127), and one madd against the two 16-value halves' int8 scales (sign-extended to 16
//    bits, spread by a lane permute and a byte shuffle) gives each half's scaled dot product in
//    32 bits. One int32 -> fp32 and one FMA by d * the activation block's scale finish the block.
//  * Each unpacked weight sub-block serves up to four activation rows (M tiles) while in registers.
//
// Batch invariance (docs/determinism.md): every output (m, n) has its own accumulator, updated in
// K order with the same instructions whatever the tile shape, then one fixed horizontal sum.
#pragma once

#include <cstdint>
#include <cstring>

#include "quant4_kernel.h"

namespace pagewire::cpu {
namespace {
namespace k56 {

constexpr int kPrefetchRows = 8;  // as the other kernels: weight rows ahead, at the offset being read

__attribute__((always_inline)) inline void prefetch(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The eight 6-bit scales (or mins) of a super-block as fp32, from their two 32-bit halves.
inline __m256 six_bit8(uint32_t lo, uint32_t hi) {
  const uint64_t v = lo | (static_cast<uint64_t>(hi) << 32);
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(v))));
}

// Eight int32 lanes of unsigned codes q (32 bytes) times signed activations a, four pairs a lane.
template <bool kVnni>
inline __m256i dot_u8(__m256i q, __m256i a) {
  if constexpr (kVnni) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, a);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), _mm256_set1_epi16(1));
  }
}

// Bit `bit` of each byte of qh, moved to bit 4 (16-bit shifts: no bit crosses into the byte kept).
inline __m256i fifth_bit(__m256i qh, int bit) {
  const __m256i b4 = _mm256_set1_epi8(0x10);
  if (bit <= 4) return _mm256_and_si256(_mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - bit)), b4);
  return _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(bit - 4)), b4);
}

// Rows [m0, m0 + MB) of x times Q5_K weight rows w[0..NR) -> out[m][0..NR).
template <int MB, int NR, bool kVnni>
void tile_q5k(const Q8SumActivations& x, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias,
              float* out, int64_t ldo) {
  const int64_t nb = x.K / 32, nsb = x.K / kQ4_KBlock, pf = kPrefetchRows * row_bytes;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const int8_t* xq[MB];
  const float* xd[MB];
  const float* xs[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xs[m] = x.s + (m0 + m) * nb;
  }
  __m256 acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) acc[m][i] = _mm256_setzero_ps();
  }
  for (int64_t s = 0; s < nsb; ++s) {
    alignas(32) float sc[NR][MB][8];  // combined scales, read back by broadcast loads
    __m256i qh[NR];
    for (int i = 0; i < NR; ++i) {
      const uint8_t* blk = w + i * row_bytes + s * kQ5_KBlockBytes;
      uint32_t a, bw, c;  // the packed scales and mins as Q4_K's (linear_q4_avx2.cpp's tile_k)
      std::memcpy(&a, blk + 4, 4);
      std::memcpy(&bw, blk + 8, 4);
      std::memcpy(&c, blk + 12, 4);
      const __m256 scales = six_bit8(a & 0x3F3F3F3Fu, (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u));
      const __m256 mins = six_bit8(bw & 0x3F3F3F3Fu, ((c >> 4) & 0x0F0F0F0Fu) | ((bw >> 2) & 0x30303030u));
      const __m256 av = _mm256_mul_ps(scales, _mm256_set1_ps(fp16(blk)));
      const __m256 cv = _mm256_mul_ps(mins, _mm256_set1_ps(-fp16(blk + 2)));
      for (int m = 0; m < MB; ++m) {
        _mm256_store_ps(sc[i][m], _mm256_mul_ps(av, _mm256_loadu_ps(xd[m] + s * 8)));
        acc[m][i] = _mm256_fmadd_ps(cv, _mm256_loadu_ps(xs[m] + s * 8), acc[m][i]);
      }
      qh[i] = load256(blk + 16);
    }
    for (int h = 0; h < 4; ++h) {
      for (int i = 0; i < NR; ++i) {
        const uint8_t* qc = w + i * row_bytes + s * kQ5_KBlockBytes + 48 + 32 * h;
        prefetch(qc + pf);
        const __m256i raw = load256(qc);
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, mask), fifth_bit(qh[i], 2 * h));
        const __m256i hi =
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), mask), fifth_bit(qh[i], 2 * h + 1));
        for (int m = 0; m < MB; ++m) {
          const int8_t* xb = xq[m] + (s * 8 + 2 * h) * 32;
          acc[m][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8<kVnni>(lo, load256(xb))),
                                      _mm256_broadcast_ss(&sc[i][m][2 * h]), acc[m][i]);
          acc[m][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8<kVnni>(hi, load256(xb + 32))),
                                      _mm256_broadcast_ss(&sc[i][m][2 * h + 1]), acc[m][i]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) out[(m0 + m) * ldo + i] = hsum(acc[m][i]) + (bias != nullptr ? bias[i] : 0.f);
  }
}

// Rows [m0, m0 + MB) of x times Q6_K weight rows w[0..NR) -> out[m][0..NR).
template <int MB, int NR>
void tile_q6k(const Q8SumActivations& x, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias,
              float* out, int64_t ldo) {
  const int64_t nb = x.K / 32, nsb = x.K / kQ4_KBlock, pf = kPrefetchRows * row_bytes;
  const __m256i mask = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30), m32 = _mm256_set1_epi8(32);
  // Within each 128-bit lane: int16 0 (low lane) or int16 1 (high lane) of a 32-bit lane, eight times.
  const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,  //
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  const int8_t* xq[MB];
  const float* xd[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
  }
  __m256 acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) acc[m][i] = _mm256_setzero_ps();
  }
  for (int64_t s = 0; s < nsb; ++s) {
    alignas(32) float dx[NR][MB][8];  // d * the activation blocks' scales
    __m256i scales[NR];               // the 16 int8 scales as int16: 2j, 2j + 1 in 32-bit lane j
    for (int i = 0; i < NR; ++i) {
      const uint8_t* blk = w + i * row_bytes + s * kQ6_KBlockBytes;
      const __m256 d = _mm256_set1_ps(fp16(blk + 208));
      for (int m = 0; m < MB; ++m) _mm256_store_ps(dx[i][m], _mm256_mul_ps(d, _mm256_loadu_ps(xd[m] + s * 8)));
      scales[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    }
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = w + i * row_bytes + s * kQ6_KBlockBytes;
        prefetch(blk + 64 * h + pf);
        prefetch(blk + 64 * h + 32 + pf);
        prefetch(blk + 128 + 32 * h + pf);
        const __m256i ql0 = load256(blk + 64 * h), ql1 = load256(blk + 64 * h + 32);
        const __m256i qh = load256(blk + 128 + 32 * h);
        const __m256i codes[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, mask), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top)),
            _mm256_or_si256(_mm256_and_si256(ql1, mask), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), mask), _mm256_and_si256(qh, top)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), mask),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), top)),
        };
        for (int u = 0; u < 4; ++u) {
          const int j = 4 * h + u;
          const __m256i sq = _mm256_sub_epi8(codes[u], m32);
          const __m256i aq = _mm256_abs_epi8(sq);
          const __m256i sc16 = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(scales[i], _mm256_set1_epi32(j)), spread);
          for (int m = 0; m < MB; ++m) {
            const __m256i p16 = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(load256(xq[m] + (s * 8 + j) * 32), sq));
            acc[m][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, sc16)),
                                        _mm256_broadcast_ss(&dx[i][m][j]), acc[m][i]);
          }
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) out[(m0 + m) * ldo + i] = hsum(acc[m][i]) + (bias != nullptr ? bias[i] : 0.f);
  }
}

template <Q4Type T, int MB, int NR, bool kVnni>
inline void tile(const Q8SumActivations& x, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias,
                 float* out, int64_t ldo) {
  if constexpr (T == Q4Type::kQ5_K) {
    tile_q5k<MB, NR, kVnni>(x, m0, w, row_bytes, bias, out, ldo);
  } else {
    tile_q6k<MB, NR>(x, m0, w, row_bytes, bias, out, ldo);
  }
}

// All M rows times NR weight rows: tiles of four activation rows, then two, then one.
template <Q4Type T, int NR, bool kVnni>
void rows(const Q8SumActivations& x, const uint8_t* w, int64_t row_bytes, const float* bias, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= x.M; m += 4) tile<T, 4, NR, kVnni>(x, m, w, row_bytes, bias, out, ldo);
  if (m + 2 <= x.M) {
    tile<T, 2, NR, kVnni>(x, m, w, row_bytes, bias, out, ldo);
    m += 2;
  }
  if (m < x.M) tile<T, 1, NR, kVnni>(x, m, w, row_bytes, bias, out, ldo);
}

template <Q4Type T, int NR, bool kVnni>
void run_nr(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t N) {
  const int64_t row_bytes = x.K / kQ4_KBlock * q4_block_bytes(T);
  const int64_t groups = N / NR;
  // Static schedule: each thread streams one contiguous slice of the weight.
#pragma omp parallel for schedule(static) if (N * x.K * x.M >= 65536)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = g * NR;
    rows<T, NR, kVnni>(x, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr, out + n, ldo);
  }
  for (int64_t n = groups * NR; n < N; ++n) {
    rows<T, 1, kVnni>(x, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr, out + n, ldo);
  }
}

// One activation row: four weight rows per tile (four independent FMA chains); several rows: two
// weight rows, up to four activation rows.
template <bool kVnni>
void run(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
         int64_t N) {
  if (t == Q4Type::kQ5_K) {
    if (x.M == 1) {
      run_nr<Q4Type::kQ5_K, 4, kVnni>(x, w, bias, out, ldo, N);
    } else {
      run_nr<Q4Type::kQ5_K, 2, kVnni>(x, w, bias, out, ldo, N);
    }
  } else if (x.M == 1) {
    run_nr<Q4Type::kQ6_K, 4, kVnni>(x, w, bias, out, ldo, N);
  } else {
    run_nr<Q4Type::kQ6_K, 2, kVnni>(x, w, bias, out, ldo, N);
  }
}

}  // namespace k56
}  // namespace
}  // namespace pagewire::cpu
