// The interleaved bf16 weight ops: interleave_bf16 / deinterleave_bf16 (the x8 layout of
// cpu/linear_kernel.h and back), linear_bf16x8 (x @ w^T + bias through linear_bf16x8_avx2, or
// linear_bf16x8_avx512 on AVX512-BF16 CPUs) and embedding_bf16x8 (rows gathered from the x8 layout:
// a tied table serves both ends of the model). The engine interleaves a bf16 model's decoder
// matrices on AVX2 and AVX512-BF16 CPUs (DecoderForCausalLM.interleave_bf16,
// server.kernels.quant.QuantizedWeight.from_bf16); a weight so moved has no row layout left, so
// every path that needs one (ATen's GEMM for long prefill chunks on AVX512-BF16 or in the
// autotune's other choice, a CPU forced below AVX2, fp32 activations) de-interleaves a copy.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>

#include <cstring>
#include <vector>

#include "../ops.h"
#include "chunked_gemm.h"
#include "cpu_features.h"
#include "dispatch_mode.h"
#include "float_rows.h"
#include "linear_kernel.h"

namespace pagewire {

namespace {

constexpr int64_t kRows = cpu::kBf16Interleave;
// Rows up to which AVX512-BF16 CPUs run the x8 kernel; above it ATen's bf16 GEMM (oneDNN) on
// de-interleaved chunks. On a Zen 5 the kernel took 0.70-1.02x the time of torch's GEMM on the row
// layout from 24 to 128 rows and 1.07-1.19x at 256, the chunks 1.11-1.22x at 256 and 1.05-1.09x at
// 512 (bench/RESULTS.md, session 25). AVX2 has no native bf16 GEMM and runs the kernel at every M.
constexpr int64_t kKernelMaxRowsAvx512 = 256;

void check_x8(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "weight must be a contiguous CPU uint8 [N, 2K] tensor (bf16 in the x8 layout), got ", w.scalar_type(),
              " ", w.sizes());
  TORCH_CHECK(w.size(1) % 32 == 0 && w.size(1) > 0, "weight: K = ", w.size(1) / 2,
              " must be a positive multiple of 16 for the x8 bf16 layout");
}

// Moves rows between the row layout (src_row) and the x8 layout (dst_x8), either way: one group's
// chunk c of row r sits at (c * 8 + r) * 16 values into the group.
// Groups are independent, so the threads split them (from 64 K values: a prefill chunk or a whole
// matrix at load; below, one thread is cheaper than waking the team).
void move_groups(const uint16_t* src, uint16_t* dst, int64_t N, int64_t K, bool to_x8) {
  const int64_t groups = N / kRows;
#pragma omp parallel for schedule(static) if (groups * kRows * K >= 65536)
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t c = 0; c < K / 16; ++c) {  // chunk-major: the x8 side is read or written in order
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t row_at = (g * kRows + r) * K + c * 16, x8_at = g * kRows * K + (c * kRows + r) * 16;
        std::memcpy(dst + (to_x8 ? x8_at : row_at), src + (to_x8 ? row_at : x8_at), 32);
      }
    }
  }
  const int64_t done = groups * kRows;  // the last N % 8 rows stay in row layout
  std::memcpy(dst + done * K, src + done * K, (N - done) * K * 2);
}

}  // namespace

at::Tensor interleave_bf16_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "weight must be a CPU bf16 [N, K] tensor, got ", weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(weight.size(1) % 16 == 0 && weight.size(1) > 0, "weight: K = ", weight.size(1),
              " must be a positive multiple of 16 for the x8 bf16 layout");
  const at::Tensor wc = weight.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  at::Tensor out = at::empty({N, 2 * K}, wc.options().dtype(at::kByte));
  move_groups(reinterpret_cast<const uint16_t*>(wc.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()), N, K,
              true);
  return out;
}

