// Which x86 instruction sets this CPU (and its OS) lets pagewire's kernels use, detected once
// with CPUID/XGETBV, and the kernel family chosen from them. Plain C++, no torch headers.
#pragma once

#include <string>

namespace pagewire::cpu {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512bf16 = false, avx512vnni = false;
  bool avxvnni = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  bool os_avx = false;     // XCR0 enables the YMM state
  bool os_avx512 = false;  // XCR0 enables opmask + ZMM state
  bool os_amx = false;     // XCR0 enables the tile state and Linux granted this process its use
  int family = 0;  // CPUID's display family (base + extended): AMD Zen 3 / Zen 4 25, Zen 5 26
  std::string vendor, brand;
};

// Kernel families, best last; each includes the ones below it. Each kernel file is compiled for its
// family only (PAGEWIRE_TARGET_PUSH, x86_target.h), and is called only when active_isa() is at
// least that family, so no unsupported instruction ever runs.
//   kAvx2       AVX2 + FMA + F16C (Haswell, Zen 1-3)
//   kAvx512     AVX-512 F/BW/VL + VNNI (Cascade Lake, Ice Lake): the int8 VNNI kernels
//   kAvx512Bf16 kAvx512 + AVX512-BF16 (Cooper Lake, Zen 4/5): the bf16 dot-product kernels
//   kAmx        kAvx512Bf16 + AMX-TILE/BF16/INT8 with the OS's permission (Sapphire Rapids on)
enum class Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };

const CpuFeatures& cpu_features();  // detected on first call, then cached
Isa detected_isa();                 // the best family the CPU and OS support
// detected_isa(), capped by the PAGEWIRE_CPU_ISA environment variable when it names a lower
// family ("portable" or "generic", "avx2", "avx512", "avx512bf16", "amx"); read on every call so
// tests can force a fallback path in-process.
Isa active_isa();
const char* isa_name(Isa isa);

// Whether the CPU is AMD's: where its single-stream x8 kernels prefetch farther (x8_body.h,
// x8k_body.h; tuned on a Zen 5, bench/RESULTS.md session 25). Always false in the emulated test
// builds (tests/kernels/emu/), which have no CPU detection.
inline bool is_amd() {
#ifdef PAGEWIRE_X86_EMULATE
  return false;
#else
  static const bool amd = cpu_features().vendor == "AuthenticAMD";
  return amd;
#endif
}

// Whether the CPU is an AMD Zen 4 (family 25 with AVX-512; Zen 3, the same family, has none),
// where Q6_K's single streams prefetch into L2 (x8k_body.h; measured there, bench/RESULTS.md
// session 31). Always false in the emulated test builds.
inline bool is_amd_zen4() {
#ifdef PAGEWIRE_X86_EMULATE
  return false;
#else
  static const bool zen4 = is_amd() && cpu_features().family == 25 && cpu_features().avx512f;
  return zen4;
#endif
}

}  // namespace pagewire::cpu
