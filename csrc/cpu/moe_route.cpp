// route_rows: a mixture-of-experts router's top-k choice and weights per row, as
// server.models.moe_router.route computes them (transformers' routers):
//   softmax_topk: p = softmax(logits) in fp32;   sigmoid_topk: p = sigmoid(logit) per expert;
//     the k experts with the largest p + selection_bias (the bias only chooses), optionally only
//     among the topk_group groups (of n_group equal ones) whose two best biased scores sum
//     highest; weights p of those k, divided by their sum when renorm (+ 1e-20 for sigmoid, as
//     DeepseekV3TopkRouter), times scaling.
//   topk_softmax (gpt-oss): the k largest logits, softmaxed among themselves and rounded to the
//     logits' dtype.
// Each row is routed on its own, so a token's experts never depend on the other rows.
#include "moe_route.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace pagewire {
namespace cpu {
namespace {

float round_to(c10::ScalarType s, float v) {
  if (s == c10::ScalarType::BFloat16) return static_cast<float>(c10::BFloat16(v));
  if (s == c10::ScalarType::Half) return static_cast<float>(c10::Half(v));
  return v;
}

}  // namespace

void route_rows(const float* logits, int64_t T, int64_t E, c10::ScalarType dtype, const RouteSpec& spec,
                int64_t* ids, float* wts) {
  const int64_t k = spec.k;
  const bool topk_softmax = spec.router == "topk_softmax", sigmoid = spec.router == "sigmoid_topk";
  const int64_t G = spec.n_group > 1 ? spec.n_group : 1, per = E / G;
  std::vector<float> p(E), c(E), gs(G);
  std::vector<int64_t> order(E), gorder(G);
  // The k largest, largest first; equal values keep the lower index first.
  const auto by = [](const std::vector<float>& v) {
    return [&v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
  };
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * E;
    if (topk_softmax) {
      p.assign(l, l + E);
    } else if (sigmoid) {
      for (int64_t e = 0; e < E; ++e) p[e] = 1.f / (1.f + std::exp(-l[e]));
    } else {
      const float mx = *std::max_element(l, l + E);
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - mx));
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    }
    for (int64_t e = 0; e < E; ++e) c[e] = spec.selection_bias != nullptr ? p[e] + spec.selection_bias[e] : p[e];
    if (G > 1) {  // keep the topk_group groups with the largest sum of their two best choices
      for (int64_t g = 0; g < G; ++g) {
        float a = -std::numeric_limits<float>::infinity(), b = a;  // best, second best
        for (int64_t e = g * per; e < (g + 1) * per; ++e) {
          if (c[e] > a) {
            b = a;
            a = c[e];
          } else if (c[e] > b) {
            b = c[e];
          }
        }
        gs[g] = a + b;
        gorder[g] = g;
      }
      std::partial_sort(gorder.begin(), gorder.begin() + spec.topk_group, gorder.end(), by(gs));
      std::vector<char> keep(G, 0);
      for (int64_t j = 0; j < spec.topk_group; ++j) keep[gorder[j]] = 1;
      for (int64_t e = 0; e < E; ++e) {
        if (!keep[e / per]) c[e] = -std::numeric_limits<float>::infinity();
      }
    }
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + k, order.end(), by(c));
    float* w = wts + t * k;
    for (int64_t j = 0; j < k; ++j) {
      ids[t * k + j] = order[j];
      w[j] = p[order[j]];
    }
    if (topk_softmax) {  // softmax over the k logits, computed in fp32 and rounded to their dtype
      const float top = w[0];
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += (w[j] = std::exp(w[j] - top));
      for (int64_t j = 0; j < k; ++j) w[j] = round_to(dtype, w[j] / sum);
      continue;
    }
    if (spec.renorm) {
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += w[j];
      if (sigmoid) sum += 1e-20f;
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
    }
    if (spec.scaling != 1.f) {
      for (int64_t j = 0; j < k; ++j) w[j] *= spec.scaling;
    }
  }
}

}  // namespace cpu
}  // namespace pagewire