at::Tensor deinterleave_bf16_cpu(const at::Tensor& weight) {
  check_x8(weight);
  const int64_t N = weight.size(0), K = weight.size(1) / 2;
  at::Tensor out = at::empty({N, K}, weight.options().dtype(at::kBFloat16));
  move_groups(reinterpret_cast<const uint16_t*>(weight.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()), N,
              K, false);
  return out;
}

at::Tensor embedding_bf16x8_cpu(const at::Tensor& ids, const at::Tensor& weight) {
  check_x8(weight);
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong, "ids must be a CPU int64 tensor, got ",
              ids.scalar_type(), " on ", ids.device());
  const int64_t N = weight.size(0), K = weight.size(1) / 2, groups = N / kRows;
  const at::Tensor ic = ids.contiguous();
  std::vector<int64_t> shape(ic.sizes().begin(), ic.sizes().end());
  shape.push_back(K);
  at::Tensor out = at::empty(shape, weight.options().dtype(at::kBFloat16));
  const int64_t* id = ic.data_ptr<int64_t>();
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t t = 0; t < ic.numel(); ++t) {
    const int64_t row = id[t];
    TORCH_CHECK_INDEX(row >= 0 && row < N, "index ", row, " is out of range for an embedding table of ", N, " rows");
    if (row >= groups * kRows) {
      std::memcpy(o + t * K, w + row * K, K * 2);
      continue;
    }
    const uint16_t* g = w + row / kRows * kRows * K + row % kRows * 16;
    for (int64_t c = 0; c < K / 16; ++c) std::memcpy(o + t * K + c * 16, g + c * kRows * 16, 32);
  }
  return out;
}

at::Tensor linear_bf16x8_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_x8(weight);
  const int64_t N = weight.size(0), K = weight.size(1) / 2;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K, "x must be a CPU [M, K] tensor with K = ", K,
              ", got ", x.sizes(), " on ", x.device());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be floating point, got ", x.scalar_type());
  const bool has_bias = cpu::check_bias(bias, N, x);
  if (x.scalar_type() != at::kBFloat16 || cpu::active_isa() == cpu::Isa::kPortable || x.requires_grad()) {
    return at::linear(x, deinterleave_bf16_cpu(weight).to(x.scalar_type()), bias);
  }
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
  const int64_t M = xc.size(0);
  const bool avx512 = cpu::active_isa() >= cpu::Isa::kAvx512Bf16;
  if (avx512 && M > kKernelMaxRowsAvx512 && !cpu::batch_invariant_mode) {
    // Long prefill chunks: ATen's bf16 GEMM (oneDNN's native dot products) on de-interleaved chunks
    // of rows; batch-invariant mode keeps the kernel, whose rows do not depend on M.
    const uint16_t* src = reinterpret_cast<const uint16_t*>(weight.data_ptr());
    // One buffer per calling thread (the engine thread), reused across chunks and calls: a fresh
    // allocation of a chunk per call costs its page faults every time. Each chunk's GEMM is done
    // with the buffer before the next chunk overwrites it (chunked_gemm runs them in order).
    thread_local std::vector<uint16_t> buffer;
    return cpu::chunked_gemm(xc, N, bias, has_bias, [&](int64_t n0, int64_t rows) {
      if (static_cast<int64_t>(buffer.size()) < rows * K) buffer.resize(rows * K);
      // n0 is a multiple of 8 (chunked_gemm never splits a group); a chunk ending past the last
      // group holds the row-layout rows too, which move_groups copies as they are.
      move_groups(src + n0 * K, buffer.data(), rows, K, false);
      return at::from_blob(buffer.data(), {rows, K}, weight.options().dtype(at::kBFloat16));
    });
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  (avx512 ? cpu::linear_bf16x8_avx512 : cpu::linear_bf16x8_avx2)(
      reinterpret_cast<const uint16_t*>(xc.data_ptr()), xc.stride(0), reinterpret_cast<const uint16_t*>(weight.data_ptr()),
      has_bias ? reinterpret_cast<const uint16_t*>(bc.data_ptr()) : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr()),
      N, M, N, K);
  return out;
}

}  // namespace pagewire
