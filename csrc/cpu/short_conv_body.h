// The body of the short causal convolution (short_conv_kernel.h), written once over a vector type
// V: each ISA file defines V (its width, fp32 and storage loads/stores, fma) inside its target
// region and includes this header there, inside an anonymous namespace, so every instantiation
// keeps that file's ISA and internal linkage. The channel tail (c1 - c0 not a multiple of the
// width) runs the same arithmetic one lane at a time.
#pragma once

#include <cstdint>
#include <cstring>

namespace pagewire::cpu::short_conv_detail {
namespace {  // internal linkage: each including file compiles its own copy for its ISA

inline float bf16_to_f(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float ld(const float* p) { return *p; }
inline float ld(const uint16_t* p) { return bf16_to_f(*p); }
inline void st(float* p, float v) { *p = v; }
inline void st(uint16_t* p, float v) { *p = f_to_bf16(v); }
inline float rnd(float v, const float*) { return v; }
inline float rnd(float v, const uint16_t*) { return bf16_to_f(f_to_bf16(v)); }

template <class E>
void conv_scalar(const E* bcx, int64_t ldx, E* state, const float* w, const float* bias, E* out, int64_t ldo,
                 int64_t T, int64_t C, int64_t K, int64_t c) {
  float win[8];
  for (int64_t k = 0; k + 1 < K; ++k) win[k] = ld(state + k * C + c);
  const float b = bias != nullptr ? bias[c] : 0.0f;
  for (int64_t t = 0; t < T; ++t) {
    const E* row = bcx + t * ldx;
    win[K - 1] = rnd(ld(row + c) * ld(row + 2 * C + c), row);
    float acc = b;
    for (int64_t k = 0; k < K; ++k) acc = __builtin_fmaf(w[k * C + c], win[k], acc);
    st(out + t * ldo + c, ld(row + C + c) * rnd(acc, row));
    for (int64_t k = 0; k + 1 < K; ++k) win[k] = win[k + 1];
  }
  for (int64_t k = 0; k + 1 < K; ++k) st(state + k * C + c, win[k]);
}

template <class V, class E>
void conv_range(const E* bcx, int64_t ldx, E* state, const float* w, const float* bias, E* out, int64_t ldo,
                int64_t T, int64_t C, int64_t K, int64_t c0, int64_t c1) {
  using R = typename V::Reg;
  int64_t c = c0;
  for (; c + V::kWidth <= c1; c += V::kWidth) {
    R win[8], wk[8];
    for (int64_t k = 0; k + 1 < K; ++k) win[k] = V::load(state + k * C + c);
    for (int64_t k = 0; k < K; ++k) wk[k] = V::load(w + k * C + c);
    const R b = bias != nullptr ? V::load(bias + c) : V::zero();
    for (int64_t t = 0; t < T; ++t) {
      const E* row = bcx + t * ldx;
      win[K - 1] = V::round(V::mul(V::load(row + c), V::load(row + 2 * C + c)), row);
      R acc = b;
      for (int64_t k = 0; k < K; ++k) acc = V::fma(wk[k], win[k], acc);
      V::store(out + t * ldo + c, V::mul(V::load(row + C + c), V::round(acc, row)));
      for (int64_t k = 0; k + 1 < K; ++k) win[k] = win[k + 1];
    }
    for (int64_t k = 0; k + 1 < K; ++k) V::store(state + k * C + c, win[k]);
  }
  for (; c < c1; ++c) conv_scalar(bcx, ldx, state, w, bias, out, ldo, T, C, K, c);
}

}  // namespace
}  // namespace pagewire::cpu::short_conv_detail
