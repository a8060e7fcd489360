// Small-batch bf16 GEMV/GEMM for CPU decode (x [M, K] @ w[N, K]^T) on AVX512-BF16: the weight
// streams from memory once while each of its cache lines is reused by all M rows of x.
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "linear_kernel.h"
#include "team_kernel.h"
#include "x86_target.h"

// GCC 12's own intrinsic headers trip -Wmaybe-uninitialized (the _mm256_undefined_* idiom).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
PAGEWIRE_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx512bf16,fma")

#include "bf16_avx512.h"

namespace pagewire::cpu {
namespace {

constexpr int kPrefetchRows = 8;

inline __m512bh load_bf16x32(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// One block of NR weight rows against MB rows of x: MB * NR accumulators, each weight vector
// loaded once per 32 k and reused by every x row.
template <int MB, int NR>
inline void block(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const uint16_t* bias, uint16_t* out,
                  int64_t ldo) {
  __m512 acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int i = 0; i < NR; ++i) acc[m][i] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (K - k)) - 1);
    __m512bh wv[NR];
    for (int i = 0; i < NR; ++i) {
      wv[i] = load_bf16x32(w + i * K + k, mask);
      // The same line kPrefetchRows rows further on: a few blocks ahead of the loads, so DRAM
      // latency stays hidden however much compute the M rows add per line.
      _mm_prefetch(reinterpret_cast<const char*>(w + (i + kPrefetchRows) * K + k), _MM_HINT_T0);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = load_bf16x32(x + m * ldx + k, mask);
      for (int i = 0; i < NR; ++i) acc[m][i] = _mm512_dpbf16_ps(acc[m][i], xv, wv[i]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    if constexpr (NR % 4 == 0) {
      for (int i = 0; i < NR; i += 4) {
        store4(*reinterpret_cast<const __m512(*)[4]>(&acc[m][i]), bias ? bias + i : nullptr, out + m * ldo + i);
      }
    } else {
      // The same shuffle tree as store4, each sum padded with three zero accumulators: a weight
      // row's horizontal sum must not depend on whether it fell in a 4-row block or in the N % NR
      // tail, because NR itself depends on M (8 for M = 1, else 4). store4's lanes never mix
      // accumulators, so the zeros change nothing but the lanes they occupy.
      const __m512 zero = _mm512_setzero_ps();
      for (int i = 0; i < NR; ++i) {
        const __m512 a4[4] = {acc[m][i], zero, zero, zero};
        const uint16_t b4[4] = {bias != nullptr ? bias[i] : uint16_t{0}, 0, 0, 0};
        uint16_t o4[4];
        store4(a4, bias != nullptr ? b4 : nullptr, o4);
        out[m * ldo + i] = o4[0];
      }
    }
  }
}

// All M rows of x against NR weight rows, in balanced groups of up to 6 x rows (6 x 4 = 24
// accumulators + 4 weight vectors + 1 x vector of the 32 zmm registers), so M = 12 takes two
// passes over the L1-resident weight block instead of three, and M = 16 three instead of four.
template <int NR>
inline void rows_group(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const uint16_t* bias,
                       uint16_t* out, int64_t ldo, int64_t rows) {
  switch (rows) {
    case 6:
      if constexpr (NR <= 4) {
        block<6, NR>(x, ldx, w, K, bias, out, ldo);
      } else {
        block<3, NR>(x, ldx, w, K, bias, out, ldo);
        block<3, NR>(x + 3 * ldx, ldx, w, K, bias, out + 3 * ldo, ldo);
      }
      break;
    case 5:
      if constexpr (NR <= 4) {
        block<5, NR>(x, ldx, w, K, bias, out, ldo);
      } else {
        block<3, NR>(x, ldx, w, K, bias, out, ldo);
        block<2, NR>(x + 3 * ldx, ldx, w, K, bias, out + 3 * ldo, ldo);
      }
      break;
    case 4:
      block<4, NR>(x, ldx, w, K, bias, out, ldo);
      break;
    case 3:
      block<3, NR>(x, ldx, w, K, bias, out, ldo);
      break;
    case 2:
      block<2, NR>(x, ldx, w, K, bias, out, ldo);
      break;
    case 1:
      block<1, NR>(x, ldx, w, K, bias, out, ldo);
      break;
    default:
      break;
  }
}

template <int NR>
inline void rows_block(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const uint16_t* bias,
                       uint16_t* out, int64_t ldo, int64_t M) {
  const int64_t groups = (M + 5) / 6;
  int64_t m = 0;
  for (int64_t g = 0; g < groups; ++g) {
    // Sizes differ by at most one: M = 8 -> 4 + 4, 13 -> 5 + 4 + 4.
    const int64_t rows = M / groups + (g < M % groups ? 1 : 0);
    rows_group<NR>(x + m * ldx, ldx, w, K, bias, out + m * ldo, ldo, rows);
    m += rows;
  }
}

template <int NR>
void run_blocks(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t ldo,
                int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = N / NR;
  // Static schedule: each thread streams one contiguous slice of the weight, which the hardware
  // prefetcher follows; blocks cost the same, so nothing is gained by dynamic scheduling.
  // (team_for: on a decode step's crew, crew.h, the crew takes the shares: a sparse layer's router.)
  team_for(blocks, N * K * M >= 65536, [&](int64_t b) {
    const int64_t n = b * NR;
    rows_block<NR>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, out + n, ldo, M);
  });
  for (int64_t n = blocks * NR; n < N; ++n) {  // the last N % NR rows
    rows_block<1>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, out + n, ldo, M);
  }
}

}  // namespace

void linear_bf16_avx512(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                        int64_t ldo, int64_t M, int64_t N, int64_t K) {
  // A single row has few accumulators per weight row; 8 rows per block keep more loads in flight.
  if (M == 1) {
    run_blocks<8>(x, ldx, w, bias, out, ldo, M, N, K);
  } else {
    run_blocks<4>(x, ldx, w, bias, out, ldo, M, N, K);
  }
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
