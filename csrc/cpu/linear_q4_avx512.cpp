// 4-bit weight (GGUF Q4_0 / Q4_1 / Q4_K / MXFP4) x Q8 activation GEMV/GEMM on AVX-512 VNNI (Isa::kAvx512
// and better; layouts in quant4_kernel.h): Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4/5.
//
// One zmm holds 64 unpacked codes, two 32-value blocks side by side, against the activations' 64
// bytes of the same two blocks in their natural order: one vpdpbusd per block pair and activation
// row (lanes 0-7 sum block A's products, lanes 8-15 block B's), one int32 -> fp32 and one FMA by
// the two blocks' combined scales, spread over the low and high eight lanes by one permute.
// The codes are unsigned 0..15 and the activations signed, which is exactly vpdpbusd's u8 x s8:
// no offset or sign trick (each lane at most 4 * 15 * 127; MXFP4's codes become kMxfp4Values + 12,
// 0..24, by one byte shuffle, with the -12 in the block's offset term). Each block's offset (Q4_0's -8 d,
// Q4_1's m, Q4_K's -dmin * min) multiplies the activation block's precomputed d * sum, eight
// blocks per masked FMA into the low eight lanes, as in the AVX2 kernel.
//
// Unpacking, with activations in natural order (no rearranged copy, unlike the AVX2 kernel):
//  * Q4_0 / Q4_1: block A's 16 code bytes are broadcast to the two low 128-bit lanes and block
//    B's to the two high ones (two broadcast loads); one variable shift moves lanes 1 and 3 down
//    by a nibble and one mask keeps four bits: [A 0..15 | A 16..31 | B 0..15 | B 16..31].
//  * Q4_K: a chunk's 32 bytes hold sub-blocks 2c (low nibbles) and 2c + 1 (high): one 256-bit
//    broadcast load, the same shift of the high half and mask give the 64 values in order.
//  * Each unpacked weight pair serves up to four activation rows (M tiles) while in registers.
// Scales: eight blocks' fp16 scales (Q4_K: a super-block's packed 6-bit scales and mins) are
// converted in one step and multiplied by the activation row's eight scales.
//
// Batch invariance (docs/determinism.md): every output (m, n) has its own accumulator, updated
// pair by pair in K order with the same instructions whatever the tile shape, then one fixed
// horizontal sum; M only decides which rows share a tile.
#include <omp.h>

#include <cstdint>
#include <cstring>

// Headers first: inline functions they define must keep the baseline ISA.
#include "quant4_kernel.h"
#include "x86_target.h"

// GCC 12's own intrinsic headers trip -Wmaybe-uninitialized (the _mm256_undefined_* idiom).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
PAGEWIRE_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

