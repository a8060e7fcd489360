// AVX2 bodies of the bf16 RMSNorm (with the residual add) and the rotary embedding (with Qwen3's
// per-head norm), which fused_ops.cpp calls when cpu::active_isa() is at least Isa::kAvx2: eight
// lanes where the portable loops, compiled for the baseline ISA, run four or one. Both were a
// measurable share of a small model's decode step (SmolLM2 at batch 8: a norm of eight rows 5-7 us
// and a rotation 10 us, twice and once a layer; bench/RESULTS.md, session 27).
//
// Bit for bit the portable code's results: the same operations in the same order on the same
// fp32 values -- the residual sum rounded to bf16, the eight partial sums of squares (lane j of the
// accumulator is part[j] of fused_ops.cpp's inv_rms, its tail added to part[0]) combined in the
// same tree, every product and sum rounded to bf16 where transformers materialises a bf16 tensor.
// Hence fp-contract off: GCC would otherwise fuse a multiply and an add into one FMA (one
// rounding instead of two) under its default -ffp-contract=fast once the target has FMA.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

// Headers first: inline functions they define must keep the baseline ISA.
#include "fused_kernel.h"
#include "maybe_parallel.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")

#include "bf16_avx2.h"  // bf16_to_float, float_to_bf16: the scalar tails
#include "bf16_lanes_avx2.h"

namespace pagewire::cpu {
namespace {

inline float round_value(float f) { return bf16_to_float(float_to_bf16(f)); }

// fused_ops.cpp inv_rms: eight partial sums of squares, the tail into the first, the same tree.
inline float inv_rms(const float* v, int64_t d, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    const __m256 x = _mm256_loadu_ps(v + k);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(x, x));
  }
  alignas(32) float part[8];
  _mm256_store_ps(part, acc);
  for (; k < d; ++k) part[0] += v[k] * v[k];
  const float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  return 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
}

// out = weight * round(v * inv), rounded (fused_ops.cpp scale_row).
inline void scale_row(const float* v, int64_t d, float inv, const uint16_t* weight, uint16_t* out) {
  const __m256 vi = _mm256_set1_ps(inv);
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    store_bf16(out + k, _mm256_mul_ps(load_bf16(weight + k), round_bf16(_mm256_mul_ps(_mm256_loadu_ps(v + k), vi))));
  }
  for (; k < d; ++k) out[k] = float_to_bf16(bf16_to_float(weight[k]) * round_value(v[k] * inv));
}

void norm_row(uint16_t* xr, const uint16_t* dr, const uint16_t* weight, uint16_t* out, int64_t d, float eps,
              float* v) {
  int64_t k = 0;
  if (dr != nullptr) {  // residual = round(residual + delta), then normalised
    for (; k + 8 <= d; k += 8) {
      const __m256 r = round_bf16(_mm256_add_ps(load_bf16(xr + k), load_bf16(dr + k)));
      _mm256_storeu_ps(v + k, r);
      store_bf16(xr + k, r);  // exact: r is a bf16 value
    }
    for (; k < d; ++k) {
      xr[k] = float_to_bf16(bf16_to_float(xr[k]) + bf16_to_float(dr[k]));
      v[k] = bf16_to_float(xr[k]);
    }
  } else {
    for (; k + 8 <= d; k += 8) _mm256_storeu_ps(v + k, load_bf16(xr + k));
    for (; k < d; ++k) v[k] = bf16_to_float(xr[k]);
  }
  scale_row(v, d, inv_rms(v, d, eps), weight, out);
}

}  // namespace

void rms_norm_rows_bf16_avx2(uint16_t* x, int64_t ldx, const uint16_t* delta, int64_t ldd, const uint16_t* weight,
                             uint16_t* out, int64_t ldo, int64_t T, int64_t d, float eps) {
  maybe_parallel_for(T, T * d >= kFusedParallelElems, [&](int64_t t) {
    norm_row(x + t * ldx, delta != nullptr ? delta + t * ldd : nullptr, weight, out + t * ldo, d, eps,
             row_scratch(d));
  });
}

void rope_rows_bf16_avx2(uint16_t* x, int64_t st, int64_t sh, int64_t T, int64_t n, int64_t d, const int64_t* pos,
                         const float* cos, const float* sin, const uint16_t* norm_weight, float eps) {
  const int64_t half = d / 2;
  maybe_parallel_for(T, T * n * d >= kFusedParallelElems, [&](int64_t t) {
    float* v = row_scratch(d, 0);
    float* c = row_scratch(half, 1);
    float* s = row_scratch(half, 2);
    // transformers casts cos/sin to the activation dtype before rotating.
    for (int64_t j = 0; j < half; ++j) {
      c[j] = round_value(cos[pos[t] * half + j]);
      s[j] = round_value(sin[pos[t] * half + j]);
    }
    const __m256 neg = _mm256_set1_ps(-0.0f);
    for (int64_t h = 0; h < n; ++h) {
      uint16_t* xr = x + t * st + h * sh;
      int64_t k = 0;
      for (; k + 8 <= d; k += 8) _mm256_storeu_ps(v + k, load_bf16(xr + k));
      for (; k < d; ++k) v[k] = bf16_to_float(xr[k]);
      if (norm_weight != nullptr) {  // Qwen3: RMSNorm over head_dim first, with this head's weight row
        const float inv = inv_rms(v, d, eps);
        const uint16_t* w = norm_weight + h * d;
        const __m256 vi = _mm256_set1_ps(inv);
        k = 0;
        for (; k + 8 <= d; k += 8) {
          const __m256 y = round_bf16(_mm256_mul_ps(_mm256_loadu_ps(v + k), vi));
          _mm256_storeu_ps(v + k, round_bf16(_mm256_mul_ps(load_bf16(w + k), y)));
        }
        for (; k < d; ++k) v[k] = round_value(bf16_to_float(w[k]) * round_value(v[k] * inv));
      }
      // Rotate-half: x * cat(cos, cos) + cat(-x2, x1) * cat(sin, sin), each product and the sum
      // rounded to bf16.
      int64_t j = 0;
      for (; j + 8 <= half; j += 8) {
        const __m256 a = _mm256_loadu_ps(v + j), b = _mm256_loadu_ps(v + j + half);
        const __m256 cj = _mm256_loadu_ps(c + j), sj = _mm256_loadu_ps(s + j);
        const __m256 nb = _mm256_xor_ps(b, neg);
        store_bf16(xr + j, _mm256_add_ps(round_bf16(_mm256_mul_ps(a, cj)), round_bf16(_mm256_mul_ps(nb, sj))));
        store_bf16(xr + j + half, _mm256_add_ps(round_bf16(_mm256_mul_ps(b, cj)), round_bf16(_mm256_mul_ps(a, sj))));
      }
      for (; j < half; ++j) {
        const float a = v[j], b = v[j + half];
        xr[j] = float_to_bf16(round_value(a * c[j]) + round_value(-b * s[j]));
        xr[j + half] = float_to_bf16(round_value(b * c[j]) + round_value(a * s[j]));
      }
    }
  });
}

}  // namespace pagewire::cpu

#pragma GCC pop_options
