// pagewire::moe_route: a mixture-of-experts router's choice for CPU logits of any row count in one
// op -- cpu::route_rows (moe_route.cpp), the arithmetic pagewire::moe_decode routes its decode rows
// with, exposed for prefill and the steps moe_decode does not take, where route() would otherwise
// run about six torch ops per layer (server/models/moe_router.py, whose contract this keeps: ids
// int64 [T, k] and weights float32 [T, k], largest first; topk_softmax rounds its weights to the
// logits' dtype). The logits are widened to fp32 first, as moe_decode does. Rows are independent,
// so a large step splits them over OpenMP threads in fixed chunks: a row's result never depends on
// T or the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>

#include <algorithm>
#include <string>

#include "moe_route.h"

namespace pagewire {

namespace {
// Rows per OpenMP chunk, and the fewest rows worth a parallel region (a row costs about E exps and
// a partial sort: a few hundred ns for E = 64..256, so small steps stay on the calling thread).
constexpr int64_t kChunk = 16;
constexpr int64_t kParallelRows = 64;
}  // namespace

void check_route_args(const std::string& router, int64_t E, int64_t top_k,
                      const c10::optional<at::Tensor>& selection_bias, int64_t n_group, int64_t topk_group,
                      double routed_scaling) {
  TORCH_CHECK(router == "softmax_topk" || router == "topk_softmax" || router == "sigmoid_topk",
              "moe_route: router must be 'softmax_topk', 'topk_softmax' or 'sigmoid_topk', got '", router, "'");
  TORCH_CHECK(E >= 1, "moe_route: logits must have at least one expert column, got ", E);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_route: top_k must be in [1, ", E, "], got ", top_k);
  const bool has_sel = selection_bias.has_value() && selection_bias->defined();
  TORCH_CHECK(!has_sel || (selection_bias->device().is_cpu() && selection_bias->dim() == 1 &&
                           selection_bias->size(0) == E && c10::isFloatingType(selection_bias->scalar_type())),
              "moe_route: selection_bias must be a CPU float [E] = [", E, "] tensor, got ",
              has_sel ? selection_bias->sizes() : at::IntArrayRef{});
  TORCH_CHECK(router != "topk_softmax" || (!has_sel && n_group == 1 && routed_scaling == 1.0),
              "moe_route: router 'topk_softmax' takes no selection_bias, groups or scaling");
  TORCH_CHECK(n_group >= 1 && topk_group >= 1 && topk_group <= n_group && E % n_group == 0 &&
                  (n_group == 1 || (E / n_group >= 2 && topk_group * (E / n_group) >= top_k)),
              "moe_route: n_group ", n_group, " / topk_group ", topk_group, " do not fit ", E, " experts and top_k ",
              top_k);
}

std::tuple<at::Tensor, at::Tensor> moe_route_cpu(const at::Tensor& logits, c10::string_view router_view, int64_t top_k,
                                                 bool norm_topk_prob, const c10::optional<at::Tensor>& selection_bias,
                                                 int64_t n_group, int64_t topk_group, double routed_scaling) {
  const std::string router(router_view);
  const auto dt = logits.scalar_type();
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 &&
                  (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf),
              "moe_route: logits must be a CPU float32, bfloat16 or float16 [T, E] tensor, got ", dt, " ",
              logits.sizes(), " on ", logits.device());
  const int64_t T = logits.size(0), E = logits.size(1);
  check_route_args(router, E, top_k, selection_bias, n_group, topk_group, routed_scaling);  // router first
  const bool has_sel = selection_bias.has_value() && selection_bias->defined();

  at::Tensor ids = at::empty({T, top_k}, logits.options().dtype(at::kLong));
  at::Tensor wts = at::empty({T, top_k}, logits.options().dtype(at::kFloat));
  if (T == 0) return {ids, wts};
  const at::Tensor lf = logits.to(at::kFloat).contiguous();
  const at::Tensor sel = has_sel ? selection_bias->to(at::kFloat).contiguous() : at::Tensor();
  cpu::RouteSpec spec;
  spec.router = router;
  spec.k = top_k;
  spec.renorm = norm_topk_prob;
  spec.selection_bias = has_sel ? sel.data_ptr<float>() : nullptr;
  spec.n_group = n_group;
  spec.topk_group = topk_group;
  spec.scaling = static_cast<float>(routed_scaling);
  const float* l = lf.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  float* w = wts.data_ptr<float>();
  if (T < kParallelRows) {
    cpu::route_rows(l, T, E, dt, spec, id, w);
  } else {
    const int64_t chunks = (T + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t t0 = c * kChunk, n = std::min(kChunk, T - t0);
      cpu::route_rows(l + t0 * E, n, E, dt, spec, id + t0 * top_k, w + t0 * top_k);
    }
  }
  return {ids, wts};
}

}  // namespace pagewire