// avx2_util.h is not included: its inline functions have external linkage, and a copy compiled
// here for AVX-512 could be the one the linker keeps for the AVX2 kernels.
namespace pagewire::cpu {
namespace {

constexpr int kPrefetchRows = 8;  // as the other kernels: weight rows ahead, at the offset being read

// Always inlined: a call left out of line (in the pair lambda, GCC 12 kept it so) is judged free of
// side effects and dropped, prefetch and all.
__attribute__((always_inline)) inline void prefetch(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The fp16 numbers at p, p + Stride, ..., p + 7 * Stride (eight consecutive blocks of a row) as fp32.
template <int Stride>
inline __m256 fp16_strided8(const uint8_t* p) {
  uint16_t h[8];
  for (int j = 0; j < 8; ++j) std::memcpy(&h[j], p + j * Stride, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

// The eight 6-bit scales (or mins) of a Q4_K super-block as fp32, from their two 32-bit halves.
inline __m256 six_bit8(uint32_t lo, uint32_t hi) {
  const uint64_t v = lo | (static_cast<uint64_t>(hi) << 32);
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(v))));
}

inline __m512 widen(__m256 v) { return _mm512_castps256_ps512(v); }  // upper lanes unused

inline float hsum16(__m512 v) {
  const __m256 h =
      _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <Q4Type T>
constexpr int kBlockBytes = T == Q4Type::kQ4_0 ? kQ4_0BlockBytes : T == Q4Type::kQ4_1 ? kQ4_1BlockBytes
                                                                                       : kMxfp4BlockBytes;
template <Q4Type T>
constexpr int kCodeOffset = T == Q4Type::kQ4_0 ? 2 : T == Q4Type::kQ4_1 ? 4 : 1;  // codes' offset in a block

// The fp32 scale and offset of a Q4_0 / Q4_1 / MXFP4 block (quant4_kernel.h).
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

// The 64 codes of blocks b + 2p and b + 2p + 1 of a weight row (b a multiple of 8), in the
// activations' natural order; only block b + 2p when `lone` (the high 32 codes are then zero).
// shift: the 64-bit lanes' shift counts that bring the high nibbles down (shift_counts<T>).
template <Q4Type T>
inline __m512i shift_counts() {
  // Q4_0 / Q4_1: 128-bit lanes [A, A, B, B], the second and fourth shifted; Q4_K: [raw, raw], the
  // second half shifted.
  return T == Q4Type::kQ4_K ? _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0) : _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
}

template <Q4Type T>
inline __m512i unpack_pair(const uint8_t* row, int64_t b, int p, bool lone, __m512i shift, __m512i mask) {
  __m512i raw;
  if constexpr (T == Q4Type::kQ4_K) {
    const uint8_t* qc = row + (b / 8) * kQ4_KBlockBytes + 16 + 32 * p;
    raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qc)));
  } else {
    const uint8_t* qa = row + (b + 2 * p) * kBlockBytes<T> + kCodeOffset<T>;
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qa));
    if (lone) {
      raw = _mm512_maskz_broadcast_i32x4(0x00FF, a);
    } else {
      const __m128i bq = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qa + kBlockBytes<T>));
      raw = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(a), 0xFF00, bq);
    }
  }
  const __m512i q = _mm512_and_si512(_mm512_srlv_epi64(raw, shift), mask);
  if constexpr (T == Q4Type::kMXFP4) {  // nibble -> kMxfp4Values + 12 (unsigned), one byte shuffle
    const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    return _mm512_shuffle_epi8(lut, q);
  }
  return q;
}

