// Q8_0 weight x Q8 activation GEMV/GEMM on AVX2 (see quant_kernel.h for the layout), and the AVX2
// activation quantiser that both quantised kernels (Q8_0, 4-bit) use.
//
// Per 32-value block and activation row the inner loop is five vector instructions: sign (moves
// w's sign onto x, since maddubs multiplies unsigned by signed; |w| is taken once per weight block
// and shared by every activation row), maddubs, madd, int32 -> fp32 and one FMA by the product of
// the two scales. The scales are not converted block by block: the fp16 scales of eight blocks of
// a weight row come in with one gather and are multiplied by the eight activation scales in one
// vector multiply, so the per-block FMA takes its scale from a small table. Each weight block is
// loaded and |w| taken once for up to four activation rows (M tiles), and each activation block
// serves up to four weight rows. The weight streams from memory once (34 bytes per 32 values).
//
// Batch invariance (docs/determinism.md): every output (m, n) has its own accumulator, updated
// block by block in K order with the same instructions whatever the tile shape, then one fixed
// horizontal sum; M only decides which rows share a tile, never a row's arithmetic.
#include <omp.h>

#include <cstdint>
#include <cstring>

// Headers first: inline functions they define must keep the baseline ISA.
#include "quant_kernel.h"
#include "x86_target.h"

PAGEWIRE_TARGET_PUSH("avx2,fma,f16c")

#include "avx2_util.h"

namespace pagewire::cpu {
namespace {

using avx2::fp16_strided8;
using avx2::hsum;

// Eight int32 partial sums of w . x over 32 int8 pairs. maddubs needs an unsigned operand: |w|
// (at most 127) times x with w's sign moved onto it; pairs sum to at most 2 * 127 * 127, so the
// 16-bit intermediate never saturates.
inline __m256i dot32(__m256i abs_w, __m256i w, __m256i x) {
  const __m256i p16 = _mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

// Rows [m0, m0 + MB) of x times weight rows w[0..NR) -> out[m][0..NR).
template <int MB, int NR>
void tile(const Q8Activations& x, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias, float* out,
          int64_t ldo) {
  const int64_t nb = x.K / kQ8Block, pf = avx2::kPrefetchRows * row_bytes;
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
  int64_t b = 0;
  // Eight blocks per step: one vector of combined scales per (row, weight row).
  for (; b + 8 <= nb; b += 8) {
    // Read back one at a time by broadcast loads: the load ports have room, the vector pipes
    // that the multiplies use have none (a lane permute would compete with them).
    alignas(32) float sc[NR][MB][8];
    for (int i = 0; i < NR; ++i) {
      const uint8_t* wb = w + i * row_bytes + b * kQ8BlockBytes;
      const __m256 wd = fp16_strided8<kQ8BlockBytes>(wb);
      for (int m = 0; m < MB; ++m) _mm256_store_ps(sc[i][m], _mm256_mul_ps(wd, _mm256_loadu_ps(xd[m] + b)));
    }
    for (int j = 0; j < 8; ++j) {
      __m256i xv[MB];
      for (int m = 0; m < MB; ++m) {
        xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + (b + j) * kQ8Block));
      }
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = w + i * row_bytes + (b + j) * kQ8BlockBytes;
        avx2::prefetch(blk + pf + 2);
        __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        // One load into a register: the compiler would otherwise fold the block's (often
        // line-crossing) load into both abs and sign, loading it twice.
#ifndef PAGEWIRE_X86_EMULATE
        asm("" : "+x"(wq));
#endif
        const __m256i aw = _mm256_abs_epi8(wq);
        for (int m = 0; m < MB; ++m) {
          acc[m][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(aw, wq, xv[m])), _mm256_broadcast_ss(&sc[i][m][j]),
                                      acc[m][i]);
        }
      }
    }
  }
  // The last K / 32 mod 8 blocks: the same products, scales one at a time.
  for (; b < nb; ++b) {
    for (int i = 0; i < NR; ++i) {
      const uint8_t* blk = w + i * row_bytes + b * kQ8BlockBytes;
      avx2::prefetch(blk + pf + 2);
      uint16_t dh;
      std::memcpy(&dh, blk, 2);
      const float wd = _cvtsh_ss(dh);
      const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      const __m256i aw = _mm256_abs_epi8(wq);
      for (int m = 0; m < MB; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + b * kQ8Block));
        acc[m][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(aw, wq, xv)), _mm256_set1_ps(wd * xd[m][b]), acc[m][i]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) out[(m0 + m) * ldo + i] = hsum(acc[m][i]) + (bias != nullptr ? bias[i] : 0.f);
  }
}

