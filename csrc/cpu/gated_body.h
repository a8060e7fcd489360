// The vector bodies of the fused gated activations (silu_and_mul, gelu_tanh_and_mul), written once
// over a lanes struct L (the vector type and its operations: Avx2Lanes below, 8 fp32 lanes;
// fused_avx512.cpp's Avx512Lanes, 16) so that every family computes each value by the same
// operations in the same order: the AVX-512 bodies give the AVX2 bodies' bits (a test compares
// them). Include after the file's target switch, with fp-contract off: the compiler must not fuse
// a multiply and an add into one FMA in one family and not in the other.
//
// Everything here has internal linkage, so each including file compiles it for its own target.
// The including file brings fused_kernel.h and maybe_parallel.h in before its target switch (their
// inline functions must keep the baseline ISA).
#pragma once

#include "x86_target.h"  // <immintrin.h>, or nothing in emulated builds

#include <cmath>
#include <cstdint>

#include "bf16_avx2.h"        // bf16_to_float, float_to_bf16: the scalar tails
#include "bf16_lanes_avx2.h"  // the eight-lane bf16 conversions

namespace pagewire::cpu {
namespace {

struct Avx2Lanes {
  using F = __m256;
  static constexpr int kLanes = 8;
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F zero() { return _mm256_setzero_ps(); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F andnot(F a, F b) { return _mm256_andnot_ps(a, b); }
  static F and_(F a, F b) { return _mm256_and_ps(a, b); }
  static F or_(F a, F b) { return _mm256_or_ps(a, b); }
  static F round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^n for integral n in [-126, 127], built in the exponent bits.
  static F pow2(F n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F load_bf16(const uint16_t* p) { return pagewire::cpu::load_bf16(p); }
  static F round_bf16(F v) { return pagewire::cpu::round_bf16(v); }
  static void store_bf16(uint16_t* p, F v) { pagewire::cpu::store_bf16(p, v); }
};

// e^x to ~1e-7 relative for x in [-87, 88] (clamped outside): x log2(e) = n + f, n the nearest
// integer, 2^f = e^(f ln 2) by its Taylor series to degree 7 (|f ln 2| <= 0.35, remainder below
// 1e-8), 2^n built in the exponent bits.
template <class L>
typename L::F exp_lanes(typename L::F x) {
  x = L::min(L::max(x, L::set1(-87.0f)), L::set1(88.0f));
  const typename L::F t = L::mul(x, L::set1(1.44269504088896341f));
  const typename L::F n = L::round(t);
  const typename L::F f = L::mul(L::sub(t, n), L::set1(0.693147180559945309f));
  typename L::F p = L::set1(1.0f / 5040.0f);
  p = L::fmadd(p, f, L::set1(1.0f / 720.0f));
  p = L::fmadd(p, f, L::set1(1.0f / 120.0f));
  p = L::fmadd(p, f, L::set1(1.0f / 24.0f));
  p = L::fmadd(p, f, L::set1(1.0f / 6.0f));
  p = L::fmadd(p, f, L::set1(0.5f));
  p = L::fmadd(p, f, L::set1(1.0f));
  p = L::fmadd(p, f, L::set1(1.0f));
  return L::mul(p, L::pow2(n));
}

// The activations, a vector (vec) and one value (one) at a time, as torch computes them in fp32.
struct SiluOp {
  template <class L>
  static typename L::F vec(typename L::F g) {
    const typename L::F e = exp_lanes<L>(L::sub(L::zero(), g));
    return L::div(g, L::add(L::set1(1.0f), e));
  }
  static float one(float g) { return g / (1.0f + std::exp(-g)); }
};

struct GeluTanhOp {  // 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), torch's formula
  static constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  template <class L>
  static typename L::F vec(typename L::F g) {
    const typename L::F g3 = L::mul(L::mul(g, g), g);
    const typename L::F z = L::mul(L::set1(kBeta), L::fmadd(L::set1(kKappa), g3, g));
    // tanh|z| = (1 - e) / (1 + e), e = exp(-2|z|) in (0, 1]: no overflow, and 1 + tanh keeps an
    // absolute error of ~1e-7, so the product keeps fp32's relative precision.
    const typename L::F sign = L::set1(-0.0f), one = L::set1(1.0f);
    const typename L::F e = exp_lanes<L>(L::mul(L::set1(-2.0f), L::andnot(sign, z)));
    const typename L::F t = L::or_(L::div(L::sub(one, e), L::add(one, e)), L::and_(sign, z));
    return L::mul(L::mul(L::set1(0.5f), g), L::add(one, t));
  }
  static float one(float g) { return 0.5f * g * (1.0f + std::tanh(kBeta * (g + kKappa * g * g * g))); }
};

// out[t][j] = act(x[t][j]) * x[t][I + j] for T rows of I: vectors of L's width, then (a wider L)
// eight lanes while eight are left, then one value at a time, so a value's arithmetic depends only
// on its place in the row modulo 8 -- the same in every family. Rows split over the team when
// there is work enough (each row whole on one thread, so the split changes no bits).
template <class Act, class L>
void gated_bf16_rows(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t T, int64_t I) {
  maybe_parallel_for(T, T * I >= kFusedParallelElems, [&](int64_t t) {
    const uint16_t* g = x + t * ldx;
    const uint16_t* u = g + I;
    uint16_t* o = out + t * I;
    int64_t j = 0;
    // act(gate) is a bf16 tensor in transformers before it multiplies up.
    for (; j + L::kLanes <= I; j += L::kLanes) {
      L::store_bf16(o + j, L::mul(L::round_bf16(Act::template vec<L>(L::load_bf16(g + j))), L::load_bf16(u + j)));
    }
    if constexpr (L::kLanes > 8) {
      for (; j + 8 <= I; j += 8) {
        using E = Avx2Lanes;
        E::store_bf16(o + j, E::mul(E::round_bf16(Act::template vec<E>(E::load_bf16(g + j))), E::load_bf16(u + j)));
      }
    }
    for (; j < I; ++j) {
      const float s = bf16_to_float(float_to_bf16(Act::one(bf16_to_float(g[j]))));
      o[j] = float_to_bf16(s * bf16_to_float(u[j]));
    }
  });
}

template <class Act, class L>
void gated_f32_rows(const float* x, int64_t ldx, float* out, int64_t T, int64_t I) {
  maybe_parallel_for(T, T * I >= kFusedParallelElems, [&](int64_t t) {
    const float* g = x + t * ldx;
    const float* u = g + I;
    float* o = out + t * I;
    int64_t j = 0;
    for (; j + L::kLanes <= I; j += L::kLanes) L::store(o + j, L::mul(Act::template vec<L>(L::load(g + j)), L::load(u + j)));
    if constexpr (L::kLanes > 8) {
      for (; j + 8 <= I; j += 8) {
        using E = Avx2Lanes;
        E::store(o + j, E::mul(Act::template vec<E>(E::load(g + j)), E::load(u + j)));
      }
    }
    for (; j < I; ++j) o[j] = Act::one(g[j]) * u[j];
  });
}

}  // namespace
}  // namespace pagewire::cpu
