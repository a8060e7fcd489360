// moe_experts: the routed experts of a mixture-of-experts layer for one step's tokens, in one call.
//
// The router (softmax, top-k, renormalisation) runs in Python as per-row torch ops; this op takes
// its choice -- topk_ids / topk_weights [T, k] -- with the hidden rows [T, H] and the layer's
// stacked expert weights (gate_up [E, 2I, H], down [E, H, I], float or kept in GGUF blocks), and:
//   1. groups the (token, slot) pairs by expert with a counting sort (stable: token order within
//      an expert);
//   2. for each expert that has rows, in expert order, gathers its rows and runs gate_up (+ its
//      bias) -> the activation -> down (+ its bias) on the existing small-M kernels (linear_cpu,
//      linear_q8_0_cpu, linear_q4_cpu -- MXFP4 experts included, computed from their blocks by
//      the 4-bit integer kernels), so only the experts used are read. The activation is
//      SiLU(gate) * up, or gpt-oss's clamped SwiGLU ("swiglu_oai"): g = min(gate, limit),
//      u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g), as torch ops in x's dtype in
//      transformers' order (so bf16 rounds as the reference does);
//   3. sums each token's k results in slot order (fp32, w[t, 0] * y0 + w[t, 1] * y1 + ...), then
//      rounds once to x's dtype.
// gpt-oss ("swiglu_oai") in bf16/fp16 takes transformers' GptOssExperts roundings instead: each
// bias added after its product is rounded, each expert's output times its weight rounded, and the
// products added into the token's row in expert order, rounding at every add (index_add_). Still a
// function of the token's own experts alone (its k ids fix the order).
// A row's result is a function of that row alone whenever the kernels' are: in batch-invariant
// mode (dispatch_mode.h) the float experts take pagewire::linear at every M and the quantised ones
// their integer kernel in blocks of at most kQ8KernelMaxRows rows, and the fixed summation order in
// step 3 does not depend on which other tokens chose the same expert.
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../ops.h"
#include "cpu_features.h"
#include "dispatch_mode.h"
#include "quant4_kernel.h"

namespace pagewire {
namespace {

// x [M, K] @ w^T (one expert's matrix, [N, K] float or [N, row bytes] blocks) by `kind`: "float",
// "q8_0", "q8_0x8", or a linear_q4 qtype.
at::Tensor quant_rows(const at::Tensor& x, const at::Tensor& w, const std::string& kind,
                      const c10::optional<at::Tensor>& bias) {
  if (kind == "q8_0" || kind == "q8_0x8") return linear_q8_0_cpu(x, w, bias, kind == "q8_0x8");
  return linear_q4_cpu(x, w, kind, bias);
}

// gpt-oss's clamped SwiGLU of h [M, 2I] = cat(gate, up) (the checkpoint's interleaved columns are
// split into gate rows then up rows at load), as transformers' GptOssExperts._apply_gate.
at::Tensor swiglu_oai(const at::Tensor& h, double alpha, double limit) {
  const int64_t I = h.size(1) / 2;
  const at::Tensor gate = at::clamp(h.narrow(1, 0, I), c10::nullopt, limit);
  const at::Tensor up = at::clamp(h.narrow(1, I, I), -limit, limit);
  const at::Tensor glu = at::mul(gate, at::sigmoid(at::mul(gate, alpha)));
  return at::mul(at::add(up, 1), glu);
}

at::Tensor expert_linear(const at::Tensor& x, const at::Tensor& w, const std::string& kind,
                         const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0);
  const bool invariant = cpu::batch_invariant_mode;
  if (kind == "float") {
    // ops.linear's rules: pagewire::linear in batch-invariant mode and for bf16 (every M on AVX2,
    // up to 16 rows elsewhere); ATen's GEMM otherwise.
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    if (invariant || (bf16 && (M <= 16 || cpu::active_isa() == cpu::Isa::kAvx2))) {
      return linear_cpu(x, w, bias);
    }
    return at::linear(x, w, bias);
  }
  cpu::Q4Type q4_type;
  bool q4_x8 = false;
  TORCH_CHECK(kind == "q8_0" || kind == "q8_0x8" || cpu::parse_q4_name(kind, &q4_type, &q4_x8),
              "moe_experts: kind must be 'float', 'q8_0', 'q8_0x8', 'mxfp4' or a linear_q4 qtype, got '", kind, "'");
  if (M <= kQ8KernelMaxRows || !invariant) return quant_rows(x, w, kind, bias);
  // Batch-invariant: the integer kernel for every row (in blocks of kQ8KernelMaxRows rows, each
  // block's floats those of a call with it alone), never the dequantise-and-GEMM path.
  if (kind == "q8_0" || kind == "q8_0x8") return linear_q8_0_rows_cpu(x, w, bias, kind == "q8_0x8");
  return linear_q4_rows_cpu(x, w, kind, bias);
}

}  // namespace

