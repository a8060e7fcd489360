// The MoE router's choice for a step's rows from their logits (cpu/moe_route.cpp): what
// server.models.moe_router.route computes with torch ops, for pagewire::moe_decode.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace pagewire {
namespace cpu {

struct RouteSpec {
  std::string router;  // "softmax_topk", "topk_softmax" or "sigmoid_topk"
  int64_t k = 1;
  bool renorm = false;
  const float* selection_bias = nullptr;  // [E] fp32, added to the scores to choose only
  int64_t n_group = 1, topk_group = 1;    // group-limited choice (groups scored by their two best)
  float scaling = 1.f;                    // routed_scaling_factor, multiplies the chosen weights
};

// logits fp32 [T, E] (row-major; `dtype` is the type they were computed in: topk_softmax rounds
// its weights to it) -> ids [T, k] and weights [T, k], largest choice first.
void route_rows(const float* logits, int64_t T, int64_t E, c10::ScalarType dtype, const RouteSpec& spec,
                int64_t* ids, float* wts);

}  // namespace cpu

// The checks pagewire::moe_route makes of its arguments for E experts (errors name them): the
// router's name, top_k, the selection bias, the groups and the scaling.
void check_route_args(const std::string& router, int64_t E, int64_t top_k,
                      const c10::optional<at::Tensor>& selection_bias, int64_t n_group, int64_t topk_group,
                      double routed_scaling);

// pagewire::moe_route (cpu/moe_route_op.cpp): the arguments checked (errors name them), the logits
// widened to fp32, then route_rows -> (ids int64 [T, k], weights float32 [T, k]). pagewire::moe_decode
// routes its rows through it too.
std::tuple<at::Tensor, at::Tensor> moe_route_cpu(const at::Tensor& logits, c10::string_view router, int64_t top_k,
                                                 bool norm_topk_prob, const c10::optional<at::Tensor>& selection_bias,
                                                 int64_t n_group, int64_t topk_group, double routed_scaling);

}  // namespace pagewire
