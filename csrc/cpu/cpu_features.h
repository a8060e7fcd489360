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
  std::string vendor, brand;
};

// Kernel families, best last. Each kernel file is compiled for its family only (target pragma),
// and is called only when active_isa() is at least that family, so no unsupported instruction
// ever runs.
enum class Isa : int { kPortable = 0, kAvx2 = 1, kAvx512Bf16 = 2 };

const CpuFeatures& cpu_features();  // detected on first call, then cached
Isa detected_isa();                 // the best family the CPU and OS support
// detected_isa(), capped by the PAGEWIRE_CPU_ISA environment variable when it names a lower
// family ("portable" or "generic", "avx2", "avx512bf16"); read on every call so tests can force
// a fallback path in-process.
Isa active_isa();
const char* isa_name(Isa isa);

}  // namespace pagewire::cpu
