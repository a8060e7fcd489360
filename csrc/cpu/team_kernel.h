// Whether the calling thread runs its share of a kernel for a team that is already open
// (float_rows.h fused_linear), rather than a kernel call of its own. omp_in_parallel() cannot
// tell the two apart: the MoE layer calls the same kernels from inside its own region, one
// expert per thread, and each such call must do the whole product.
#pragma once

namespace pagewire::cpu {

inline thread_local bool t_team_kernel = false;

inline bool in_team_kernel() { return t_team_kernel; }

// Marks this thread's share of a team kernel for the scope's lifetime.
struct TeamKernelScope {
  TeamKernelScope() { t_team_kernel = true; }
  ~TeamKernelScope() { t_team_kernel = false; }
  TeamKernelScope(const TeamKernelScope&) = delete;
  TeamKernelScope& operator=(const TeamKernelScope&) = delete;
};

}  // namespace pagewire::cpu