// All M rows times NR weight rows: tiles of four activation rows, then two, then one.
template <int NR>
void rows(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, const float* bias, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= x.M; m += 4) tile<4, NR>(x, m, w, row_bytes, bias, out, ldo);
  if (m + 2 <= x.M) {
    tile<2, NR>(x, m, w, row_bytes, bias, out, ldo);
    m += 2;
  }
  if (m < x.M) tile<1, NR>(x, m, w, row_bytes, bias, out, ldo);
}

template <int NR>
void run(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t N) {
  const int64_t row_bytes = x.K / kQ8Block * kQ8BlockBytes;
  const int64_t groups = N / NR;
  // Static schedule: each thread streams one contiguous slice of the weight.
#pragma omp parallel for schedule(static) if (N * x.K * x.M >= 65536)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = g * NR;
    rows<NR>(x, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr, out + n, ldo);
  }
  for (int64_t n = groups * NR; n < N; ++n) {
    rows<1>(x, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr, out + n, ldo);
  }
}

// |a| rounded half away from zero, exactly as std::round: trunc, then up when the (exact)
// remainder is at least one half.
inline __m256 round_half_away(__m256 a) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 mag = _mm256_andnot_ps(sign, a);
  const __m256 t = _mm256_round_ps(mag, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256 up = _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(mag, t), _mm256_set1_ps(0.5f), _CMP_GE_OQ),
                                  _mm256_set1_ps(1.f));
  return _mm256_or_ps(_mm256_add_ps(t, up), _mm256_and_ps(a, sign));
}

}  // namespace

void bf16_to_f32_avx2(const uint16_t* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(w, 16));
  }
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(out + i, &bits, 4);
  }
}

// Round to nearest even: add 0x7FFF plus the lowest kept bit, keep the high half; NaN -> 0x7FC0
// (c10::BFloat16's quiet NaN), so every value gets the scalar conversion's bits.
void f32_to_bf16_avx2(const float* x, uint16_t* out, int64_t n) {
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), qnan = _mm256_set1_epi32(0x7FC0);
  auto round8 = [&](const float* p) {
    const __m256 f = _mm256_loadu_ps(p);
    const __m256i u = _mm256_castps_si256(f);
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one))), 16);
    return _mm256_blendv_epi8(qnan, r, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_ORD_Q)));
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    // packus works within 128-bit lanes; the permute puts the 16 results back in order.
    const __m256i p = _mm256_packus_epi32(round8(x + i), round8(x + i + 8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_permute4x64_epi64(p, 0xD8));
  }
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    out[i] = x[i] != x[i] ? 0x7FC0 : static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  }
}

void quantize_rows_q8_avx2(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t nb = K / kQ8Block;
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + m * ldx + b * kQ8Block;
      __m256 f[4];
      for (int k = 0; k < 4; ++k) f[k] = _mm256_loadu_ps(v + 8 * k);
      const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, f[0]), _mm256_andnot_ps(sign, f[1])),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, f[2]), _mm256_andnot_ps(sign, f[3])));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      // The portable quantiser's arithmetic, lane for lane: same scale, same products, same rounding.
      const float amax = _mm_cvtss_f32(h);
      const float scale = amax / 127.f;
      const __m256 inv = _mm256_set1_ps(scale != 0.f ? 1.f / scale : 0.f);
      __m256i iv[4];
      for (int k = 0; k < 4; ++k) iv[k] = _mm256_cvttps_epi32(round_half_away(_mm256_mul_ps(f[k], inv)));
      // packs interleaves 128-bit lanes; the permute restores value order.
      const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
      const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + m * K + b * kQ8Block), ordered);
      d[m * nb + b] = scale;
      if (s != nullptr) {
        const __m256i t = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
        __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
        s[m * nb + b] = scale * static_cast<float>(_mm_cvtsi128_si32(u));
      }
    }
  }
}

void linear_q8_0_avx2(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                      int64_t N) {
  // One activation row: four weight rows per tile keep four independent FMA chains in flight.
  // Several rows: two weight rows, up to four activation rows (eight accumulators).
  if (x.M == 1) {
    run<4>(x, w, bias, out, ldo, N);
  } else {
    run<2>(x, w, bias, out, ldo, N);
  }
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
