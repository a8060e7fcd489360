// Quantised matrix products as one OpenMP region's jobs: several matrices (an MoE layer's chosen
// experts, a fused matrix's row ranges in different block formats) laid end to end and split into
// even row shares across the threads, each share run through the per-format kernels (the x8 kernel
// for whole groups of eight rows, the format's row kernel for the rest), with the activations
// quantised once to Q8 blocks with block sums (QuantRows).
//
// Used by moe_decode_cpu (cpu/moe_decode.cpp) and layer_parts::linear_parts_region
// (cpu/linear_parts.cpp). Which thread runs a row never changes its floats: each output row is one
// kernel's, whole (batch invariance).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "dispatch_mode.h"  // use_amx
#include "quant4_kernel.h"
#include "quant_kernel.h"

namespace pagewire::quant_jobs {

// A quantised matrix kind as decode_layer names it: Q8_0 or a linear_q4 type, row or x8 layout.
struct Format {
  bool q8 = false, x8 = false;
  cpu::Q4Type t = cpu::Q4Type::kQ4_0;
};

inline bool parse_format(const std::string& kind, Format* f) {
  if (kind == "q8_0" || kind == "q8_0x8") {
    f->q8 = true;
    f->x8 = kind == "q8_0x8";
    return true;
  }
  return cpu::parse_q4_name(kind, &f->t, &f->x8);
}

inline int64_t row_bytes_for(const Format& f, int64_t K) {
  return f.q8 ? K / cpu::kQ8Block * cpu::kQ8BlockBytes
              : K / cpu::q4_block_values(f.t) * cpu::q4_block_bytes(f.t);
}

// One matrix product of the region: act [M, K] (Q8 blocks) @ w^T (+ bias) -> out [M, N] (row stride ldo).
struct Job {
  Format f;
  const uint8_t* w;
  int64_t row_bytes, N;
  const float* bias;  // fp32 [N] or nullptr
  cpu::Q8SumActivations act;
  float* out;
  int64_t ldo;
  int64_t start;  // first row in the phase's row space (a multiple of 8)
};

// Rows [r0, r1) of a job on this thread (r0 a multiple of 8): the x8 kernel for whole groups, the
// format's row kernel for the rest -- the dispatch of linear_q8_0_cpu / linear_q4_cpu.
inline void run_rows(const Job& j, int64_t r0, int64_t r1, cpu::Isa isa) {
  const int64_t grouped = j.f.x8 ? j.N / 8 * 8 : 0;
  while (r0 < r1) {
    const bool x8 = r0 < grouped;
    const int64_t e = x8 ? std::min(r1, grouped) : r1, n = e - r0;
    const uint8_t* w = j.w + r0 * j.row_bytes;
    const float* b = j.bias != nullptr ? j.bias + r0 : nullptr;
    float* o = j.out + r0;
    if (j.f.q8) {
      const cpu::Q8Activations a{j.act.q, j.act.d, j.act.M, j.act.K};
      if (x8) {
        (isa >= cpu::Isa::kAvx512 ? cpu::linear_q8_0x8_vnni : cpu::linear_q8_0x8_avx2)(a, w, b, o, j.ldo, n);
      } else {
        (cpu::use_amx(isa, a.M)        ? cpu::linear_q8_0_amx
         : isa >= cpu::Isa::kAvx512 ? cpu::linear_q8_0_avx512
                                    : cpu::linear_q8_0_avx2)(a, w, b, o, j.ldo, n);
      }
    } else if (x8) {
      (isa >= cpu::Isa::kAvx512 ? cpu::linear_q4x8_vnni : cpu::linear_q4x8_avx2)(j.f.t, j.act, w, b, o, j.ldo, n);
    } else {
      (isa >= cpu::Isa::kAvx512 ? cpu::linear_q4_avx512 : cpu::linear_q4_avx2)(j.f.t, j.act, w, b, o, j.ldo, n);
    }
    r0 = e;
  }
}

// This thread's share of a phase: rows [total * t / nt, total * (t + 1) / nt) of the jobs laid end
// to end, boundaries rounded to 8 rows (an x8 group is never split).
inline void run_share(const std::vector<Job>& jobs, int64_t total, int t, int nt, cpu::Isa isa) {
  const int64_t lo = (total * t / nt) / 8 * 8, hi = t + 1 == nt ? total : (total * (t + 1) / nt) / 8 * 8;
  for (const Job& j : jobs) {
    const int64_t a = std::max(lo, j.start), b = std::min(hi, j.start + j.N);
    if (a < b) run_rows(j, a - j.start, b - j.start, isa);
  }
}

inline int64_t lay_out(std::vector<Job>& jobs) {
  int64_t at = 0;
  for (Job& j : jobs) {
    j.start = at;
    at = (at + j.N + 7) / 8 * 8;
  }
  return at;
}

// Activations quantised per row to Q8 blocks with block sums (what both kernel families read).
struct QuantRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  void quantize(const float* x, int64_t M, int64_t K) {
    q.resize(M * K);
    d.resize(M * K / 32);
    s.resize(M * K / 32);
    cpu::quantize_rows_q8_avx2(x, K, M, K, q.data(), d.data(), s.data());
  }
  // Room for M rows of K values (grows, never shrinks).
  void resize(int64_t M, int64_t K) {
    if (static_cast<int64_t>(q.size()) < M * K) q.resize(M * K);
    if (static_cast<int64_t>(d.size()) < M * K / 32) {
      d.resize(M * K / 32);
      s.resize(M * K / 32);
    }
  }
  cpu::Q8SumActivations view(int64_t M, int64_t K) const { return {q.data(), d.data(), s.data(), M, K}; }
};

}  // namespace pagewire::quant_jobs
