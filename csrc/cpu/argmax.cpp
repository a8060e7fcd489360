// argmax_rows: each row's argmax of a float32 or bf16 [S, V] CPU tensor (the greedy sampler's token), the
// first index on ties and a NaN counting as the largest, as torch.argmax and numpy.argmax choose.
//
// Why an op of its own: a decode step's logits come out of the lm_head kernel, which splits the
// vocabulary into one contiguous slice per thread (x8_body.h, for_each_group's static schedule),
// and so does their rounding (FloatOut::finish) and torch's bf16 -> fp32 copy after it. One thread
// reading the whole row then pulls half of it out of the other core's cache: numpy's argmax took
// 25-30 us on SmolLM2's 49,152 logits right after a step (cold), about 1 % of the step (issue 31's
// engine overhead). Here each thread scans the slice of every row its core just wrote, in the same
// split (N * t / nt), and the engine thread combines the slices' winners.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>

#include <vector>

#include "../ops.h"
#include "argmax_kernel.h"
#include "cpu_features.h"

namespace pagewire {

namespace cpu {

namespace {
template <typename T>
int64_t scan_scalar(const T* x, int64_t n, bool* is_nan, float (*value)(T)) {
  int64_t best = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float v = value(x[j]);
    if (v != v) {
      *is_nan = true;
      return j;
    }
    if (v > value(x[best])) best = j;
  }
  *is_nan = false;
  return best;
}
}  // namespace

int64_t argmax_slice(const float* x, int64_t n, bool* is_nan) { return scan_scalar(x, n, is_nan, f32_value); }
int64_t argmax_slice_bf16(const uint16_t* x, int64_t n, bool* is_nan) { return scan_scalar(x, n, is_nan, bf16_value); }
}  // namespace cpu

namespace {

// Values from which the rows' slices are scanned by the whole team: below it one thread is
// faster than waking the other (a vocabulary is 32k-256k values a row).
constexpr int64_t kParallelArgmax = 1 << 14;

struct SliceBest {
  int64_t index;
  bool nan;
};

template <typename T>
void argmax_rows_impl(const T* xp, int64_t S, int64_t V, int64_t ld, int64_t* op,
                      int64_t (*scan)(const T*, int64_t, bool*), float (*value)(T)) {
  // One bf16 row was rounded from the kernel's floats by the engine thread alone (FloatOut::finish,
  // M < 2), so it is all in this core's cache: a team would pull half of it across (SmolLM2's row:
  // 12 us with the team, 7 alone, right after a step). Float32 rows come straight from the kernel's
  // column split, each slice in the core that wrote it.
  const bool one_writer = S == 1 && sizeof(T) == 2;
  const int nt = !one_writer && S * V >= kParallelArgmax ? omp_get_max_threads() : 1;
  if (nt <= 1 || V < 2 * nt) {
    for (int64_t s = 0; s < S; ++s) {
      bool nan = false;
      op[s] = scan(xp + s * ld, V, &nan);
    }
    return;
  }
  // best[s * nt + t]: the winner of thread t's slice of row s (its index in the row).
  std::vector<SliceBest> best(static_cast<size_t>(S * nt));
#pragma omp parallel num_threads(nt)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t c0 = V * t / n, c1 = V * (t + 1) / n;
    for (int64_t s = 0; s < S; ++s) {
      bool nan = false;
      const int64_t j = scan(xp + s * ld + c0, c1 - c0, &nan);
      best[s * nt + t] = {c0 + j, nan};
    }
    // A team smaller than asked for leaves its slots unused: mark them.
    if (t == 0) {
      for (int64_t u = n; u < nt; ++u) {
        for (int64_t s = 0; s < S; ++s) best[s * nt + u] = {-1, false};
      }
    }
  }
  for (int64_t s = 0; s < S; ++s) {
    const T* row = xp + s * ld;
    int64_t win = -1;
    bool win_nan = false;
    // Slices in column order: a later slice wins only with a strictly larger value (ties keep
    // the first index), and the first slice holding a NaN wins outright.
    for (int t = 0; t < nt; ++t) {
      const SliceBest b = best[s * nt + t];
      if (b.index < 0) continue;
      if (win < 0 || (b.nan && !win_nan) || (!win_nan && value(row[b.index]) > value(row[win]))) {
        win = b.index;
        win_nan = b.nan;
      }
      if (win_nan) break;
    }
    op[s] = win;
  }
}

}  // namespace

bool argmax_rows_applies(const at::Tensor& x) {
  return x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
         x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1;
}

at::Tensor argmax_rows_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2,
              "argmax_rows: x must be a float32 or bfloat16 [S, V] CPU tensor, got ", x.scalar_type(), " ",
              x.sizes(), " on ", x.device());
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: x has no columns");
  TORCH_CHECK(x.stride(1) == 1, "argmax_rows: x must be contiguous in its last dim");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  argmax_rows_into(x, out.data_ptr<int64_t>());
  return out;
}

void argmax_rows_into(const at::Tensor& x, int64_t* op) {
  const int64_t S = x.size(0), V = x.size(1), ld = x.stride(0);
  if (S == 0) return;
  const bool vec = cpu::active_isa() != cpu::Isa::kPortable;
  if (x.scalar_type() == at::kFloat) {
    argmax_rows_impl<float>(x.data_ptr<float>(), S, V, ld, op, vec ? cpu::argmax_slice_avx2 : cpu::argmax_slice,
                            cpu::f32_value);
  } else {
    argmax_rows_impl<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()), S, V, ld, op,
                               vec ? cpu::argmax_slice_bf16_avx2 : cpu::argmax_slice_bf16, cpu::bf16_value);
  }
}
}  // namespace pagewire
