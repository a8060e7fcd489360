// Q5_0, Q5_1, IQ4_NL and IQ4_XS weights (and the grid types held in IQ4_XS's layout) in row layout
// x Q8 activations on AVX2 (layouts in quant4_kernel.h); linear_q4_avx2 and linear_q4_avx512 call it
// for those types. On x86 a weight of
// eight rows or more is interleaved at load (QuantizedWeight.for_kernels) and runs through the x8
// kernels (x8_q5nl_body.h), so this serves a weight's last N % 8 rows and weights of fewer than
// eight: it is kept simple, one block of 32 codes at a time.
//
// Per block (IQ4_XS layout: per 32-value sub-block, its scale d * (ls - 32) * f as the block's d): the 32 codes
// in natural order in one register (the nibbles' two halves side by side; Q5's fifth bits spread
// from the qh word by a byte shuffle, a mask and a compare; IQ4's levels by a byte shuffle of the
// nibbles), then per activation row one maddubs and one madd (Q5: codes 0..31, pairs at most
// 2 * 31 * 127; IQ4: |level| times x with the level's sign, pairs at most 2 * 127 * 127, neither
// saturates) and one FMA of the block's d * xd into eight lanes. The offset
// term (Q5_0: -16 d, Q5_1: m, times the activation block's d * sum) is a scalar FMA per block.
//
// Batch invariance (docs/determinism.md): every output (m, n) has its own accumulators, updated in
// K order with the same instructions whatever the tile of activation rows, then one fixed
// horizontal sum.
#include <cmath>
#include <cstdint>
#include <cstring>

// Headers first: inline functions they define must keep the baseline ISA.
#include "quant4_kernel.h"
#include "team_kernel.h"
#include "x86_target.h"

PAGEWIRE_TARGET_PUSH("avx2,fma,f16c")

#include "avx2_util.h"

namespace pagewire::cpu {
namespace {

using avx2::fp16;

constexpr bool kLevels(Q4Type t) { return t == Q4Type::kIQ4_NL || t == Q4Type::kIQ4_XS || t == Q4Type::kIQ2_XS; }

// A block's (IQ4_XS: a sub-block's) 32 codes in natural order (Q5: 0..31; IQ4: the signed levels of
// `lut`, the type's sixteen levels in both halves), its codes at qs (Q5: its fifth bits at blk's qh).
template <Q4Type T>
inline __m256i block_codes(const uint8_t* blk, const uint8_t* qs, [[maybe_unused]] __m256i lut) {
  constexpr bool mins = T == Q4Type::kQ5_1;
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256i q = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1), mask);
  if constexpr (kLevels(T)) {
    return _mm256_shuffle_epi8(lut, q);
  } else {
    uint32_t qh;
    std::memcpy(&qh, blk + (mins ? 4 : 2), 4);
    // Byte k takes qh's byte k / 8 (a shuffle within each 128-bit half: bytes 0-1 low, 2-3 high),
    // then its bit k % 8.
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(qh)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
  }
}

