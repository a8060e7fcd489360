// Q8_0 weight x Q8 activation GEMV/GEMM on AVX-512 VNNI (Isa::kAvx512 and better; layout in
// quant_kernel.h): Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4/5.
//
// One zmm holds two consecutive 32-value blocks, so the inner step covers 64 values: one vpdpbusd
// (four u8 x s8 products summed per int32 lane), one int32 -> fp32 and one FMA by the two blocks'
// combined scales, against the AVX2 kernel's five instructions per 32 values.
//
// vpdpbusd multiplies unsigned by signed bytes. The activations are signed, so they go in offset
// by 128 (x ^ 0x80 is x + 128 as an unsigned byte, one xor per activation block shared by every
// weight row), and each int32 lane starts from -128 * (the sum of its four weights), computed once
// per weight block with a vpdpbusd against ones and shared by every activation row. The int32
// result is then exactly sum x * w, as in the AVX2 kernel (|x| <= 127 from the quantiser, so no
// lane can overflow).
//
// Scales: the fp16 scales of eight blocks of a weight row are converted in one step and multiplied
// by the activation row's eight scales; one permute per block pair then spreads a pair's two
// products over the low and high eight lanes.
//
// Batch invariance (docs/determinism.md): every output (m, n) has its own accumulator, updated pair
// by pair in K order with the same instructions whatever the tile shape, then one fixed horizontal
// sum; M only decides which rows share a tile.
#include <omp.h>

#include <cstdint>
#include <cstring>

// Headers first: inline functions they define must keep the baseline ISA.
#include "quant_kernel.h"
#include "x86_target.h"

// GCC 12's own intrinsic headers trip -Wmaybe-uninitialized (the _mm256_undefined_* idiom).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
PAGEWIRE_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

namespace pagewire::cpu {
namespace {

constexpr int kPrefetchRows = 8;  // as the AVX2 kernel: weight rows ahead, at the offset being read

inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// The fp16 scales at p, p + 34, ..., p + 7 * 34 (eight consecutive blocks of a row) as fp32.
inline __m256 scales8(const uint8_t* p) {
  uint16_t h[8];
  for (int j = 0; j < 8; ++j) std::memcpy(&h[j], p + j * kQ8BlockBytes, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

// Two blocks' 64 weight bytes; the 2-byte scale between them is squeezed out by a permute of the
// two 32-byte halves (a masked load could not skip it).
inline __m512i load_pair(const uint8_t* blk) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kQ8BlockBytes + 2));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// -128 * (sum of each lane's four weights): the start that cancels the activations' +128 offset.
inline __m512i offset_start(__m512i w) {
  const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), w);
  return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7));
}

inline float hsum16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [m0, m0 + MB) of x times weight rows w[0..NR) -> out[m][0..NR).
template <int MB, int NR>
void tile(const Q8Activations& x, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias, float* out,
          int64_t ldo) {
  const int64_t nb = x.K / kQ8Block, pf = kPrefetchRows * row_bytes;
  const int8_t* xq[MB];
  const float* xd[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
  }
  const __m512i bias128 = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) acc[m][i] = _mm512_setzero_ps();
  }
  // Lane index vectors that spread products p and p + 1 of eight over the low and high halves.
  __m512i spread[4];
  for (int p = 0; p < 4; ++p) {
    spread[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * p)), _mm256_set1_epi32(2 * p + 1), 1);
  }
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    __m512 sc[NR][MB];  // eight combined scales in the low half
    for (int i = 0; i < NR; ++i) {
      const __m256 wd = scales8(w + i * row_bytes + b * kQ8BlockBytes);
      for (int m = 0; m < MB; ++m) sc[i][m] = _mm512_castps256_ps512(_mm256_mul_ps(wd, _mm256_loadu_ps(xd[m] + b)));
    }
    for (int p = 0; p < 4; ++p) {
      const int64_t bp = b + 2 * p;
      __m512i xv[MB];
      for (int m = 0; m < MB; ++m) {
        xv[m] = _mm512_xor_si512(_mm512_loadu_si512(xq[m] + bp * kQ8Block), bias128);
      }
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = w + i * row_bytes + bp * kQ8BlockBytes;
        prefetch(blk + pf);
        prefetch(blk + pf + 64);
        const __m512i wq = load_pair(blk);
        const __m512i start = offset_start(wq);
        for (int m = 0; m < MB; ++m) {
          const __m512i dot = _mm512_dpbusd_epi32(start, xv[m], wq);
          acc[m][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(spread[p], sc[i][m]), acc[m][i]);
        }
      }
    }
  }
  // The last K / 32 mod 8 blocks: pairs with their scales one at a time, then a lone block in the
  // low half (the high half's weights and activations are zero, so it adds exactly zero).
  for (; b < nb; b += 2) {
    const bool pair = b + 1 < nb;
    __m512i xv[MB];
    for (int m = 0; m < MB; ++m) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + b * kQ8Block));
      const __m256i hi = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + (b + 1) * kQ8Block))
                              : _mm256_setzero_si256();
      xv[m] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), bias128);
    }
    for (int i = 0; i < NR; ++i) {
      const uint8_t* blk = w + i * row_bytes + b * kQ8BlockBytes;
      uint16_t dh[2] = {0, 0};
      std::memcpy(&dh[0], blk, 2);
      if (pair) std::memcpy(&dh[1], blk + kQ8BlockBytes, 2);
      const float wd0 = _cvtsh_ss(dh[0]), wd1 = _cvtsh_ss(dh[1]);
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      const __m256i hi =
          pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kQ8BlockBytes + 2)) : _mm256_setzero_si256();
      const __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      const __m512i start = offset_start(wq);
      for (int m = 0; m < MB; ++m) {
        const __m512 s = _mm512_castpd_ps(_mm512_insertf64x4(
            _mm512_castps_pd(_mm512_set1_ps(wd0 * xd[m][b])),
            _mm256_castps_pd(_mm256_set1_ps(pair ? wd1 * xd[m][b + 1] : 0.f)), 1));
        const __m512i dot = _mm512_dpbusd_epi32(start, xv[m], wq);
        acc[m][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[m][i]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) out[(m0 + m) * ldo + i] = hsum16(acc[m][i]) + (bias != nullptr ? bias[i] : 0.f);
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

}  // namespace

void linear_q8_0_avx512(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                        int64_t N) {
  constexpr int NR = 4;  // 4 x 4 accumulators at most: half of the 32 zmm registers
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

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
