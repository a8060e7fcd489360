// Force-included (g++ -include) by the emulated kernel builds of tests/kernels/emu_build.py, with
// -DPAGEWIRE_X86_EMULATE: every x86 intrinsic the kernels use, defined in portable C++, so kernels
// for instruction sets this CPU lacks (AVX-512 VNNI/BF16, AMX) run and are checked here.
//   SIMDe (Debian's libsimde-dev): SSE through AVX-512, VNNI and BF16, under the Intel names.
//   amx_emu.h: the AMX tile intrinsics, after Intel's pseudo-code.
#pragma once

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <simde/x86/fma.h>

#include <cstdint>

// What SIMDe 0.7.4 lacks, composed from what it has.
#ifndef __mmask32
typedef simde__mmask32 __mmask32;
#endif
#ifndef __mmask16
typedef simde__mmask16 __mmask16;
#endif
#ifndef __mmask64
typedef simde__mmask64 __mmask64;
#endif
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
inline float _cvtsh_ss(unsigned short h) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))); }
inline __m512 _mm512_cvtepi32_ps(__m512i a) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtepi32_ps(_mm512_castsi512_si256(a))),
                            _mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(a, 1)), 1);
}
// Lane by lane, as the instructions define them: fp32 -> int32 at the current (nearest) rounding,
// and int32 -> int16 by truncation (vpmovdw). (A SIMDe that has them defines their names as macros.)
#ifndef _mm512_cvtps_epi32
inline __m512i _mm512_cvtps_epi32(__m512 a) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtps_epi32(_mm512_castps512_ps256(a))),
                            _mm256_cvtps_epi32(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(a), 1))), 1);
}
#endif
#ifndef _mm512_cvtepi32_epi16
inline __m256i _mm512_cvtepi32_epi16(__m512i a) {
  alignas(64) int32_t v[16];
  alignas(32) int16_t r[16];
  _mm512_store_si512(v, a);
  for (int i = 0; i < 16; ++i) r[i] = static_cast<int16_t>(v[i]);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(r));
}
#endif
// SIMDe 0.7.4's alias of _mm512_madd_epi16 takes four arguments (the intrinsic takes two), and it
// has no _mm512_srai_epi32: the 256-bit halves' instructions, joined.
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
inline __m512i _mm512_srai_epi32(__m512i a, unsigned int imm) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srai_epi32(_mm512_castsi512_si256(a), static_cast<int>(imm))),
                            _mm256_srai_epi32(_mm512_extracti64x4_epi64(a, 1), static_cast<int>(imm)), 1);
}
// Lanes in k: a * b + c; the others keep c.
inline __m512 _mm512_mask3_fmadd_ps(__m512 a, __m512 b, __m512 c, simde__mmask16 k) {
  return _mm512_mask_mov_ps(c, k, _mm512_fmadd_ps(a, b, c));
}

// Conversions and loads the attention kernel uses, lane by lane through memory.
inline __m256 _mm512_extractf32x8_ps(__m512 a, int hi) {
  alignas(64) float f[16];
  _mm512_store_ps(f, a);
  return _mm256_loadu_ps(f + 8 * (hi & 1));
}
inline __m512i _mm512_cvtepu16_epi32(__m256i a) {
  alignas(32) uint16_t h[16];
  alignas(64) int32_t w[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(h), a);
  for (int i = 0; i < 16; ++i) w[i] = h[i];
  return _mm512_load_si512(w);
}
inline __m512 _mm512_cvtph_ps(__m256i a) {
  alignas(32) uint16_t h[16];
  alignas(64) float f[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(h), a);
  for (int i = 0; i < 16; ++i) f[i] = _cvtsh_ss(h[i]);
  return _mm512_load_ps(f);
}
inline __m256i _mm512_cvtps_ph(__m512 a, int rounding) {
  alignas(64) float f[16];
  alignas(32) uint16_t h[16];
  _mm512_store_ps(f, a);
  for (int half = 0; half < 2; ++half) {
    const __m128i r = _mm256_cvtps_ph(_mm256_loadu_ps(f + 8 * half), 0);  // round to nearest even
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + 8 * half), r);
  }
  (void)rounding;
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(h));
}
// Masked-off dwords are neither read nor kept (the mask guards a row's end).
inline __m512i _mm512_maskz_loadu_epi32(simde__mmask16 k, const void* p) {
  alignas(64) uint32_t v[16];
  for (int i = 0; i < 16; ++i) v[i] = ((k >> i) & 1u) != 0 ? static_cast<const uint32_t*>(p)[i] : 0;
  return _mm512_load_si512(v);
}

