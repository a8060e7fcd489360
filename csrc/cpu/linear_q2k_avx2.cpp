// Q2_K weights in GGUF's row layout x Q8 activations on AVX2 (layout in quant4_kernel.h);
// linear_q4_avx2 and linear_q4_avx512 call it. On x86 a weight of eight rows or more is interleaved
// at load and runs through the x8 kernel (x8k_q2_body.h), so this serves a weight's last N % 8 rows
// and weights of fewer than eight: it is kept simple, one 32-value block at a time.
//
// Per block (bits 2j..2j+1 of one 32-byte run of qs, so one shift and a mask give its 32 codes in
// natural order), per activation row: one maddubs (codes 0..3, no saturation) and one madd by the
// two 16-value halves' 4-bit scales (halves 0..7 and 8..15 of the 16-bit lanes) give the scaled dot
// in eight int32 lanes; one maddubs of ones and one madd give the activation codes' sums by fours,
// times the halves' mins; then an FMA each by d * xd and -dmin * xd.
//
// Batch invariance (docs/determinism.md): every output (m, n) has its own accumulators, updated in
// K order with the same instructions whatever the tile of activation rows, then one fixed
// horizontal sum.
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

// Weight row wr times activation rows [m0, m0 + MB) -> out[m * ldo].
template <int MB>
void row_tile(const Q8SumActivations& x, int64_t m0, const uint8_t* wr, float bias, float* out, int64_t ldo) {
  const int64_t nb = x.K / 32;
  const __m256i three = _mm256_set1_epi8(3), ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wr + (b / 8) * kQ2_KBlockBytes;
    const int bb = static_cast<int>(b % 8), n = bb / 4, j = bb % 4;
    if (bb == 0) avx2::prefetch(blk + avx2::kPrefetchRows * 64);
    const __m128i shift = _mm_cvtsi32_si128(2 * j);
    const __m256i codes =
        _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * n)), shift),
                         three);
    const int s0 = blk[2 * bb], s1 = blk[2 * bb + 1];  // the halves' scale (low) and min (high) nibbles
    const __m256i sc = _mm256_setr_m128i(_mm_set1_epi16(static_cast<int16_t>(s0 & 15)),
                                         _mm_set1_epi16(static_cast<int16_t>(s1 & 15)));
    const __m256i mn = _mm256_setr_m128i(_mm_set1_epi32(s0 >> 4), _mm_set1_epi32(s1 >> 4));
    const float d = fp16(blk + 80), dmin = fp16(blk + 82);
    for (int m = 0; m < MB; ++m) {
      const int64_t i = (m0 + m) * nb + b;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (m0 + m) * x.K + b * 32));
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xv), sc);
      const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, xv), ones16);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * x.d[i]), acc[m]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(sums, mn)), _mm256_set1_ps(-dmin * x.d[i]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[(m0 + m) * ldo] = avx2::hsum(acc[m]) + bias;
}

}  // namespace

void linear_q2k_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                     int64_t N) {
  const int64_t row_bytes = x.K / kQ4_KBlock * kQ2_KBlockBytes;
  team_for(N, N * x.K * x.M >= 65536, [&](int64_t n) {
    const uint8_t* wr = w + n * row_bytes;
    const float bn = bias != nullptr ? bias[n] : 0.f;
    avx2::row_tiles(x.M, [&](auto mb, int64_t m) { row_tile<decltype(mb)::value>(x, m, wr, bn, out + n, ldo); });
  });
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
