// The pieces of a fused CPU decode layer that more than one layer op uses (defined in
// decode_layer.cpp; hybrid_decode.cpp's Gated DeltaNet and gated-attention layers call them too),
// each the C++ twin of a step of the Python layers (server/models/decoder.py).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string>
#include <vector>

namespace pagewire::layer_parts {

// x @ w^T (+ b) by the path ops.linear would take, named by ops.linear_kind: "kernel", "torch",
// "q8_0", "q8_0x8", or a linear_q4 qtype.
at::Tensor run_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                      const std::string& kind);
// One row range of a "parts:" weight (decode_layer.cpp run_parts): its linear kind and its block
// bytes [rows, row bytes] (a view of the weight's buffer).
struct LinearPart {
  std::string kind;
  at::Tensor w;
};
// x [M, K] @ every part's rows (+ bias [sum of rows]) in one OpenMP region (cpu/linear_parts.cpp, as
// moe_decode runs its experts: x quantised once, the parts' rows laid end to end and split across
// the threads), the result [M, sum of rows] in x's dtype: per element what run_linear gives part by
// part. Undefined where there is no such region (the portable family, more than 16 rows, a
// part's format or row size it does not know): the caller then runs the parts one by one.
at::Tensor linear_parts_region(const at::Tensor& x, const std::vector<LinearPart>& parts,
                               const c10::optional<at::Tensor>& bias);
// The Python layer's _enter: hidden += delta (in place, when given), then RMSNorm by norm (one fused op).
at::Tensor enter(at::Tensor& hidden, const c10::optional<at::Tensor>& delta, const c10::optional<at::Tensor>& norm,
                 double eps);
// The Python layer's _leave: post-normed (when post_norm is given), then scaled by residual_multiplier.
at::Tensor leave(const at::Tensor& out, const c10::optional<at::Tensor>& post_norm, double eps,
                 double residual_multiplier);
// server/models/layers.py rms_norm op for op (torch ops: fp32 statistics, transformers' rounding).
at::Tensor torch_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

}  // namespace pagewire::layer_parts
