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

// The same over bf16 values (their bits as uint16_t), each compared as its exact float32 value:
// the index argmax_slice gives for the widened row.
int64_t argmax_slice_bf16(const uint16_t* x, int64_t n, bool* is_nan);
int64_t argmax_slice_bf16_avx2(const uint16_t* x, int64_t n, bool* is_nan);

// A value as float32 (exact): the scans' element readers.
inline float f32_value(float v) { return v; }
inline float bf16_value(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace pagewire::cpu
