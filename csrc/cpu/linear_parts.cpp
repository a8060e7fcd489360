// layer_parts::linear_parts_region (declared in layer_parts.h): a matrix whose row ranges are in
// different block formats (a GGUF Q4_K_M file's Q4_K q/k + Q6_K v qkv) in one region, x quantised
// once, for decode_layer's "parts:" kind; the rows run as quant_jobs.h's jobs.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <vector>

#include "../ops.h"
#include "cpu_features.h"
#include "crew.h"  // team_size, team_region
#include "float_rows.h"
#include "layer_parts.h"
#include "quant_jobs.h"

namespace pagewire {

namespace layer_parts {

using quant_jobs::Format;
using quant_jobs::Job;
using quant_jobs::QuantRows;

at::Tensor linear_parts_region(const at::Tensor& x, const std::vector<LinearPart>& parts,
                               const c10::optional<at::Tensor>& bias) {
  const cpu::Isa isa = cpu::active_isa();
  const int64_t M = x.size(0), K = x.size(1);
  if (isa == cpu::Isa::kPortable || x.dim() != 2 || M == 0 || M > kQ8KernelMaxRows || K % 32 != 0) return {};
  std::vector<Format> formats(parts.size());
  int64_t N = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& w = parts[i].w;
    if (!quant_jobs::parse_format(parts[i].kind, &formats[i]) || w.dim() != 2 || w.scalar_type() != at::kByte ||
        !w.is_contiguous() || w.size(1) != quant_jobs::row_bytes_for(formats[i], K)) {
      return {};
    }
    N += w.size(0);
  }
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias && (bias->dim() != 1 || bias->size(0) != N || bias->scalar_type() != x.scalar_type())) return {};
  // As linear_q4_cpu / linear_q8_0_cpu: fp32 rows in (float_rows.h), x quantised to Q8 blocks with
  // block sums (the Q8_0 kernels read only q and d), the fp32 results rounded once into x's dtype.
  thread_local std::vector<float> xbuf, bbuf;
  at::Tensor xkeep, bkeep;
  const float* xf = cpu::float_rows(x, xbuf, xkeep, true);
  const float* b = has_bias ? cpu::float_rows(*bias, bbuf, bkeep, true) : nullptr;
  thread_local QuantRows xq;
  xq.quantize(xf, M, K);
  cpu::FloatOut out(M, N, x.options(), true);
  std::vector<Job> jobs;
  int64_t row = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& w = parts[i].w;
    jobs.push_back({formats[i], w.data_ptr<uint8_t>(), w.size(1), w.size(0), b != nullptr ? b + row : nullptr,
                    xq.view(M, K), out.data() + row, N, 0});
    row += w.size(0);
  }
  const int64_t total = quant_jobs::lay_out(jobs);
  const int nt = std::max(1, std::min<int>(cpu::team_size(), static_cast<int>((total + 63) / 64)));
  // (On a decode step's crew, crew.h, the crew runs the shares: no region of its own.)
  cpu::team_region(nt, [&](int t, int n) { quant_jobs::run_share(jobs, total, t, n, isa); });
  return out.finish();
}

}  // namespace layer_parts

}  // namespace pagewire
