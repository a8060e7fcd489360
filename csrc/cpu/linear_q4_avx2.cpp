// 4-bit weight (GGUF Q4_0 / Q4_1 / Q4_K / MXFP4) x Q8 activation GEMV/GEMM on AVX2 (layouts in
// quant4_kernel.h). Codes are unsigned 0..15, so maddubs takes them as they are (pairs at most
// 2 * 15 * 127: no 16-bit saturation; MXFP4's codes become 0..24 by one byte shuffle, a pair of
// blocks at most 4 * 24 * 127); each block's offset (Q4_0's -8 d, Q4_1's m, Q4_K's
// -dmin * min) multiplies the activation block's precomputed d * sum, eight blocks per FMA.
//
// Per-block work is kept small:
//  * Scales: the fp16 scales of eight blocks of a weight row come in with one gather (Q4_K: the
//    packed 6-bit scales and mins of a super-block are decoded with a few 32-bit operations) and
//    are multiplied by the eight activation scales in one vector multiply.
//  * Q4_0 / Q4_1 work on pairs of blocks (A, B): one register holds A's 16 code bytes in its low
//    half and B's in its high half, so one shift and two masks give [A 0..15 | B 0..15] and
//    [A 16..31 | B 16..31]. The activations are rearranged once per call to match
//    (pair_activations), so the two maddubs products add in 16 bits (at most 4 * 15 * 127) and one
//    madd, one int32 -> fp32 and one FMA finish both blocks: lanes 0-3 carry A, lanes 4-7 B.
//  * Q4_K's 32 bytes hold two whole sub-blocks (low and high nibbles): one load, one shift and two
//    masks for 64 values.
//  * Each unpacked weight block serves up to four activation rows (M tiles) while in registers.
//
// Batch invariance (docs/determinism.md): every output (m, n) has its own accumulator, updated in
// K order with the same instructions whatever the tile shape, then one fixed horizontal sum.
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

// Headers first: inline functions they define must keep the baseline ISA.
#include "quant4_kernel.h"
#include "x86_target.h"

PAGEWIRE_TARGET_PUSH("avx2,fma,f16c")

#include "avx2_util.h"

namespace pagewire::cpu {
namespace {

using avx2::fp16;
using avx2::fp16_strided8;
using avx2::hsum;

inline __m256i load256(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Eight int32 partial sums of 16 int16 pair sums.
inline __m256 widen(__m256i p16) { return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1))); }

// The pair layout of Q4_0 / Q4_1's activations: blocks 2p and 2p + 1 of a row become
// [A 0..15, B 0..15, A 16..31, B 16..31]; an odd last block stays as it is.
void pair_activations(const int8_t* q, int64_t M, int64_t K, int8_t* out) {
  const int64_t nb = K / 32;
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* src = q + m * K;
    int8_t* dst = out + m * K;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      std::memcpy(dst + b * 32, src + b * 32, 16);
      std::memcpy(dst + b * 32 + 16, src + b * 32 + 32, 16);
      std::memcpy(dst + b * 32 + 32, src + b * 32 + 16, 16);
      std::memcpy(dst + b * 32 + 48, src + b * 32 + 48, 16);
    }
    if (b < nb) std::memcpy(dst + b * 32, src + b * 32, 32);
  }
}

// Rows [m0, m0 + MB) of x (xp: their pair layout) times weight rows w[0..NR) of Q4_0 / Q4_1.
// The fp32 scale and offset of block j of a Q4_0 / Q4_1 / MXFP4 row (the offset multiplies the
// activation block's sum): Q4_0 (d, -8 d), Q4_1 (d, m), MXFP4 (2^(e-128), -12 * 2^(e-128)).
template <Q4Type T>
inline void block_scale(const uint8_t* blk, float* d, float* c) {
  if constexpr (T == Q4Type::kMXFP4) {
    *d = mxfp4_scale(blk[0]);
    *c = -kMxfp4Offset * *d;
  } else {
    *d = fp16(blk);
    *c = T == Q4Type::kQ4_0 ? -8.f * *d : fp16(blk + 2);
  }
}

