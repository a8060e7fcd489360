// Whether the calling thread runs its share of a kernel for a team that is already open
// (float_rows.h fused_linear), rather than a kernel call of its own. omp_in_parallel() cannot
// tell the two apart: the MoE layer calls the same kernels from inside its own region, one
// expert per thread, and each such call must do the whole product.
#pragma once

#include <omp.h>

#include <cstdint>

#include "crew.h"

namespace pagewire::cpu {

inline thread_local bool t_team_kernel = false;
inline thread_local bool t_team_asked = false;

// A kernel that can split its loop over an open team asks this before choosing how to loop (and
// so records that it asked: a kernel that never does would run the whole product on every thread
// of the team, the same floats at twice the cost, which no output comparison can see).
inline bool in_team_kernel() {
  t_team_asked = true;
  return t_team_kernel;
}

// Marks this thread's share of a team kernel for the scope's lifetime; asked() says whether the
// kernel run inside it asked in_team_kernel().
struct TeamKernelScope {
  TeamKernelScope() {
    t_team_kernel = true;
    t_team_asked = false;
  }
  ~TeamKernelScope() { t_team_kernel = false; }
  bool asked() const { return t_team_asked; }
  TeamKernelScope(const TeamKernelScope&) = delete;
  TeamKernelScope& operator=(const TeamKernelScope&) = delete;
};

// The threads a kernel's loop will split over: the open team's inside a team kernel.
// (A crew's leader: the crew's, team_for hands the loop to it.)
inline int team_threads() {
  if (in_team_kernel()) return omp_get_num_threads();
  return t_crew != nullptr ? t_crew->size() : omp_get_max_threads();
}

// body(i) for i in [0, n), a static split (each thread one contiguous slice, so one sequential
// stream of the weight): inside a team kernel this thread's share (the orphaned loop binds to the
// open team), on a crew's leader the crew's shares, otherwise a region of its own when `parallel`
// (enough work to wake the team).
template <class Body>
void team_for(int64_t n, bool parallel, const Body& body) {
  if (in_team_kernel()) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  // Not `parallel for if (parallel)`: a false condition still builds a team of one in libgomp
  // (maybe_parallel.h). Inside another region (moe_decode's, linear_parts_region's: each thread
  // runs whole kernels on its own rows) a nested region would be a team of one as well, entered
  // and left per expert matrix: the loop runs here instead. A Qwen3-MoE-shaped layer's expert
  // phases took 60 / 33 us against 67 / 38 (bench/RESULTS.md, session 30).
  if (parallel && t_crew != nullptr) {  // crew.h: the leader's share, the members' shares
    t_crew->run([&](int t, int nt) {
      for (int64_t i = n * t / nt, end = n * (t + 1) / nt; i < end; ++i) body(i);
    });
    return;
  }
  if (parallel && !omp_in_parallel()) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) body(i);
  } else {
    for (int64_t i = 0; i < n; ++i) body(i);
  }
}

}  // namespace pagewire::cpu