// The float forms (gdn_avx512.cpp's row tails): masked-off floats are neither read nor written.
inline __m512 _mm512_maskz_loadu_ps(simde__mmask16 k, const void* p) {
  alignas(64) float v[16];
  for (int i = 0; i < 16; ++i) v[i] = ((k >> i) & 1u) != 0 ? static_cast<const float*>(p)[i] : 0.0f;
  return _mm512_load_ps(v);
}
inline void _mm512_mask_storeu_ps(void* p, simde__mmask16 k, __m512 a) {
  alignas(64) float v[16];
  _mm512_store_ps(v, a);
  for (int i = 0; i < 16; ++i)
    if (((k >> i) & 1u) != 0) static_cast<float*>(p)[i] = v[i];
}

// Horizontal reductions, as GCC's headers compose them: halves added (maxed) down to one lane.
inline float _mm512_reduce_add_ps(__m512 a) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}
inline float _mm512_reduce_max_ps(__m512 a) {
  const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 d = _mm_max_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_max_ss(d, _mm_movehdup_ps(d)));
}

// Masked-off elements are neither read nor kept, as on hardware (the mask guards a row's end).
inline __m512i _mm512_maskz_loadu_epi16(__mmask32 k, const void* p) {
  alignas(64) uint16_t v[32];
  for (int i = 0; i < 32; ++i) v[i] = ((k >> i) & 1u) != 0 ? static_cast<const uint16_t*>(p)[i] : 0;
  return _mm512_load_si512(v);
}

// 128-bit lanes: two from a chosen by imm's low four bits, two from b by its high four.
inline __m512 _mm512_shuffle_f32x4_emu(__m512 a, __m512 b, int imm) {
  alignas(64) float fa[16], fb[16], r[16];
  _mm512_store_ps(fa, a);
  _mm512_store_ps(fb, b);
  for (int lane = 0; lane < 4; ++lane) {
    const float* src = lane < 2 ? fa : fb;
    const int sel = (imm >> (2 * lane)) & 3;
    for (int j = 0; j < 4; ++j) r[4 * lane + j] = src[4 * sel + j];
  }
  return _mm512_load_ps(r);
}
#define _mm512_shuffle_f32x4(a, b, imm) _mm512_shuffle_f32x4_emu(a, b, imm)

// fp32 -> bf16 as VCVTNEPS2BF16 does it: round to nearest even, NaN kept quiet; the hardware also
// flushes denormal inputs to zero.
inline uint16_t pw_emu_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;  // denormal -> signed zero
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline __m128bh _mm_cvtneps_pbh(__m128 a) {  // four bf16 in the low 64 bits, the rest zero
  alignas(16) float f[4];
  alignas(16) uint16_t h[8] = {};
  _mm_store_ps(f, a);
  for (int i = 0; i < 4; ++i) h[i] = pw_emu_bf16(f[i]);
  return (__m128bh)_mm_load_si128(reinterpret_cast<const __m128i*>(h));
}
inline __m256bh _mm512_cvtneps_pbh(__m512 a) {
  alignas(64) float f[16];
  alignas(32) uint16_t h[16];
  _mm512_store_ps(f, a);
  for (int i = 0; i < 16; ++i) h[i] = pw_emu_bf16(f[i]);
  return (__m256bh)_mm256_load_si256(reinterpret_cast<const __m256i*>(h));
}

#if __has_include("amx_emu.h")
#include "amx_emu.h"
#endif
