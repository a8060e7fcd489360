// CPUID/XGETBV feature detection (see cpu_features.h). Compiled for the baseline ISA: it must run
// on every x86-64 CPU, and on other architectures it reports no x86 features at all.
#include "cpu_features.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagewire::cpu {
namespace {

#if defined(__x86_64__) || defined(__i386__)
bool bit(unsigned reg, int b) { return ((reg >> b) & 1u) != 0; }

unsigned long long xgetbv0() {
  unsigned eax = 0, edx = 0;
  // xgetbv with ecx = 0 reads XCR0; only valid when CPUID says OSXSAVE (checked by the caller).
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}

// Linux (5.16 on) keeps AMX's 8 KB tile state off until a process asks for it: the first tile
// instruction would otherwise fault (SIGILL). The grant is per process, so asking once here, before
// any kernel runs, covers every thread, OpenMP's included. Other systems: no AMX kernels.
bool request_amx_permission() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return f;
  const unsigned max_leaf = a;
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  f.vendor = vendor;
  unsigned ext_max = __get_cpuid_max(0x80000000u, nullptr);
  if (ext_max >= 0x80000004u) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      __get_cpuid(0x80000002u + i, &a, &b, &c, &d);
      std::memcpy(brand + 16 * i, &a, 4);
      std::memcpy(brand + 16 * i + 4, &b, 4);
      std::memcpy(brand + 16 * i + 8, &c, 4);
      std::memcpy(brand + 16 * i + 12, &d, 4);
    }
    f.brand = brand;
    const auto first = f.brand.find_first_not_of(' ');
    f.brand = first == std::string::npos ? std::string() : f.brand.substr(first);
  }
  __get_cpuid(1, &a, &b, &c, &d);
  const unsigned base_family = (a >> 8) & 0xF;
  f.family = static_cast<int>(base_family == 0xF ? base_family + ((a >> 20) & 0xFF) : base_family);
  const bool osxsave = bit(c, 27), avx = bit(c, 28);
  f.fma = bit(c, 12);
  f.f16c = bit(c, 29);
  unsigned long long xcr0 = osxsave ? xgetbv0() : 0;
  f.os_avx = avx && (xcr0 & 0x6) == 0x6;             // SSE + YMM state
  f.os_avx512 = f.os_avx && (xcr0 & 0xE0) == 0xE0;   // opmask, ZMM_Hi256, Hi16_ZMM
  const bool xcr0_amx = (xcr0 & 0x60000ull) == 0x60000ull;  // XTILECFG + XTILEDATA
  if (max_leaf >= 7) {
    __get_cpuid_count(7, 0, &a, &b, &c, &d);
    f.avx2 = bit(b, 5) && f.os_avx;
    f.avx512f = bit(b, 16) && f.os_avx512;
    f.avx512bw = bit(b, 30) && f.os_avx512;
    f.avx512vl = bit(b, 31) && f.os_avx512;
    f.avx512vnni = bit(c, 11) && f.os_avx512;
    f.os_amx = xcr0_amx && bit(d, 24) && request_amx_permission();
    f.amx_bf16 = bit(d, 22) && f.os_amx;
    f.amx_tile = bit(d, 24) && f.os_amx;
    f.amx_int8 = bit(d, 25) && f.os_amx;
    const unsigned sub_leaves = a;
    if (sub_leaves >= 1) {
      __get_cpuid_count(7, 1, &a, &b, &c, &d);
      f.avxvnni = bit(a, 4) && f.os_avx;
      f.avx512bf16 = bit(a, 5) && f.os_avx512;
    }
  }
  f.fma = f.fma && f.os_avx;
  f.f16c = f.f16c && f.os_avx;
  return f;
}
#else
CpuFeatures detect() { return CpuFeatures{}; }
#endif

Isa detect_isa(const CpuFeatures& f) {
  if (!(f.avx2 && f.fma && f.f16c)) return Isa::kPortable;
  if (!(f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni)) return Isa::kAvx2;
  if (!f.avx512bf16) return Isa::kAvx512;
  if (!(f.amx_tile && f.amx_bf16 && f.amx_int8)) return Isa::kAvx512Bf16;
  return Isa::kAmx;
}

// The family a PAGEWIRE_CPU_ISA name stands for; unknown names stand for no limit.
Isa named_isa(const char* name, Isa fallback) {
  static constexpr struct {
    const char* name;
    Isa isa;
  } kNames[] = {{"portable", Isa::kPortable}, {"generic", Isa::kPortable}, {"avx2", Isa::kAvx2},
                {"avx512", Isa::kAvx512},     {"avx512bf16", Isa::kAvx512Bf16}, {"amx", Isa::kAmx}};
  for (const auto& n : kNames) {
    if (std::strcmp(name, n.name) == 0) return n.isa;
  }
  return fallback;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();  // thread-safe static init
  return features;
}

Isa detected_isa() {
  static const Isa isa = detect_isa(cpu_features());
  return isa;
}

Isa active_isa() {
  const Isa best = detected_isa();
  const char* cap = std::getenv("PAGEWIRE_CPU_ISA");
  if (cap == nullptr || *cap == '\0') return best;
  // Unknown names leave the detected family: a cap can only lower it.
  const Isa limit = named_isa(cap, best);
  return static_cast<int>(limit) < static_cast<int>(best) ? limit : best;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAmx:
      return "amx";
    case Isa::kAvx512Bf16:
      return "avx512bf16";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "portable";
  }
}

}  // namespace pagewire::cpu