// Rows [m0, m0 + MB) of x times weight rows w[0..NR) -> out[m][0..NR).
template <Q4Type T, int MB, int NR>
void tile(const Q8SumActivations& x, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias, float* out,
          int64_t ldo) {
  const int64_t nb = x.K / 32, pf = kPrefetchRows * row_bytes;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512i shift = shift_counts<T>();
  const int8_t* xq[MB];
  const float* xd[MB];
  const float* xs[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xs[m] = x.s + (m0 + m) * nb;
  }
  __m512 acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) acc[m][i] = _mm512_setzero_ps();
  }
  // Lane index vectors that spread products 2p and 2p + 1 of eight over the low and high halves.
  __m512i spread[4];
  for (int p = 0; p < 4; ++p) {
    spread[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * p)), _mm256_set1_epi32(2 * p + 1), 1);
  }
  for (int64_t b = 0; b < nb; b += 8) {
    const int n8 = nb - b >= 8 ? 8 : static_cast<int>(nb - b);  // Q4_K: always 8
    // Combined scales of these (up to) eight blocks in the low eight lanes, and their offset terms.
    __m512 sc[NR][MB];
    for (int i = 0; i < NR; ++i) {
      const uint8_t* row = w + i * row_bytes;
      __m256 wd, c;
      if constexpr (T == Q4Type::kQ4_K) {
        const uint8_t* blk = row + (b / 8) * kQ4_KBlockBytes;
        // 12 bytes of packed scales/mins as three words a, b, c (q4_k_scale_min's rule, four
        // sub-blocks per word): sub-blocks 0-3 are the low 6 bits of a (scales) and b (mins);
        // sub-blocks 4-7 take their low 4 bits from c and their top 2 from a's / b's top bits.
        uint32_t a, bw, cw;
        std::memcpy(&a, blk + 4, 4);
        std::memcpy(&bw, blk + 8, 4);
        std::memcpy(&cw, blk + 12, 4);
        const __m256 scales = six_bit8(a & 0x3F3F3F3Fu, (cw & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u));
        const __m256 mins = six_bit8(bw & 0x3F3F3F3Fu, ((cw >> 4) & 0x0F0F0F0Fu) | ((bw >> 2) & 0x30303030u));
        wd = _mm256_mul_ps(scales, _mm256_set1_ps(fp16(blk)));
        c = _mm256_mul_ps(mins, _mm256_set1_ps(-fp16(blk + 2)));
      } else {
        constexpr int BB = kBlockBytes<T>;
        const uint8_t* wb = row + b * BB;
        if (n8 == 8 && T != Q4Type::kMXFP4) {
          wd = fp16_strided8<BB>(wb);
          c = T == Q4Type::kQ4_0 ? _mm256_mul_ps(wd, _mm256_set1_ps(-8.f)) : fp16_strided8<BB>(wb + 2);
        } else {  // MXFP4's exponent bytes, or the row's last K / 32 mod 8 blocks, zero-padded
          alignas(32) float d8[8] = {}, c8[8] = {};
          for (int j = 0; j < n8; ++j) block_scale<T>(wb + j * BB, &d8[j], &c8[j]);
          wd = _mm256_load_ps(d8);
          c = _mm256_load_ps(c8);
        }
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
        sc[i][m] = widen(_mm256_mul_ps(wd, xdv));
        acc[m][i] = _mm512_mask3_fmadd_ps(widen(c), widen(xsv), acc[m][i], 0x00FF);
      }
    }
    // Pair p: blocks b + 2p and b + 2p + 1 (or b + 2p alone, its activations' high half zero).
    const auto pair = [&](int p, bool lone) __attribute__((always_inline)) {
      __m512i xv[MB];
      for (int m = 0; m < MB; ++m) {
        const int8_t* xb = xq[m] + (b + 2 * p) * 32;
        xv[m] = lone ? _mm512_inserti64x4(_mm512_setzero_si512(),
                                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)), 0)
                     : _mm512_loadu_si512(xb);
      }
      for (int i = 0; i < NR; ++i) {
        const uint8_t* row = w + i * row_bytes;
        const int64_t at = T == Q4Type::kQ4_K ? (b / 8) * kQ4_KBlockBytes + 16 + 32 * p : (b + 2 * p) * kBlockBytes<T>;
        prefetch(row + at + pf);
        const __m512i wq = unpack_pair<T>(row, b, p, lone, shift, mask);
        for (int m = 0; m < MB; ++m) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xv[m]);
          acc[m][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(spread[p], sc[i][m]), acc[m][i]);
        }
      }
    };
    if (n8 == 8) {  // unrolled, so the lane selectors are constants
      pair(0, false);
      pair(1, false);
      pair(2, false);
      pair(3, false);
    } else {  // Q4_0 / Q4_1's last blocks: pairs, then perhaps a lone block
      int j = 0;
      for (; j + 2 <= n8; j += 2) pair(j / 2, false);
      if (j < n8) pair(j / 2, true);
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) out[(m0 + m) * ldo + i] = hsum16(acc[m][i]) + (bias != nullptr ? bias[i] : 0.f);
  }
}

// All M rows times NR weight rows: tiles of four activation rows, then two, then one.
template <Q4Type T, int NR>
void rows(const Q8SumActivations& x, const uint8_t* w, int64_t row_bytes, const float* bias, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= x.M; m += 4) tile<T, 4, NR>(x, m, w, row_bytes, bias, out, ldo);
  if (m + 2 <= x.M) {
    tile<T, 2, NR>(x, m, w, row_bytes, bias, out, ldo);
    m += 2;
  }
  if (m < x.M) tile<T, 1, NR>(x, m, w, row_bytes, bias, out, ldo);
}

template <Q4Type T>
void run(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t N) {
  constexpr int NR = 4;  // 4 x 4 accumulators at most: half of the 32 zmm registers
  const int64_t row_bytes = x.K / q4_block_values(T) * q4_block_bytes(T);
  const int64_t groups = N / NR;
  // Static schedule: each thread streams one contiguous slice of the weight.
#pragma omp parallel for schedule(static) if (N * x.K * x.M >= 65536)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = g * NR;
    rows<T, NR>(x, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr, out + n, ldo);
  }
  for (int64_t n = groups * NR; n < N; ++n) {
    rows<T, 1>(x, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr, out + n, ldo);
  }
}

}  // namespace

void linear_q4_avx512(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                      int64_t ldo, int64_t N) {
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
      linear_k56_avx512(t, x, w, bias, out, ldo, N);
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
