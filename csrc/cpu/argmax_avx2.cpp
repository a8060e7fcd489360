// AVX2 body of argmax_rows' slice scan (argmax_kernel.h): one pass for the largest value and
// whether any NaN is there, eight lanes at a time, then one pass for the first index holding it.
// The second pass reads what the first just brought into L1/L2. numpy's argmax (the sampler's
// path before) is vectorised too; what this op saves is elsewhere (argmax.cpp).
#include <immintrin.h>

#include <cstdint>

// Headers first: inline functions they define must keep the baseline ISA.
#include "argmax_kernel.h"

#pragma GCC push_options
#pragma GCC target("avx2")

namespace pagewire::cpu {

int64_t argmax_slice_avx2(const float* x, int64_t n, bool* is_nan) {
  __m256 mx = _mm256_set1_ps(x[0]);
  __m256 unord = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  bool nan = _mm256_movemask_ps(unord) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float best = lanes[0];
  for (int l = 1; l < 8; ++l) best = lanes[l] > best ? lanes[l] : best;
  for (int64_t j = i; j < n; ++j) {
    nan = nan || x[j] != x[j];
    best = x[j] > best ? x[j] : best;
  }
  if (nan) {  // the first NaN wins (rare: a scalar scan)
    for (int64_t j = 0; j < n; ++j) {
      if (x[j] != x[j]) {
        *is_nan = true;
        return j;
      }
    }
  }
  *is_nan = false;
  const __m256 b = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), b, _CMP_EQ_OQ));
    if (mask != 0) return i + __builtin_ctz(static_cast<unsigned>(mask));
  }
  for (; i < n; ++i) {
    if (x[i] == best) return i;
  }
  return 0;  // (not reached: best is one of the values)
}

}  // namespace pagewire::cpu

#pragma GCC pop_options
