// 4-bit weight (GGUF Q4_0 / Q4_1 / Q4_K) x Q8 activation GEMV/GEMM on AVX2 (layouts in
// quant4_kernel.h). Each 32-value weight sub-block is unpacked from 16 bytes of nibbles to 32
// unsigned bytes (and + shift), multiplied with the activation block's 32 int8 by maddubs/madd
// (unsigned x signed, pairs at most 2 * 15 * 127: no 16-bit saturation), converted once and
// accumulated with one FMA by (weight scale x activation scale); the block's offset (Q4_0's -8 d,
// Q4_1's m, Q4_K's -dmin * min) multiplies the activation block's precomputed sum, a scalar FMA.
// The weight streams from memory once (18-20 bytes per 32 values, 28-31% of bf16's bytes) and each
// unpacked block serves every activation row while it is in registers.
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>

// Headers first: inline functions they define must keep the baseline ISA.
#include "quant4_kernel.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "avx2_util.h"

namespace pagewire::cpu {
namespace {

constexpr int kPrefetchRows = 8;

using avx2::hsum;

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Eight int32 partial sums of q . x over 32 pairs (q unsigned 0..15, x signed).
inline __m256i dot32(__m256i q, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
}

// Q4_0 / Q4_1: the 32 codes of a 16-byte block, value j in byte j (low nibbles first).
inline __m256i unpack16(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// MB activation rows from m0 times NR weight rows, 32-value blocks (Q4_0, Q4_1).
template <Q4Type T, int MB, int NR>
inline void block32(const Q8SumActivations& x, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias,
                    float* out, int64_t ldo, bool prefetch) {
  constexpr int BB = T == Q4Type::kQ4_0 ? kQ4_0BlockBytes : kQ4_1BlockBytes;
  const int64_t nb = x.K / 32;
  __m256 acc[MB][NR];
  float off[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) {
      acc[m][i] = _mm256_setzero_ps();
      off[m][i] = 0.f;
    }
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i xq[MB];
    float xd[MB], xs[MB];
    for (int m = 0; m < MB; ++m) {
      xq[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (m0 + m) * x.K + b * 32));
      xd[m] = x.d[(m0 + m) * nb + b];
      xs[m] = x.s[(m0 + m) * nb + b];
    }
    for (int i = 0; i < NR; ++i) {
      const uint8_t* blk = w + i * row_bytes + b * BB;
      if (prefetch && (b & 3) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchRows * row_bytes), _MM_HINT_T0);
      }
      const float d = fp16(blk);
      const float c = T == Q4Type::kQ4_0 ? -8.f * d : fp16(blk + 2);
      const __m256i q = unpack16(blk + (T == Q4Type::kQ4_0 ? 2 : 4));
      for (int m = 0; m < MB; ++m) {
        acc[m][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(q, xq[m])), _mm256_set1_ps(d * xd[m]), acc[m][i]);
        off[m][i] += c * xs[m];
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) {
      out[(m0 + m) * ldo + i] = hsum(acc[m][i]) + off[m][i] + (bias != nullptr ? bias[i] : 0.f);
    }
  }
}

// The same for Q4_K's 256-value super-blocks: scales and mins unpacked once per super-block and
// row, then four 32-byte loads give the eight 32-value sub-blocks (low, then high nibbles).
template <int MB, int NR>
inline void block_k(const Q8SumActivations& x, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias,
                    float* out, int64_t ldo, bool prefetch) {
  const int64_t nb = x.K / 32, nsb = x.K / kQ4_KBlock;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256 acc[MB][NR];
  float off[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) {
      acc[m][i] = _mm256_setzero_ps();
      off[m][i] = 0.f;
    }
  }
  for (int64_t s = 0; s < nsb; ++s) {
    for (int i = 0; i < NR; ++i) {
      const uint8_t* blk = w + i * row_bytes + s * kQ4_KBlockBytes;
      if (prefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchRows * row_bytes), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchRows * row_bytes + 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchRows * row_bytes + 128), _MM_HINT_T0);
      }
      const float d = fp16(blk), dmin = fp16(blk + 2);
      float a[8], c[8];
      for (int j = 0; j < 8; ++j) {
        uint8_t sc, mn;
        q4_k_scale_min(j, blk + 4, &sc, &mn);
        a[j] = d * sc;
        c[j] = -(dmin * mn);
      }
      for (int h = 0; h < 4; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * h));
        const __m256i q[2] = {_mm256_and_si256(raw, mask), _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask)};
        for (int e = 0; e < 2; ++e) {
          const int j = 2 * h + e;
          const int64_t b = s * 8 + j;
          for (int m = 0; m < MB; ++m) {
            const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (m0 + m) * x.K + b * 32));
            const float xd = x.d[(m0 + m) * nb + b], xs = x.s[(m0 + m) * nb + b];
            acc[m][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(q[e], xq)), _mm256_set1_ps(a[j] * xd), acc[m][i]);
            off[m][i] += c[j] * xs;
          }
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) {
      out[(m0 + m) * ldo + i] = hsum(acc[m][i]) + off[m][i] + (bias != nullptr ? bias[i] : 0.f);
    }
  }
}

template <Q4Type T, int MB, int NR>
inline void block(const Q8SumActivations& x, int64_t m0, const uint8_t* w, int64_t row_bytes, const float* bias,
                  float* out, int64_t ldo, bool prefetch) {
  if constexpr (T == Q4Type::kQ4_K) {
    block_k<MB, NR>(x, m0, w, row_bytes, bias, out, ldo, prefetch);
  } else {
    block32<T, MB, NR>(x, m0, w, row_bytes, bias, out, ldo, prefetch);
  }
}

template <Q4Type T, int NR>
inline void rows_block(const Q8SumActivations& x, const uint8_t* w, int64_t row_bytes, const float* bias, float* out,
                       int64_t ldo) {
  int64_t m = 0;
  for (; m + 2 <= x.M; m += 2) block<T, 2, NR>(x, m, w, row_bytes, bias, out, ldo, m == 0);
  if (m < x.M) block<T, 1, NR>(x, m, w, row_bytes, bias, out, ldo, m == 0);
}

template <Q4Type T>
void run(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t N) {
  constexpr int NR = 4;
  const int64_t row_bytes = x.K / q4_block_values(T) * q4_block_bytes(T);
  const int64_t blocks = N / NR;
  // Static schedule: each thread streams one contiguous slice of the weight.
#pragma omp parallel for schedule(static) if (blocks * x.K * x.M >= 65536)
  for (int64_t bi = 0; bi < blocks; ++bi) {
    const int64_t n = bi * NR;
    rows_block<T, NR>(x, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr, out + n, ldo);
  }
  for (int64_t n = blocks * NR; n < N; ++n) {
    rows_block<T, 1>(x, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr, out + n, ldo);
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
  }
}

}  // namespace pagewire::cpu

#pragma GCC pop_options
