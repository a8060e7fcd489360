// maybe_parallel_for: a loop split over the OpenMP team only when it has work enough, and a plain
// loop on the calling thread otherwise -- without entering libgomp at all.
//
// Why not `#pragma omp parallel for if (cond)`: with the condition false, GCC still calls
// GOMP_parallel, which builds a team of one for the loop (about 0.3 us with warm caches, more right
// after a weight stream has flushed them). A SmolLM2 decode step ran about 180 such one-thread
// regions (norms, RoPE, the KV write, the gated activation: six a layer), the other core idle
// through each (bench/RESULTS.md, session 27).
//
// row_scratch: a per-thread float buffer that grows and is kept, for the row loops that needed a
// std::vector per call (a heap allocation and free per op per thread).
#pragma once

#include <omp.h>

#include <cstdint>
#include <vector>

namespace pagewire::cpu {

// body(i) for i in [0, n): a static split over the team when `parallel` (each i computed whole by
// one thread, so the split never changes a result), else in order on this thread.
template <class Body>
inline void maybe_parallel_for(int64_t n, bool parallel, const Body& body) {
  if (parallel && n > 1) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) body(i);
  } else {
    for (int64_t i = 0; i < n; ++i) body(i);
  }
}

// This thread's float buffer number `slot` (0-3), at least n floats; valid until this thread asks
// for the same slot again.
inline float* row_scratch(int64_t n, int slot = 0) {
  thread_local std::vector<float> buffers[4];
  std::vector<float>& b = buffers[slot];
  if (static_cast<int64_t>(b.size()) < n) b.resize(static_cast<size_t>(n));
  return b.data();
}

}  // namespace pagewire::cpu