at::Tensor moe_experts_cpu(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                           const at::Tensor& gate_up, c10::string_view gate_up_kind_view, const at::Tensor& down,
                           c10::string_view down_kind_view, const c10::optional<at::Tensor>& gate_up_bias,
                           const c10::optional<at::Tensor>& down_bias, c10::string_view activation_view,
                           double alpha, double limit) {
  const std::string gate_up_kind(gate_up_kind_view), down_kind(down_kind_view), activation(activation_view);
  TORCH_CHECK(activation == "silu" || activation == "swiglu_oai",
              "moe_experts: activation must be 'silu' or 'swiglu_oai', got '", activation, "'");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "moe_experts: x must be a CPU [T, H] tensor, got ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "moe_experts: x must be floating point, got ", x.scalar_type());
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_ids.scalar_type() == at::kLong,
              "moe_experts: topk_ids must be int64 [T, k] with T = ", T, ", got ", topk_ids.scalar_type(), " ",
              topk_ids.sizes());
  const int64_t k = topk_ids.size(1);
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat,
              "moe_experts: topk_weights must be float32 ", topk_ids.sizes(), ", got ", topk_weights.scalar_type(), " ",
              topk_weights.sizes());
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == down.size(0),
              "moe_experts: gate_up and down must be stacked per expert, [E, 2I, ...] and [E, H, ...], got ",
              gate_up.sizes(), " and ", down.sizes());
  const int64_t E = gate_up.size(0);
  TORCH_CHECK(down.size(1) == H, "moe_experts: down must have H = ", H, " rows per expert, got ", down.sizes());
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "moe_experts: gate_up must have 2I rows per expert, got ", gate_up.sizes());
  if (gate_up_kind == "float") {
    TORCH_CHECK(gate_up.scalar_type() == x.scalar_type() && gate_up.size(2) == H,
                "moe_experts: float gate_up must be [E, 2I, H] of x's dtype, got ", gate_up.scalar_type(), " ",
                gate_up.sizes());
  }
  if (down_kind == "float") {
    TORCH_CHECK(down.scalar_type() == x.scalar_type() && down.size(2) == gate_up.size(1) / 2,
                "moe_experts: float down must be [E, H, I] of x's dtype, got ", down.scalar_type(), " ",
                down.sizes());
  }
  const bool has_gub = gate_up_bias.has_value() && gate_up_bias->defined();
  const bool has_db = down_bias.has_value() && down_bias->defined();
  TORCH_CHECK(!has_gub || (gate_up_bias->dim() == 2 && gate_up_bias->size(0) == E &&
                           gate_up_bias->size(1) == gate_up.size(1) && gate_up_bias->scalar_type() == x.scalar_type()),
              "moe_experts: gate_up_bias must be [E, 2I] = [", E, ", ", gate_up.size(1), "] of x's dtype");
  TORCH_CHECK(!has_db || (down_bias->dim() == 2 && down_bias->size(0) == E && down_bias->size(1) == H &&
                          down_bias->scalar_type() == x.scalar_type()),
              "moe_experts: down_bias must be [E, H] = [", E, ", ", H, "] of x's dtype");
  const at::Tensor ids = topk_ids.contiguous();
  const at::Tensor wts = topk_weights.contiguous();
  const at::Tensor xc = x.contiguous();
  const at::Tensor gu = gate_up.contiguous();
  const at::Tensor dn = down.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wt = wts.data_ptr<float>();
  const bool hf_order = activation == "swiglu_oai" && x.scalar_type() != at::kFloat;

  // 1. Counting sort of the T * k (token, slot) pairs by expert; a negative id is an empty slot.
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK(id[p] < E, "moe_experts: expert id ", id[p], " out of range for ", E, " experts");
    if (id[p] >= 0) ++start[id[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> order(start[E]);
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < T * k; ++p) {
      if (id[p] >= 0) order[next[id[p]]++] = p;
    }
  }

  // 2. Each expert with rows: gather, gate_up, the activation, down; results kept per (token, slot) in fp32.
  std::vector<float> ys(static_cast<size_t>(T * k) * H, 0.f);
  const size_t es = xc.element_size();
  const char* xb = static_cast<const char*>(xc.data_ptr());
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    at::Tensor xe = at::empty({n, H}, xc.options());
    char* xeb = static_cast<char*>(xe.data_ptr());
    for (int64_t r = 0; r < n; ++r) {
      const int64_t t = order[start[e] + r] / k;
      std::memcpy(xeb + r * H * es, xb + t * H * es, H * es);
    }
    const c10::optional<at::Tensor> gub = has_gub ? c10::optional<at::Tensor>((*gate_up_bias)[e]) : c10::nullopt;
    const c10::optional<at::Tensor> db = has_db ? c10::optional<at::Tensor>((*down_bias)[e]) : c10::nullopt;
    at::Tensor h, y;
    if (hf_order) {  // the product rounded, then the bias added in x's dtype (x @ W + b)
      h = expert_linear(xe, gu[e], gate_up_kind, c10::nullopt);
      if (gub.has_value()) h = at::add(h, *gub);
    } else {
      h = expert_linear(xe, gu[e], gate_up_kind, gub);
    }
    const at::Tensor act = activation == "silu" ? silu_and_mul_cpu(h) : swiglu_oai(h, alpha, limit);
    if (hf_order) {
      y = expert_linear(act, dn[e], down_kind, c10::nullopt);
      if (db.has_value()) y = at::add(y, *db);
    } else {
      y = expert_linear(act, dn[e], down_kind, db);
    }
    y = y.to(at::kFloat).contiguous();
    TORCH_CHECK(y.size(1) == H, "moe_experts: down gives ", y.size(1), " columns, expected H = ", H);
    const float* yp = y.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(ys.data() + order[start[e] + r] * H, yp + r * H, H * sizeof(float));
    }
  }

  // 3. out[t] = sum_j w[t, j] * y[t, j], slot by slot, then one rounding to x's dtype.
  at::Tensor out = at::empty({T, H}, xc.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  if (hf_order) {
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const auto to_dtype = [bf16](float v) {
      return bf16 ? static_cast<float>(c10::BFloat16(v)) : static_cast<float>(c10::Half(v));
    };
#pragma omp parallel for schedule(static) if (T * k * H >= (1 << 16))
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int64_t> slots;
      for (int64_t j = 0; j < k; ++j) {
        if (id[t * k + j] >= 0) slots.push_back(j);
      }
      std::stable_sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return id[t * k + a] < id[t * k + b]; });
      float* ot = o + t * H;
      for (int64_t c = 0; c < H; ++c) ot[c] = 0.f;
      for (const int64_t j : slots) {
        const float w = to_dtype(wt[t * k + j]);
        const float* yr = ys.data() + (t * k + j) * H;
        for (int64_t c = 0; c < H; ++c) ot[c] = to_dtype(ot[c] + to_dtype(yr[c] * w));
      }
    }
    return out.to(x.scalar_type());
  }
#pragma omp parallel for schedule(static) if (T * k * H >= (1 << 16))
  for (int64_t t = 0; t < T; ++t) {
    float* ot = o + t * H;
    for (int64_t c = 0; c < H; ++c) ot[c] = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      if (id[t * k + j] < 0) continue;
      const float w = wt[t * k + j];
      const float* yr = ys.data() + (t * k + j) * H;
      for (int64_t c = 0; c < H; ++c) ot[c] += w * yr[c];
    }
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace pagewire
