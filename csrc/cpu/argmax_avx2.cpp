// AVX2 body of argmax_rows' slice scan (argmax_kernel.h): one pass for the largest value and
// whether any NaN is there, eight lanes at a time, then one pass for the first index holding it.
// The second pass reads what the first just brought into L1/L2. bf16 rows (a bf16 model's logits,
// which greedy decoding need not widen) are read through the same body, widened 8 lanes at a time. numpy's argmax (the sampler's
// path before) is vectorised too; what this op saves is elsewhere (argmax.cpp).
#include <immintrin.h>

#include <cstdint>

// Headers first: inline functions they define must keep the baseline ISA.
#include "argmax_kernel.h"

#pragma GCC push_options
#pragma GCC target("avx2")

namespace pagewire::cpu {

namespace {

// Eight values as float32, exactly: from float32 as they are, from bf16 by their 16 bits shifted up.
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float value(const float* x, int64_t j) { return x[j]; }
inline float value(const uint16_t* x, int64_t j) { return bf16_value(x[j]); }

template <typename T>
int64_t scan(const T* x, int64_t n, bool* is_nan) {
  __m256 mx = _mm256_set1_ps(value(x, 0));
  __m256 unord = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  bool nan = _mm256_movemask_ps(unord) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float best = lanes[0];
  for (int l = 1; l < 8; ++l) best = lanes[l] > best ? lanes[l] : best;
  for (int64_t j = i; j < n; ++j) {
    const float v = value(x, j);
    nan = nan || v != v;
    best = v > best ? v : best;
  }
  if (nan) {  // the first NaN wins (rare: a scalar scan)
    for (int64_t j = 0; j < n; ++j) {
      const float v = value(x, j);
      if (v != v) {
        *is_nan = true;
        return j;
      }
    }
  }
  *is_nan = false;
  const __m256 b = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + i), b, _CMP_EQ_OQ));
    if (mask != 0) return i + __builtin_ctz(static_cast<unsigned>(mask));
  }
  for (; i < n; ++i) {
    if (value(x, i) == best) return i;
  }
  return 0;  // (not reached: best is one of the values)
}

}  // namespace

int64_t argmax_slice_avx2(const float* x, int64_t n, bool* is_nan) { return scan(x, n, is_nan); }
int64_t argmax_slice_bf16_avx2(const uint16_t* x, int64_t n, bool* is_nan) { return scan(x, n, is_nan); }

}  // namespace pagewire::cpu

#pragma GCC pop_options