// Weight row wr times activation rows [m0, m0 + MB) -> out[m * ldo]. IQ4_NL / IQ4_XS / x16 (T =
// kIQ2_XS): `t` the type whose levels and level scale the codes carry (IQ4_XS's layout serves the
// grid types too, the x16 layout IQ2_XS, IQ2_S and IQ1_M: a scale per 16-value half, one per 128-bit lane).
template <Q4Type T, int MB>
void row_tile(Q4Type t, const Q8SumActivations& x, int64_t m0, const uint8_t* wr, float bias, float* out,
              int64_t ldo) {
  const int64_t nb = x.K / 32;
  constexpr bool xs = T == Q4Type::kIQ4_XS;
  constexpr bool x16 = T == Q4Type::kIQ2_XS;
  constexpr int qs_at = (T == Q4Type::kQ5_1 ? 4 : 2) + (T == Q4Type::kIQ4_NL ? 0 : 4);  // (not IQ4_XS)
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q_levels(t))));
  const float f = q_level_scale(t);  // a power of two: d * (ls - 32) * f is exact
  __m256 acc[MB];
  float off[MB];
  for (int m = 0; m < MB; ++m) {
    acc[m] = _mm256_setzero_ps();
    off[m] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    // IQ4_XS: sub-block b % 8 of super-block b / 8, its scale d * (ls - 32) (exact in fp32).
    const uint8_t* blk = xs    ? wr + (b / 8) * kIq4xsBlockBytes
                         : x16 ? wr + (b / 8) * kIq4x16BlockBytes
                               : wr + b * q4_block_bytes(T);
    const uint8_t* qs = xs ? blk + 8 + 16 * (b % 8) : x16 ? blk + 10 + 16 * (b % 8) : blk + qs_at;
    avx2::prefetch(qs + avx2::kPrefetchRows * 64);
    const float d =
        xs ? fp16(blk) * static_cast<float>(iq4_xs_scale(blk, static_cast<int>(b % 8))) * f : fp16(blk);
    // x16: the two halves' d * (2 l + 1) * f (exact), the first half's in the low 128-bit lane
    [[maybe_unused]] float dh[2] = {0.f, 0.f};
    if constexpr (x16) {
      for (int h = 0; h < 2; ++h) dh[h] = fp16(blk) * static_cast<float>(iq_x16_scale(blk, static_cast<int>(2 * (b % 8) + h))) * f;
    }
    const __m256i q = block_codes<T>(blk, qs, lut);
    [[maybe_unused]] const __m256i aq = _mm256_abs_epi8(q);
    for (int m = 0; m < MB; ++m) {
      const int64_t i = (m0 + m) * nb + b;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (m0 + m) * x.K + b * 32));
      const __m256i p16 = kLevels(T) ? _mm256_maddubs_epi16(aq, _mm256_sign_epi8(xv, q))
                                                : _mm256_maddubs_epi16(q, xv);
      const __m256 scale = x16 ? _mm256_set_m128(_mm_set1_ps(dh[1] * x.d[i]), _mm_set1_ps(dh[0] * x.d[i]))
                               : _mm256_set1_ps(d * x.d[i]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones)), scale, acc[m]);
      if constexpr (T == Q4Type::kQ5_0) {
        off[m] = std::fma(-16.f * d, x.s[i], off[m]);
      } else if constexpr (T == Q4Type::kQ5_1) {
        off[m] = std::fma(fp16(blk + 2), x.s[i], off[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[(m0 + m) * ldo] = avx2::hsum(acc[m]) + off[m] + bias;
}

template <Q4Type T>
void run(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
         int64_t N) {
  const int64_t row_bytes = x.K / q4_block_values(T) * q4_block_bytes(T);
  team_for(N, N * x.K * x.M >= 65536, [&](int64_t n) {
    const uint8_t* wr = w + n * row_bytes;
    const float bn = bias != nullptr ? bias[n] : 0.f;
    avx2::row_tiles(x.M, [&](auto mb, int64_t m) { row_tile<T, decltype(mb)::value>(t, x, m, wr, bn, out + n, ldo); });
  });
}

}  // namespace

void linear_q5nl_avx2(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                      int64_t ldo, int64_t N) {
  if (t == Q4Type::kQ5_0) {
    run<Q4Type::kQ5_0>(t, x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ5_1) {
    run<Q4Type::kQ5_1>(t, x, w, bias, out, ldo, N);
  } else if (q_is_xs(t)) {  // IQ4_XS and the grid types held in its layout: one body, t's levels
    run<Q4Type::kIQ4_XS>(t, x, w, bias, out, ldo, N);
  } else if (q_is_x16(t)) {  // IQ2_XS, IQ2_S and IQ1_M in the x16 layout
    run<Q4Type::kIQ2_XS>(t, x, w, bias, out, ldo, N);
  } else {
    run<Q4Type::kIQ4_NL>(t, x, w, bias, out, ldo, N);
  }
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
