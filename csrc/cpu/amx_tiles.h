// What the AMX kernels share (linear_amx.cpp: bf16 and row-layout Q8_0; linear_x8_amx.cpp:
// the x8 layouts of Q8_0, Q4_0 and Q4_1): the tile counts, the LDTILECFG operand, the compiler barrier that orders plain
// stores around tile instructions, and each thread's slice of a parallel loop. Nothing here uses
// an intrinsic, so it keeps the baseline ISA wherever it is included.
#pragma once

#include <omp.h>

#include <cstdint>

namespace pagewire::cpu::amx {

constexpr int kRows = 16;   // rows of a C tile, and activation rows per chunk
constexpr int kGroups = 4;  // C tiles, weight groups per step

// The 64-byte LDTILECFG operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// GCC's tile intrinsics are asm statements that don't tell the compiler which memory they read
// (ldtilecfg claims 8 bytes, tileloadd none): this keeps stores into a config or scratch buffer
// from being moved past (or dropped before) the tile instruction that reads them.
inline void compiler_barrier() { asm volatile("" ::: "memory"); }

// Splits [0, n) into near-equal contiguous slices, one per thread of the current team.
inline void my_slice(int64_t n, int64_t* begin, int64_t* end) {
  const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
  *begin = n * t / nt;
  *end = n * (t + 1) / nt;
}

}  // namespace pagewire::cpu::amx
