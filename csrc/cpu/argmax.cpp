// argmax_rows: each row's argmax of a float32 [S, V] CPU tensor (the greedy sampler's token), the
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

int64_t argmax_slice(const float* x, int64_t n, bool* is_nan) {
  int64_t best = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (x[j] != x[j]) {
      *is_nan = true;
      return j;
    }
    if (x[j] > x[best]) best = j;
  }
  *is_nan = false;
  return best;
}

}  // namespace cpu

namespace {

// Values from which the rows' slices are scanned by the whole team: below it one thread is
// faster than waking the other (a vocabulary is 32k-256k values a row).
constexpr int64_t kParallelArgmax = 1 << 14;

struct SliceBest {
  int64_t index;
  bool nan;
};

}  // namespace

at::Tensor argmax_rows_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "argmax_rows: x must be a float32 [S, V] CPU tensor, got ", x.scalar_type(), " ", x.sizes(), " on ",
              x.device());
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: x has no columns");
  TORCH_CHECK(x.stride(1) == 1, "argmax_rows: x must be contiguous in its last dim");
  const int64_t S = x.size(0), V = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({S}, x.options().dtype(at::kLong));
  if (S == 0) return out;
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const auto scan = cpu::active_isa() != cpu::Isa::kPortable ? cpu::argmax_slice_avx2 : cpu::argmax_slice;
  const int nt = S * V >= kParallelArgmax ? omp_get_max_threads() : 1;
  if (nt <= 1 || V < 2 * nt) {
    for (int64_t s = 0; s < S; ++s) {
      bool nan = false;
      op[s] = scan(xp + s * ld, V, &nan);
    }
    return out;
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
    const float* row = xp + s * ld;
    int64_t win = -1;
    bool win_nan = false;
    // Slices in column order: a later slice wins only with a strictly larger value (ties keep
    // the first index), and the first slice holding a NaN wins outright.
    for (int t = 0; t < nt; ++t) {
      const SliceBest b = best[s * nt + t];
      if (b.index < 0) continue;
      if (win < 0 || (b.nan && !win_nan) || (!win_nan && row[b.index] > row[win])) {
        win = b.index;
        win_nan = b.nan;
      }
      if (win_nan) break;
    }
    op[s] = win;
  }
  return out;
}

}  // namespace pagewire
