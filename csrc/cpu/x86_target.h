// The one way kernel files get x86 intrinsics and switch the compiler's target ISA.
//
// Normal builds: <immintrin.h>, and PAGEWIRE_TARGET_PUSH("avx512f,...") / PAGEWIRE_TARGET_POP
// around a kernel file's code (GCC's push_options + target pragmas), after the library headers so
// their inline functions keep the baseline ISA.
//
// PAGEWIRE_X86_EMULATE builds (tests/kernels/emu/, never the extension): the test force-includes
// tests/kernels/emu/x86_emu.h, which defines the same intrinsics in portable C++ (SIMDe for
// AVX-512, a small emulation for AMX tiles), and the target pragmas vanish. The kernel's own code
// is compiled unchanged, so a CPU without AVX-512 or AMX still runs and checks its logic.
#pragma once

#ifdef PAGEWIRE_X86_EMULATE
#define PAGEWIRE_TARGET_PUSH(isa)
#define PAGEWIRE_TARGET_POP
#else
#include <immintrin.h>
#define PAGEWIRE_PRAGMA_(x) _Pragma(#x)
#define PAGEWIRE_TARGET_PUSH(isa) _Pragma("GCC push_options") PAGEWIRE_PRAGMA_(GCC target(isa))
#define PAGEWIRE_TARGET_POP _Pragma("GCC pop_options")
#endif
