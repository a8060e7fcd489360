// lora_add: every row's own LoRA term for one fused projection in one call (lora_kernel.h has the
// arithmetic). This file checks the arguments, groups the rows by adapter (up to kLoraGroupRows
// rows read each A and Bᵀ line together), and runs the shrink tasks (group, pair of A rows) and
// then the expand tasks (kLoraBlock output columns each) in one parallel region, on the CPU family's
// body (AVX2, or the portable one below, which gives the same bits).
#include <ATen/core/Tensor.h>

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "../ops.h"
#include "cpu_features.h"
#include "lora_body.h"
#include "lora_kernel.h"

namespace pagewire {
namespace cpu {
namespace {

// avx2::hsum's lanes and order, and fma per lane, in portable C++.
struct P8 {
  struct Reg {
    float v[8];
  };
  static Reg zero() { return set1(0.0f); }
  static Reg set1(float f) {
    Reg r;
    for (float& x : r.v) x = f;
    return r;
  }
  template <class E>
  static Reg load(const E* p) {
    Reg r;
    for (int i = 0; i < 8; ++i) r.v[i] = to_float(p[i]);
    return r;
  }
  template <class E>
  static void store(E* p, Reg v) {
    for (int i = 0; i < 8; ++i) store_float(v.v[i], &p[i]);
  }
  template <class E>
  static Reg round(Reg v, const E*) {
    for (float& x : v.v) {
      E e;
      store_float(x, &e);
      x = to_float(e);
    }
    return v;
  }
  static Reg fma(Reg a, Reg b, Reg c) {
    for (int i = 0; i < 8; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return c;
  }
  static Reg mul(Reg a, Reg b) {
    for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static Reg add(Reg a, Reg b) {
    for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
    return a;
  }
  static float hsum(Reg r) {
    const float* v = r.v;
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
  }
};

}  // namespace

void lora_shrink_portable(const LoraProblem& pb, int64_t g, int64_t col) { lora_detail::shrink_any<P8>(pb, g, col); }

void lora_expand_portable(const LoraProblem& pb, int64_t p, int64_t j0, int64_t j1, int64_t ngroups) {
  lora_detail::expand_any<P8>(pb, p, j0, j1, ngroups);
}

}  // namespace cpu

namespace {

// Below this many multiply-adds a call runs on the calling thread (a parallel region costs a few µs).
constexpr int64_t kParallelMacs = 1 << 15;

cpu::LoraDtype lora_dtype(at::ScalarType t) {
  if (t == at::kFloat) return cpu::LoraDtype::kF32;
  if (t == at::kBFloat16) return cpu::LoraDtype::kBf16;
  TORCH_CHECK(t == at::kHalf, "lora_add: x must be float32, bfloat16 or float16, got ", t);
  return cpu::LoraDtype::kF16;
}

}  // namespace

void lora_add_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& adapter, const at::Tensor& a,
                  const at::Tensor& spans, const at::Tensor& scales, at::TensorList bts, at::IntArrayRef parts) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "lora_add: x must be a CPU [T, in] tensor contiguous in its last dim, got ", x.sizes());
  const auto dt = x.scalar_type();
  const cpu::LoraDtype ldt = lora_dtype(dt);
  const int64_t T = x.size(0), in = x.size(1);
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == dt && out.dim() == 2 && out.size(0) == T &&
                  out.stride(1) == 1,
              "lora_add: out must be [", T, ", N] of x's dtype, contiguous in its last dim, got ", out.scalar_type(),
              " ", out.sizes());
  const int64_t N = out.size(1);
  TORCH_CHECK(adapter.scalar_type() == at::kInt && adapter.dim() == 1 && adapter.size(0) == T &&
                  adapter.is_contiguous(),
              "lora_add: adapter must be contiguous int32 [", T, "], got ", adapter.scalar_type(), " ", adapter.sizes());
  TORCH_CHECK(a.scalar_type() == dt && a.dim() == 2 && a.size(1) == in && a.is_contiguous(),
              "lora_add: a must be contiguous [R, ", in, "] of x's dtype, got ", a.scalar_type(), " ", a.sizes());
  const int64_t R = a.size(0), P = static_cast<int64_t>(bts.size());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.is_contiguous(),
              "lora_add: scales must be contiguous float32 [n]");
  const int64_t n = scales.size(0);
  TORCH_CHECK(spans.scalar_type() == at::kInt && spans.dim() == 3 && spans.size(0) == n && spans.size(1) == P &&
                  spans.size(2) == 2 && spans.is_contiguous(),
              "lora_add: spans must be contiguous int32 [", n, ", ", P, ", 2], got ", spans.scalar_type(), " ",
              spans.sizes());
  TORCH_CHECK(static_cast<int64_t>(parts.size()) == 3 * P, "lora_add: parts must hold (row, rows, c0) for each of the ",
              P, " bts");
  std::vector<cpu::LoraPart> part(P);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t row = parts[3 * p], rows = parts[3 * p + 1], c0 = parts[3 * p + 2];
    const at::Tensor& bt = bts[p];
    TORCH_CHECK(row >= 0 && rows >= 0 && row + rows <= N, "lora_add: part ", p, "'s output columns [", row, ", ",
                row + rows, ") are outside out's ", N);
    TORCH_CHECK(bt.scalar_type() == dt && bt.dim() == 2 && bt.size(1) == rows && bt.is_contiguous() && c0 >= 0 &&
                    c0 + bt.size(0) <= R,
                "lora_add: bts[", p, "] must be contiguous [C, ", rows, "] of x's dtype covering rows [", c0,
                ", c0 + C) of a's ", R, ", got ", bt.scalar_type(), " ", bt.sizes());
    part[p] = {row, rows, c0, bt.data_ptr()};
  }
  // Each adapter's columns of u (the shrink's output) part after part.
  const int32_t* sp = spans.data_ptr<int32_t>();
  std::vector<int32_t> off(n * P);
  int64_t ldu = 0;
  for (int64_t k = 0; k < n; ++k) {
    int64_t c = 0;
    for (int64_t p = 0; p < P; ++p) {
      const int64_t first = sp[2 * (k * P + p)], cnt = sp[2 * (k * P + p) + 1];
      TORCH_CHECK(cnt >= 0 && (cnt == 0 || (first >= part[p].c0 && first + cnt <= part[p].c0 + bts[p].size(0))),
                  "lora_add: spans[", k, "][", p, "] = (", first, ", ", cnt, ") is outside bts[", p, "]'s rows of a");
      off[k * P + p] = static_cast<int32_t>(c);
      c += cnt;
    }
    ldu = std::max(ldu, c);
  }
  // Rows grouped by adapter, in row order, up to kLoraGroupRows a group.
  const int32_t* idx = adapter.data_ptr<int32_t>();
  std::vector<cpu::LoraGroup> groups;
  std::vector<int64_t> open(n, -1);
  int64_t macs = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t k = idx[t];
    if (k < 0) continue;
    TORCH_CHECK(k < n, "lora_add: adapter[", t, "] = ", k, " but there are ", n, " adapters");
    if (open[k] < 0 || groups[open[k]].n == cpu::kLoraGroupRows) {
      open[k] = static_cast<int64_t>(groups.size());
      groups.push_back({k, 0, {}});
    }
    cpu::LoraGroup& g = groups[open[k]];
    g.rows[g.n++] = static_cast<int32_t>(t);
    macs += in * (ldu + 1);
  }
  if (groups.empty() || ldu == 0) return;
  std::vector<std::pair<int32_t, int32_t>> shrink_tasks;
  for (size_t g = 0; g < groups.size(); ++g) {
    int64_t cols = 0;
    for (int64_t p = 0; p < P; ++p) cols += sp[2 * (groups[g].adapter * P + p) + 1];
    for (int64_t c = 0; c < cols; c += 2) shrink_tasks.emplace_back(static_cast<int32_t>(g), static_cast<int32_t>(c));
  }
  // Each part in equal runs of columns (a multiple of 8, at most kLoraBlock), their count a
  // multiple of the threads: dealt out round robin, every thread gets its share of every part.
  const bool parallel = macs >= kParallelMacs;
  const int64_t nt = parallel ? std::max(1, omp_get_max_threads()) : 1;
  std::vector<std::array<int32_t, 3>> expand_tasks;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t rows = part[p].rows;
    if (rows == 0) continue;
    int64_t chunks = (rows + cpu::kLoraBlock - 1) / cpu::kLoraBlock;
    chunks = std::min((chunks + nt - 1) / nt * nt, (rows + 7) / 8);
    const int64_t width = ((rows + chunks - 1) / chunks + 7) / 8 * 8;
    for (int64_t j = 0; j < rows; j += width)
      expand_tasks.push_back({static_cast<int32_t>(p), static_cast<int32_t>(j),
                              static_cast<int32_t>(std::min(rows, j + width))});
  }
  // The shrink's output, T rows (rows without an adapter are never read).
  thread_local std::vector<float> u;
  u.resize(static_cast<size_t>(T * ldu));
  const cpu::LoraProblem pb{ldt,        x.data_ptr(),  x.stride(0),   out.data_ptr(), out.stride(0),
                            a.data_ptr(), in,          part.data(),   P,              sp,
                            off.data(), scales.data_ptr<float>(), groups.data(), u.data(), ldu};
  const bool avx2 = cpu::active_isa() >= cpu::Isa::kAvx2;
  const int64_t ns = static_cast<int64_t>(shrink_tasks.size()), ne = static_cast<int64_t>(expand_tasks.size());
  const int64_t ng = static_cast<int64_t>(groups.size());
#pragma omp parallel if (parallel)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < ns; ++i) {
      if (avx2) cpu::lora_shrink_avx2(pb, shrink_tasks[i].first, shrink_tasks[i].second);
      else cpu::lora_shrink_portable(pb, shrink_tasks[i].first, shrink_tasks[i].second);
    }
    // (the implicit barrier: every u is written before any expand reads it)
#pragma omp for schedule(static, 1)
    for (int64_t i = 0; i < ne; ++i) {
      const auto& e = expand_tasks[i];
      if (avx2) cpu::lora_expand_avx2(pb, e[0], e[1], e[2], ng);
      else cpu::lora_expand_portable(pb, e[0], e[1], e[2], ng);
    }
  }
}

}  // namespace pagewire