// Q4_0 / Q4_1 / MXFP4 (blocks of 32 values, byte j holding values j and j + 16).
template <Q4Type T, int MB, int NR>
void tile32(const Q8SumActivations& x, const int8_t* xp, int64_t m0, const uint8_t* w, int64_t row_bytes,
            const float* bias, float* out, int64_t ldo) {
  constexpr int BB = T == Q4Type::kQ4_0 ? kQ4_0BlockBytes : T == Q4Type::kQ4_1 ? kQ4_1BlockBytes : kMxfp4BlockBytes;
  constexpr int QO = T == Q4Type::kQ4_0 ? 2 : T == Q4Type::kQ4_1 ? 4 : 1;  // codes' offset in a block
  const int64_t nb = x.K / 32, pf = avx2::kPrefetchRows * row_bytes;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  // MXFP4: nibble -> kMxfp4Values + 12 (unsigned), one byte shuffle per 32 codes.
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_setr_epi8(
      12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const auto codes = [&](__m256i v) __attribute__((always_inline)) {
    return T == Q4Type::kMXFP4 ? _mm256_shuffle_epi8(lut, v) : v;
  };
  const int8_t* xq[MB];
  const float* xd[MB];
  const float* xs[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = xp + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xs[m] = x.s + (m0 + m) * nb;
  }
  __m256 acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) acc[m][i] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; b += 8) {
    const int n8 = nb - b >= 8 ? 8 : static_cast<int>(nb - b);
    // Combined scales of these (up to) eight blocks, and their offset terms.
    __m256 sc[NR][MB];
    for (int i = 0; i < NR; ++i) {
      const uint8_t* wb = w + i * row_bytes + b * BB;
      __m256 wd, c;
      if (n8 == 8 && T != Q4Type::kMXFP4) {
        wd = fp16_strided8<BB>(wb);
        c = T == Q4Type::kQ4_0 ? _mm256_mul_ps(wd, _mm256_set1_ps(-8.f)) : fp16_strided8<BB>(wb + 2);
      } else {  // MXFP4's exponent bytes, or the row's last K / 32 mod 8 blocks, zero-padded
        alignas(32) float d8[8] = {}, c8[8] = {};
        for (int j = 0; j < n8; ++j) block_scale<T>(wb + j * BB, &d8[j], &c8[j]);
        wd = _mm256_load_ps(d8);
        c = _mm256_load_ps(c8);
      }
      for (int m = 0; m < MB; ++m) {
        __m256 xdv, xsv;
        if (n8 == 8) {
          xdv = _mm256_loadu_ps(xd[m] + b);
          xsv = _mm256_loadu_ps(xs[m] + b);
        } else {
          alignas(32) float d8[8] = {}, s8[8] = {};
          for (int j = 0; j < n8; ++j) {
            d8[j] = xd[m][b + j];
            s8[j] = xs[m][b + j];
          }
          xdv = _mm256_load_ps(d8);
          xsv = _mm256_load_ps(s8);
        }
        sc[i][m] = _mm256_mul_ps(wd, xdv);
        acc[m][i] = _mm256_fmadd_ps(c, xsv, acc[m][i]);
      }
    }
    // Pairs of blocks; a full step's four pairs unrolled so their lane selectors are constants.
    const auto pair = [&](int j) __attribute__((always_inline)) {
      const __m256i sel = _mm256_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1);
      for (int i = 0; i < NR; ++i) {
        const uint8_t* qa = w + i * row_bytes + (b + j) * BB + QO;
        avx2::prefetch(qa + pf);
        const __m256i raw = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qa))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(qa + BB)), 1);
        const __m256i lo = codes(_mm256_and_si256(raw, mask));
        const __m256i hi = codes(_mm256_and_si256(_mm256_srli_epi16(raw, 4), mask));
        for (int m = 0; m < MB; ++m) {
          const int8_t* xb = xq[m] + (b + j) * 32;
          const __m256i p16 =
              _mm256_add_epi16(_mm256_maddubs_epi16(lo, load256(xb)), _mm256_maddubs_epi16(hi, load256(xb + 32)));
          acc[m][i] = _mm256_fmadd_ps(widen(p16), _mm256_permutevar8x32_ps(sc[i][m], sel), acc[m][i]);
        }
      }
    };
    int j = 0;
    if (n8 == 8) {
      pair(0);
      pair(2);
      pair(4);
      pair(6);
      j = 8;
    } else {
      for (; j + 2 <= n8; j += 2) pair(j);
    }
    if (j < n8) {  // an odd last block, activations in natural order
      const __m256i sel = _mm256_set1_epi32(j);
      for (int i = 0; i < NR; ++i) {
        const uint8_t* qa = w + i * row_bytes + (b + j) * BB + QO;
        avx2::prefetch(qa + pf);
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qa));
        const __m256i q = codes(
            _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1), mask));
        for (int m = 0; m < MB; ++m) {
          const __m256i p16 = _mm256_maddubs_epi16(q, load256(xq[m] + (b + j) * 32));
          acc[m][i] = _mm256_fmadd_ps(widen(p16), _mm256_permutevar8x32_ps(sc[i][m], sel), acc[m][i]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) out[(m0 + m) * ldo + i] = hsum(acc[m][i]) + (bias != nullptr ? bias[i] : 0.f);
  }
}

