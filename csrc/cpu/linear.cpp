// The pagewire::linear CPU op: bf16 x @ weight^T (+ bias) through the small-batch kernel of the
// best instruction set this CPU has (AMX tiles from 4 rows, AVX512-BF16, or AVX2+FMA, chosen by
// CPUID at load, see cpu_features.h), fp32 through the AVX2 fp32 kernel (deterministic mode's batch-invariant path),
// and ATen's linear for every other case so the result always has F.linear's semantics.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include "../ops.h"
#include "cpu_features.h"
#include "dispatch_mode.h"
#include "linear_kernel.h"

namespace pagewire {

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "x and weight must be CPU tensors, got ", x.device(),
              " and ", weight.device());
  TORCH_CHECK(weight.dim() == 2, "weight must be [N, K], got shape ", weight.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "x must be [..., K] with K = weight.size(1) = ",
              weight.size(1), ", got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x dtype ", x.scalar_type(), " must equal weight dtype ",
              weight.scalar_type());
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->device().is_cpu(), "bias must be a CPU tensor, got ", bias->device());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "bias must be [N] with N = ", weight.size(0),
                ", got shape ", bias->sizes());
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "bias dtype ", bias->scalar_type(), " must equal x dtype ",
                x.scalar_type());
  }
  const int64_t K = weight.size(1), N = weight.size(0);
  const bool is_f32 = x.scalar_type() == at::kFloat;
  const bool kernel_applies = (x.scalar_type() == at::kBFloat16 || is_f32) && x.dim() == 2 && K > 0 && N > 0 &&
                              !x.requires_grad() && !weight.requires_grad() &&
                              !(has_bias && bias->requires_grad());
  const cpu::Isa isa = cpu::active_isa();
  if (!kernel_applies || isa == cpu::Isa::kPortable) return at::linear(x, weight, bias);

  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor wc = weight.contiguous();
  const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
  const int64_t M = xc.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  if (is_f32) {  // one kernel for both ISAs: AVX-512 machines run AVX2 code too
    cpu::linear_f32_avx2(xc.data_ptr<float>(), xc.stride(0), wc.data_ptr<float>(),
                         has_bias ? bc.data_ptr<float>() : nullptr, out.data_ptr<float>(), N, M, N, K);
    return out;
  }
  // AMX tiles from kAmxMinRows rows, where a tile product has enough rows to pay for itself; below,
  // the AVX512-BF16 dot products. Batch-invariant mode keeps one kernel for every M.
  const auto kernel = cpu::use_amx(isa, M)          ? cpu::linear_bf16_amx
                      : isa >= cpu::Isa::kAvx512Bf16 ? cpu::linear_bf16_avx512
                                                     : cpu::linear_bf16_avx2;
  kernel(reinterpret_cast<const uint16_t*>(xc.data_ptr()), xc.stride(0),
         reinterpret_cast<const uint16_t*>(wc.data_ptr()),
         has_bias ? reinterpret_cast<const uint16_t*>(bc.data_ptr()) : nullptr,
         reinterpret_cast<uint16_t*>(out.data_ptr()), N, M, N, K);
  return out;
}

}  // namespace pagewire
