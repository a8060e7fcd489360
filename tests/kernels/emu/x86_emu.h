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
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
inline float _cvtsh_ss(unsigned short h) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))); }
inline __m512 _mm512_cvtepi32_ps(__m512i a) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtepi32_ps(_mm512_castsi512_si256(a))),
                            _mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(a, 1)), 1);
}
inline __m256 _mm512_extractf32x8_ps_emu(__m512 v, int hi) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), hi));
}
#define _mm512_extractf32x8_ps(v, i) _mm512_extractf32x8_ps_emu(v, i)

#if __has_include("amx_emu.h")
#include "amx_emu.h"
#endif