// The eight 6-bit scales (or mins) of a Q4_K super-block as fp32, from their two 32-bit halves.
inline __m256 six_bit8(uint32_t lo, uint32_t hi) {
  const uint64_t v = lo | (static_cast<uint64_t>(hi) << 32);
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(v))));
}

// The same for Q4_K's 256-value super-blocks (activations in natural order).
template <int MB, int NR>
void tile_k(const Q8SumActivations& x, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias, float* out,
            int64_t ldo) {
  const int64_t nb = x.K / 32, nsb = x.K / kQ4_KBlock, pf = avx2::kPrefetchRows * row_bytes;
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
    // Combined scales, read back one at a time by broadcast loads (no shuffle uops).
    alignas(32) float sc[NR][MB][8];
    for (int i = 0; i < NR; ++i) {
      const uint8_t* blk = w + i * row_bytes + s * kQ4_KBlockBytes;
      // 12 bytes of packed scales/mins as three words a, b, c (q4_k_scale_min's rule, four
      // sub-blocks per word): sub-blocks 0-3 are the low 6 bits of a (scales) and b (mins);
      // sub-blocks 4-7 take their low 4 bits from c and their top 2 from a's / b's top bits.
      uint32_t a, bw, c;
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
    }
    for (int h = 0; h < 4; ++h) {
      for (int i = 0; i < NR; ++i) {
        const uint8_t* qh = w + i * row_bytes + s * kQ4_KBlockBytes + 16 + 32 * h;
        avx2::prefetch(qh + pf);
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
        const __m256i lo = _mm256_and_si256(raw, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        for (int m = 0; m < MB; ++m) {
          const int8_t* xb = xq[m] + (s * 8 + 2 * h) * 32;
          acc[m][i] = _mm256_fmadd_ps(widen(_mm256_maddubs_epi16(lo, load256(xb))),
                                      _mm256_broadcast_ss(&sc[i][m][2 * h]), acc[m][i]);
          acc[m][i] = _mm256_fmadd_ps(widen(_mm256_maddubs_epi16(hi, load256(xb + 32))),
                                      _mm256_broadcast_ss(&sc[i][m][2 * h + 1]), acc[m][i]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) out[(m0 + m) * ldo + i] = hsum(acc[m][i]) + (bias != nullptr ? bias[i] : 0.f);
  }
}

template <Q4Type T, int MB, int NR>
inline void tile(const Q8SumActivations& x, const int8_t* xp, int64_t m0, const uint8_t* w, int64_t row_bytes,
                 const float* bias, float* out, int64_t ldo) {
  if constexpr (T == Q4Type::kQ4_K) {
    tile_k<MB, NR>(x, m0, w, row_bytes, bias, out, ldo);
  } else {
    tile32<T, MB, NR>(x, xp, m0, w, row_bytes, bias, out, ldo);
  }
}

// All M rows times NR weight rows: tiles of four activation rows, then two, then one.
template <Q4Type T, int NR>
void rows(const Q8SumActivations& x, const int8_t* xp, const uint8_t* w, int64_t row_bytes, const float* bias,
          float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= x.M; m += 4) tile<T, 4, NR>(x, xp, m, w, row_bytes, bias, out, ldo);
  if (m + 2 <= x.M) {
    tile<T, 2, NR>(x, xp, m, w, row_bytes, bias, out, ldo);
    m += 2;
  }
  if (m < x.M) tile<T, 1, NR>(x, xp, m, w, row_bytes, bias, out, ldo);
}

template <Q4Type T, int NR>
void run_nr(const Q8SumActivations& x, const int8_t* xp, const uint8_t* w, const float* bias, float* out, int64_t ldo,
            int64_t N) {
  const int64_t row_bytes = x.K / q4_block_values(T) * q4_block_bytes(T);
  const int64_t groups = N / NR;
  // Static schedule: each thread streams one contiguous slice of the weight.
#pragma omp parallel for schedule(static) if (N * x.K * x.M >= 65536)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = g * NR;
    rows<T, NR>(x, xp, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr, out + n, ldo);
  }
  for (int64_t n = groups * NR; n < N; ++n) {
    rows<T, 1>(x, xp, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr, out + n, ldo);
  }
}

template <Q4Type T>
void run(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t N) {
  const int8_t* xp = x.q;
  if constexpr (T != Q4Type::kQ4_K) {
    // Per calling thread (the engine thread), reused across calls.
    thread_local std::vector<int8_t> paired;
    if (static_cast<int64_t>(paired.size()) < x.M * x.K) paired.resize(x.M * x.K);
    pair_activations(x.q, x.M, x.K, paired.data());
    xp = paired.data();
  }
  // One activation row: four weight rows per tile keep four independent FMA chains in flight.
  // Several rows: two weight rows, up to four activation rows (eight accumulators).
  if (x.M == 1) {
    run_nr<T, 4>(x, xp, w, bias, out, ldo, N);
  } else {
    run_nr<T, 2>(x, xp, w, bias, out, ldo, N);
  }
}

}  // namespace

