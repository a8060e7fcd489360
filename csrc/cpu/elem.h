// Scalar conversions between fp32 and the 16-bit storage types the CPU kernels read and write.
// Kept free of ATen so kernel translation units compile in seconds.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/Half.h>

namespace pagewire::cpu {

// Storage-only wrappers: distinct types so templates can tell bf16 from fp16.
struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};

inline float to_float(float v) { return v; }
inline float to_float(Bf16 v) {
  const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float to_float(Fp16 v) { return c10::detail::fp16_ieee_to_fp32_value(v.bits); }

inline void store_float(float f, float* dst) { *dst = f; }
inline void store_float(float f, Bf16* dst) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if (std::isnan(f)) {
    dst->bits = 0x7fc0;  // keep NaN a NaN: rounding could carry it into infinity
    return;
  }
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest, ties to even
  dst->bits = static_cast<uint16_t>(u >> 16);
}
inline void store_float(float f, Fp16* dst) { dst->bits = c10::detail::fp16_ieee_from_fp32_value(f); }

}  // namespace pagewire::cpu
