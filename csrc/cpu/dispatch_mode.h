// Per-thread switches of the linear ops' kernel choice, set from Python.
//
// Whether the calling thread runs in batch-invariant mode (server.kernels.batch_invariant, which
// sets it around each engine step through server._C.set_batch_invariant). The ops read it where a
// kernel choice depends on the row count: there, batch-invariant mode keeps the one kernel whose
// per-row arithmetic is the same at every M (the AMX kernels serve only M >= 4, so they are off).
// Thread-local like the Python flag: two engines in one process do not disturb each other, and the
// choice is made on the calling thread before any OpenMP worker starts.
#pragma once

#include <cstdint>

#include "cpu_features.h"

namespace pagewire::cpu {

inline thread_local bool batch_invariant_mode = false;

// Whether the calling thread's linear ops may use the AMX kernels (server.kernels.autotune turns it
// off around a call whose shape and row count it measured faster on the AVX-512 kernel).
inline thread_local bool amx_allowed = true;

// Rows from which the linear ops hand an Isa::kAmx CPU's work to the AMX kernels (linear_amx.cpp):
// one B tile then feeds four 16 x M tile products; below it the AVX-512 kernels' dot products
// waste less of each instruction.
constexpr int64_t kAmxMinRows = 4;
// Q4_0 / Q4_1 in the x8 layout go to AMX tiles from 6 rows: their AMX body unpacks every nibble to a
// byte for the tile, which the VNNI kernel's dot products at 4 rows beat (0.77-0.85x AMX's time on
// SmolLM2's and a 32000 x 1024 shape), tie at 5 and lose from 6 (RESULTS, session 24). Q8_0's tiles
// need no unpacking and win from 4.
constexpr int64_t kAmxMinRowsQ4x8 = 6;

// Whether a linear op of M rows on family `isa` goes to the AMX kernels: an AMX CPU, enough rows,
// not batch-invariant mode, and not turned off for this call by the autotune.
inline bool use_amx(Isa isa, int64_t M) {
  return isa >= Isa::kAmx && M >= kAmxMinRows && !batch_invariant_mode && amx_allowed;
}

}  // namespace pagewire::cpu