void linear_q4_avx2(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                    int64_t N) {
  switch (t) {
    case Q4Type::kQ4_0:
      run<Q4Type::kQ4_0>(x, w, bias, out, ldo, N);
      break;
    case Q4Type::kQ4_1:
      run<Q4Type::kQ4_1>(x, w, bias, out, ldo, N);
      break;
    case Q4Type::kQ4_K:
      run<Q4Type::kQ4_K>(x, w, bias, out, ldo, N);
      break;
    case Q4Type::kQ5_K:
    case Q4Type::kQ6_K:
      linear_k56_avx2(t, x, w, bias, out, ldo, N);
      break;
    case Q4Type::kMXFP4:
      run<Q4Type::kMXFP4>(x, w, bias, out, ldo, N);
      break;
    case Q4Type::kQ5_0:
    case Q4Type::kQ5_1:
    case Q4Type::kIQ4_NL:
    case Q4Type::kIQ4_XS:
    case Q4Type::kIQ3_XXS:
    case Q4Type::kIQ3_S:
    case Q4Type::kIQ2_XXS:
    case Q4Type::kIQ1_S:
    case Q4Type::kIQ2_XS:
    case Q4Type::kIQ2_S:
    case Q4Type::kIQ1_M:
      linear_q5nl_avx2(t, x, w, bias, out, ldo, N);  // (their row layout: a weight's last N % 8 rows)
      break;
    case Q4Type::kQ2_K:
      linear_q2k_avx2(x, w, bias, out, ldo, N);  // (as above)
      break;
    case Q4Type::kQ3_K:
      linear_q3k_avx2(x, w, bias, out, ldo, N);  // (as above)
      break;
  }
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
