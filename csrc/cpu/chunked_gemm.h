// The quantised and x8 bf16 linear ops' prefill path, shared by linear_q4.cpp, linear_q8.cpp and
// linear_bf16x8.cpp (kept out of float_rows.h, which every integer kernel file includes, so that
// only these pull in ATen's linear).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include <algorithm>
#include <cstdint>

namespace pagewire::cpu {

// Prefill past the integer kernels' row limit: x [M, K] times a block-quantised weight [N, K]
// through ATen's GEMM on dequantised chunks of rows, each about 2 MB of fp32 (so the copy stays in
// cache and memory never holds the whole dequantised matrix) and a multiple of 8 rows (an
// interleaved weight's groups are never split). rows_fp32(n0, rows) -> fp32 [rows, K], or rows
// already in x's dtype (linear_bf16x8.cpp hands over de-interleaved bf16 rows).
template <class RowsFp32>
at::Tensor chunked_gemm(const at::Tensor& x, int64_t N, const c10::optional<at::Tensor>& bias, bool has_bias,
                        const RowsFp32& rows_fp32) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  const int64_t chunk = (std::max<int64_t>(64, (int64_t{1} << 19) / K) + 7) / 8 * 8;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t rows = std::min(chunk, N - n0);
    const at::Tensor w = rows_fp32(n0, rows).to(x.scalar_type());
    const c10::optional<at::Tensor> b =
        has_bias ? c10::optional<at::Tensor>(bias->narrow(0, n0, rows)) : c10::optional<at::Tensor>();
    out.narrow(1, n0, rows).copy_(at::linear(x, w, b));
  }
  return out;
}

}  // namespace pagewire::cpu
