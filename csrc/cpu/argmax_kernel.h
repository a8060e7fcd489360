// The torch-free interface of argmax_rows' slice scans (argmax.cpp runs them per thread; the AVX2
// body is argmax_avx2.cpp, called only when cpu::active_isa() is at least Isa::kAvx2).
#pragma once

#include <cstdint>

namespace pagewire::cpu {

// The first index in [0, n) of x's largest value, NaN counting as larger than any number (its
// first NaN), as torch.argmax and numpy.argmax choose; *is_nan says whether x[index] is a NaN.
// n >= 1.
int64_t argmax_slice(const float* x, int64_t n, bool* is_nan);
int64_t argmax_slice_avx2(const float* x, int64_t n, bool* is_nan);

}  // namespace pagewire::cpu
