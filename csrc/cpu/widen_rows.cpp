// widen_rows: bf16 logits [S, V] -> float32, exactly (compute_logits' last step on the CPU).
//
// Why an op of its own: a bf16 model's lm_head leaves bf16 logits, and the sampler reads float32.
// torch's `.float()` splits the copy of one 49,152-value row over the team: a region, and half the
// row read out of the other core's cache, since FloatOut::finish rounded a single row on the
// engine thread. Right after a step, SmolLM2's widening and argmax took 29.6 + 20.3 us that way
// (Q4_0; 45.2 + 28.8 on Q4_1) against 26.9 + 16.0 here (33.8 + 24.5): the copy itself waits on
// the cold output lines either way (issue 31's engine overhead, bench/RESULTS.md session 32). Several
// rows were rounded by each thread's column slice (FloatOut::round_slice), so they are widened in
// the same slices, each core reading what it wrote.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>

#include <cstdint>

#include "../ops.h"
#include "cpu_features.h"
#include "quant_kernel.h"

namespace pagewire {

namespace {

// Values from which several rows are widened by the team (FloatOut::kParallelConvert's rule).
constexpr int64_t kParallelWiden = 1 << 12;

}  // namespace

at::Tensor widen_rows_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              "widen_rows: x must be a bfloat16 [S, V] CPU tensor, got ", x.scalar_type(), " ", x.sizes(), " on ",
              x.device());
  const at::Tensor xc = x.contiguous();
  const int64_t S = xc.size(0), V = xc.size(1);
  at::Tensor out = at::empty({S, V}, xc.options().dtype(at::kFloat));
  if (S * V == 0) return out;
  const auto widen = cpu::active_isa() != cpu::Isa::kPortable ? cpu::bf16_to_f32_avx2 : cpu::bf16_to_f32;
  const uint16_t* src = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  float* dst = out.data_ptr<float>();
  if (S < 2 || S * V < kParallelWiden || omp_get_max_threads() < 2) {
    widen(src, dst, S * V);
    return out;
  }
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t c0 = V * t / nt, c1 = V * (t + 1) / nt;
    for (int64_t s = 0; s < S; ++s) widen(src + s * V + c0, dst + s * V + c0, c1 - c0);
  }
  return out;
}

}  // namespace pagewire
