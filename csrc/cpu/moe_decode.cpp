// moe_decode: a mixture-of-experts layer's whole MLP for a decode step (at most 16 tokens) in one
// call -- the router, the chosen experts and the shared expert -- so a sparse layer costs one op
// dispatch instead of the router's torch ops and one kernel call per expert matrix.
//
//   1. Router: logits = x @ router^T (+ bias) by the path Python's ops.linear takes (its kind is
//      passed in, as for decode_layer), then moe_route_cpu (cpu/moe_route_op.cpp, cpu::route_rows
//      per row; the op prefill routes with too): softmax or sigmoid scores in fp32, top-k (chosen
//      with the selection bias, within the best expert groups), optional renormalisation and
//      scaling (Qwen-MoE, Mixtral, OLMoE, dots.llm1), or top-k of the logits and a softmax over
//      those k rounded to x's dtype (gpt-oss, "topk_softmax") -- moe_router.route's arithmetic.
//   2. Experts, when they and the CPU allow it (quantised blocks on AVX2 or better, and not
//      gpt-oss's bf16 roundings): one OpenMP region for the whole layer. x is quantised to Q8
//      blocks once; every chosen expert's gate_up rows (and the shared expert's) are laid end to
//      end and split evenly across the threads, so at batch 1 both cores stream different experts
//      (or different rows of one) instead of every kernel call forking over a 0.3 MB matrix. After
//      a barrier each (token, expert) row's activation (SiLU(gate) * up, or the clamped SwiGLU) is
//      computed in fp32 and quantised for down; the down rows are split the same way; a last pass sums each
//      token's k results (slot order, fp32) plus the shared expert (times its sigmoid gate when it
//      has one), and
//      rounds once to x's dtype. The matrices go through the existing per-format kernels
//      (linear_q8_0_*, linear_q4_*, their x8 forms), each handed a slice of rows: the kernels'
//      own OpenMP loops, nested inside this region, run on the calling thread (team_for opens
//      no nested region). The rows, results and per-expert job lists live in per-thread buffers
//      kept across calls (Scratch), so a layer allocates only its output tensor here.
//   3. Otherwise (float experts, the portable ISA, gpt-oss in bf16/fp16): the router's choice goes
//      to moe_experts_cpu, and the shared expert runs as SparseMoE.forward's ops.
// A row's result depends on its own experts and row only (the kernels' per-row arithmetic does not
// depend on M or on which rows a thread was handed), so batch-invariant mode holds.
//
// The job runner (quant_jobs.h) also serves layer_parts::linear_parts_region (cpu/linear_parts.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../ops.h"
#include "cpu_features.h"
#include "crew.h"
#include "dispatch_mode.h"
#include "float_rows.h"
#include "fused_kernel.h"  // silu_and_mul_f32_*
#include "maybe_parallel.h"  // row_scratch
#include "quant4_kernel.h"
#include "quant_jobs.h"
#include "quant_kernel.h"
#include "moe_route.h"  // moe_route_cpu, this op's router

namespace pagewire {
namespace {

using quant_jobs::Format;
using quant_jobs::Job;
using quant_jobs::QuantRows;
using quant_jobs::lay_out;
using quant_jobs::parse_format;
using quant_jobs::row_bytes_for;
using quant_jobs::run_share;

float to_float(const at::Tensor& t, int64_t i) {  // element i of a 1-D/flat float tensor, as fp32
  switch (t.scalar_type()) {
    case at::kFloat: return t.data_ptr<float>()[i];
    case at::kBFloat16: return static_cast<float>(t.data_ptr<c10::BFloat16>()[i]);
    case at::kHalf: return static_cast<float>(t.data_ptr<c10::Half>()[i]);
    default: TORCH_CHECK(false, "moe_decode: unsupported dtype ", t.scalar_type());
  }
  return 0.f;
}

// fp32 copies of the rows `experts` of a bias [E, n] (any float dtype), one after another, into out.
void bias_rows(const at::Tensor& bias, const std::vector<int64_t>& experts, int64_t n, std::vector<float>& out) {
  out.resize(experts.size() * n);
  for (size_t u = 0; u < experts.size(); ++u) {
    const at::Tensor b = bias[experts[u]].to(at::kFloat).contiguous();
    std::memcpy(out.data() + u * n, b.data_ptr<float>(), n * sizeof(float));
  }
}

// One call's working memory, kept per calling thread (moe_decode_cpu's `sc`).
struct Scratch {
  // The (token * k + slot) pairs grouped by expert: used experts in expert order, arena rows
  // [start[u], start[u + 1]) for used expert u, each arena row's pair (rows) and each pair's
  // arena row (row_of).
  std::vector<int64_t> used, start, rows, row_of, count;
  QuantRows xe, ae, sa;                 // arena rows of x and of the activations; the shared expert's
  std::vector<float> h, y, sh, sy, o;   // gate_up and down results (arena, then shared), the sum
  std::vector<float> gub, db, sg;       // biases of the used experts, the shared gate per token
  std::vector<float> lbuf, sbuf, wts;   // the router's logits and selection bias in fp32, the weights
  std::vector<int64_t> ids;             // the router's choice [T, k]
  std::vector<Job> up_jobs, down_jobs;

  // A counting sort of the P pairs' experts id[0..P) over E experts: stable (token order within
  // an expert), experts ascending.
  void group(const int64_t* id, int64_t P, int64_t E) {
    count.assign(E + 1, 0);
    for (int64_t p = 0; p < P; ++p) ++count[id[p] + 1];
    used.clear();
    start.clear();
    for (int64_t e = 0; e < E; ++e) {
      if (count[e + 1] > 0) {
        used.push_back(e);
        start.push_back(count[e]);
      }
      count[e + 1] += count[e];  // count[e]: expert e's first arena row
    }
    start.push_back(P);
    rows.resize(P);
    row_of.resize(P);
    for (int64_t p = 0; p < P; ++p) {
      const int64_t r = count[id[p]]++;
      rows[r] = p;
      row_of[p] = r;
    }
  }
};

}  // namespace

at::Tensor moe_decode_cpu(const at::Tensor& x, const at::Tensor& router_weight, c10::string_view router_kind,
                          const c10::optional<at::Tensor>& router_bias, c10::string_view router_view, int64_t top_k,
                          bool norm_topk_prob, const at::Tensor& gate_up, c10::string_view gate_up_kind_view,
                          const at::Tensor& down, c10::string_view down_kind_view,
                          const c10::optional<at::Tensor>& gate_up_bias, const c10::optional<at::Tensor>& down_bias,
                          c10::string_view activation_view, double alpha, double limit,
                          const c10::optional<at::Tensor>& shared_gate_up, c10::string_view shared_gate_up_kind,
                          const c10::optional<at::Tensor>& shared_down, c10::string_view shared_down_kind,
                          const c10::optional<at::Tensor>& shared_gate, c10::string_view shared_gate_kind,
                          const c10::optional<at::Tensor>& selection_bias, int64_t n_group, int64_t topk_group,
                          double routed_scaling) {
  const std::string router(router_view), gu_kind(gate_up_kind_view), dn_kind(down_kind_view);
  const std::string activation(activation_view);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "moe_decode: x must be a CPU [T, H] tensor, got ", x.sizes());
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(T <= kQ8KernelMaxRows, "moe_decode takes at most ", kQ8KernelMaxRows, " tokens, got ", T);
  TORCH_CHECK(activation == "silu" || activation == "swiglu_oai",
              "moe_decode: activation must be 'silu' or 'swiglu_oai', got '", activation, "'");
  TORCH_CHECK(router_weight.dim() == 2 && router_weight.size(1) == H, "moe_decode: router_weight must be [E, ", H,
              "], got ", router_weight.sizes());
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == router_weight.size(0) &&
                  down.size(0) == gate_up.size(0) && down.size(1) == H,
              "moe_decode: gate_up [E, 2I, ...] and down [E, H, ...] must match the router's E = ",
              router_weight.size(0), ", got ", gate_up.sizes(), " and ", down.sizes());
  const int64_t E = gate_up.size(0), I2 = gate_up.size(1), I = I2 / 2;
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_decode: top_k must be in [1, ", E, "], got ", top_k);
  const bool has_shared = shared_gate_up.has_value() && shared_gate_up->defined();
  const bool has_gate = shared_gate.has_value() && shared_gate->defined();
  TORCH_CHECK(has_shared == (shared_down.has_value() && shared_down->defined()) && (has_shared || !has_gate),
              "moe_decode: shared_gate_up and shared_down come together, and shared_gate only with them");

  // 1. The router.
  // A float32 router (DeepSeek-V3 style) in a bf16/fp16 model takes the rows cast up, as route() does.
  const at::Tensor logits = run_linear_kind(
      router_weight.scalar_type() == x.scalar_type() ? x : x.to(router_weight.scalar_type()), router_weight,
      router_bias, std::string(router_kind));
  // The router's arguments checked as pagewire::moe_route checks them (cpu/moe_route_op.cpp).
  check_route_args(router, E, top_k, selection_bias, n_group, topk_group, routed_scaling);
  at::Tensor sgate;  // the shared expert's gate logit [T, 1] in x's dtype, as Python's linear gives it
  if (has_gate) sgate = run_linear_kind(x, *shared_gate, c10::nullopt, std::string(shared_gate_kind));

  Format gf, df, sgf, sdf;
  const cpu::Isa isa = cpu::active_isa();
  const bool hf_order = activation == "swiglu_oai" && x.scalar_type() != at::kFloat;
  const bool fast = isa != cpu::Isa::kPortable && !hf_order && parse_format(gu_kind, &gf) &&
                    parse_format(dn_kind, &df) && H % 32 == 0 && I % 32 == 0 && gate_up.scalar_type() == at::kByte &&
                    down.scalar_type() == at::kByte && gate_up.size(2) == row_bytes_for(gf, H) &&
                    down.size(2) == row_bytes_for(df, I) && gate_up.is_contiguous() && down.is_contiguous();
  const bool shared_fast = fast && has_shared && parse_format(std::string(shared_gate_up_kind), &sgf) &&
                           parse_format(std::string(shared_down_kind), &sdf) && shared_gate_up->dim() == 2 &&
                           shared_down->dim() == 2 && shared_down->size(0) == H && shared_down->size(1) % 32 == 0 &&
                           shared_gate_up->size(1) == row_bytes_for(sgf, H) &&
                           shared_down->size(1) == row_bytes_for(sdf, shared_gate_up->size(0) / 2) &&
                           shared_gate_up->is_contiguous() && shared_down->is_contiguous();
  // The shared expert by SparseMoE.forward's ops: out + (sigmoid(gate) *) down(silu(gate_up(x))).
  const auto add_shared_ops = [&](const at::Tensor& out) {
    const at::Tensor h = run_linear_kind(x, *shared_gate_up, c10::nullopt, std::string(shared_gate_up_kind));
    const at::Tensor s = run_linear_kind(silu_and_mul_cpu(h), *shared_down, c10::nullopt, std::string(shared_down_kind));
    return at::add(out, has_gate ? at::mul(at::sigmoid(sgate), s) : s);
  };
  if (!fast) {
    // The router's choice by pagewire::moe_route: the arithmetic prefill steps route with.
    const auto [ids, wts] =
        moe_route_cpu(logits, router, top_k, norm_topk_prob, selection_bias, n_group, topk_group, routed_scaling);
    const at::Tensor out = moe_experts_cpu(x, ids, wts, gate_up, gu_kind, down, dn_kind, gate_up_bias, down_bias,
                                           activation, alpha, limit);
    return has_shared ? add_shared_ops(out) : out;
  }

  // 2. Group the (token, slot) pairs by expert, in expert order (token order within one): arena
  // row r of `rows` belongs to used expert u for r in [start[u], start[u + 1]). Every buffer below
  // is this thread's and kept across calls: a decode step runs one call per sparse layer, and
  // heap churn here (a dozen vectors per expert) had been a tenth of the layer's serial time.
  thread_local Scratch sc;
  const int64_t P = T * top_k;
  {
    // moe_route's arithmetic (cpu::route_rows on the logits widened to fp32) into this thread's
    // buffers: without its ATen conversion and two output tensors, a third of a layer's routing time.
    at::Tensor lkeep, skeep;
    const float* lf = cpu::float_rows(logits, sc.lbuf, lkeep, true);
    cpu::RouteSpec spec;
    spec.router = router;
    spec.k = top_k;
    spec.renorm = norm_topk_prob;
    spec.selection_bias = selection_bias.has_value() && selection_bias->defined()
                              ? cpu::float_rows(*selection_bias, sc.sbuf, skeep, true)
                              : nullptr;
    spec.n_group = n_group;
    spec.topk_group = topk_group;
    spec.scaling = static_cast<float>(routed_scaling);
    sc.ids.resize(P);
    sc.wts.resize(P);
    cpu::route_rows(lf, T, E, logits.scalar_type(), spec, sc.ids.data(), sc.wts.data());
  }
  const int64_t* id = sc.ids.data();
  sc.group(id, P, E);
  const int64_t U = static_cast<int64_t>(sc.used.size());

  // x quantised once (widened without an ATen conversion, float_rows.h); each arena row copies
  // its token's row of it.
  thread_local std::vector<float> xbuf;
  at::Tensor xkeep;
  const float* xf = cpu::float_rows(x, xbuf, xkeep, cpu::active_isa() != cpu::Isa::kPortable);
  thread_local QuantRows xq;
  xq.quantize(xf, T, H);
  const int64_t nbH = H / 32, nbI = I / 32;
  sc.xe.resize(P, H);
  sc.ae.resize(P, I);
  if (static_cast<int64_t>(sc.h.size()) < P * I2) sc.h.resize(P * I2);
  if (static_cast<int64_t>(sc.y.size()) < P * H) sc.y.resize(P * H);
  for (int64_t r = 0; r < P; ++r) {
    const int64_t t = sc.rows[r] / top_k;
    std::memcpy(sc.xe.q.data() + r * H, xq.q.data() + t * H, H);
    std::memcpy(sc.xe.d.data() + r * nbH, xq.d.data() + t * nbH, nbH * sizeof(float));
    std::memcpy(sc.xe.s.data() + r * nbH, xq.s.data() + t * nbH, nbH * sizeof(float));
  }
  // Biases (gpt-oss), per used expert in fp32.
  const bool has_gub = gate_up_bias.has_value() && gate_up_bias->defined();
  const bool has_db = down_bias.has_value() && down_bias->defined();
  if (has_gub) bias_rows(*gate_up_bias, sc.used, I2, sc.gub);
  if (has_db) bias_rows(*down_bias, sc.used, H, sc.db);
  const int64_t S = shared_fast ? shared_gate_up->size(0) / 2 : 0;
  if (static_cast<int64_t>(sc.sh.size()) < T * 2 * S) sc.sh.resize(T * 2 * S);
  if (static_cast<int64_t>(sc.sy.size()) < T * H) sc.sy.resize(T * H);
  sc.sa.resize(T, S);

  const uint8_t* gw = gate_up.data_ptr<uint8_t>();
  const uint8_t* dw = down.data_ptr<uint8_t>();
  const int64_t gstride = gate_up.size(1) * gate_up.size(2), dstride = down.size(1) * down.size(2);
  std::vector<Job>& up_jobs = sc.up_jobs;
  std::vector<Job>& down_jobs = sc.down_jobs;
  up_jobs.clear();
  down_jobs.clear();
  for (int64_t u = 0; u < U; ++u) {  // expert order: a thread's rows are neighbouring experts
    const int64_t r0 = sc.start[u], n = sc.start[u + 1] - r0;
    const cpu::Q8SumActivations xa{sc.xe.q.data() + r0 * H, sc.xe.d.data() + r0 * nbH, sc.xe.s.data() + r0 * nbH, n, H};
    const cpu::Q8SumActivations aa{sc.ae.q.data() + r0 * I, sc.ae.d.data() + r0 * nbI, sc.ae.s.data() + r0 * nbI, n, I};
    up_jobs.push_back({gf, gw + sc.used[u] * gstride, gate_up.size(2), I2, has_gub ? sc.gub.data() + u * I2 : nullptr,
                       xa, sc.h.data() + r0 * I2, I2, 0});
    down_jobs.push_back({df, dw + sc.used[u] * dstride, down.size(2), H, has_db ? sc.db.data() + u * H : nullptr, aa,
                         sc.y.data() + r0 * H, H, 0});
  }
  if (shared_fast) {
    up_jobs.push_back({sgf, shared_gate_up->data_ptr<uint8_t>(), shared_gate_up->size(1), 2 * S, nullptr,
                       xq.view(T, H), sc.sh.data(), 2 * S, 0});
    down_jobs.push_back({sdf, shared_down->data_ptr<uint8_t>(), shared_down->size(1), H, nullptr, sc.sa.view(T, S),
                         sc.sy.data(), H, 0});
  }
  const int64_t up_total = lay_out(up_jobs), down_total = lay_out(down_jobs);
  const float fa = static_cast<float>(alpha), fl = static_cast<float>(limit);
  const bool silu = activation == "silu";
  if (static_cast<int64_t>(sc.o.size()) < T * H) sc.o.resize(T * H);
  float* o = sc.o.data();
  const float* w = sc.wts.data();
  if (static_cast<int64_t>(sc.sg.size()) < T) sc.sg.resize(T);
  std::fill(sc.sg.begin(), sc.sg.begin() + T, 1.f);  // sigmoid(gate) in x's dtype, as torch.sigmoid gives it (1: none)
  if (shared_fast && has_gate) {
    const at::Tensor s = at::sigmoid(sgate).contiguous();
    for (int64_t t = 0; t < T; ++t) sc.sg[t] = to_float(s, t);
  }
  // Read through these inside the region: `sc` named there is each thread's own (thread_local).
  const int64_t* row_of = sc.row_of.data();
  const int64_t* start = sc.start.data();
  const float* sg = sc.sg.data();
  const float* h = sc.h.data();
  const float* y = sc.y.data();
  const float* sh = sc.sh.data();
  const float* sy = sc.sy.data();
  QuantRows& ae = sc.ae;
  QuantRows& sa = sc.sa;

  // The activation of arena rows [r0, r1) (rows from P on: the tokens' shared-expert rows) in fp32,
  // quantised for down: SiLU(gate) * up by the fused-op bodies (the same bits on AVX2 and
  // AVX-512), or gpt-oss's clamped SwiGLU.
  const auto activate = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const bool shared = r >= P;
      const int64_t width = shared ? S : I;
      const float* hp = shared ? sh + (r - P) * 2 * S : h + r * I2;
      float* act = cpu::row_scratch(width);
      if (silu || shared) {
        (isa >= cpu::Isa::kAvx512 ? cpu::silu_and_mul_f32_avx512 : cpu::silu_and_mul_f32_avx2)(hp, 2 * width, act, 1,
                                                                                                width);
      } else {  // gpt-oss: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
        for (int64_t c = 0; c < width; ++c) {
          const float gc = std::min(hp[c], fl), vc = std::min(std::max(hp[width + c], -fl), fl);
          act[c] = (vc + 1.f) * (gc / (1.f + std::exp(-fa * gc)));
        }
      }
      const int64_t row = shared ? r - P : r, nb = width / 32;
      QuantRows& dst = shared ? sa : ae;
      cpu::quantize_rows_q8_avx2(act, width, 1, width, dst.q.data() + row * width, dst.d.data() + row * nb,
                                 dst.s.data() + row * nb);
    }
  };
  const int64_t act_rows = P + (shared_fast ? T : 0);

  const int nt = std::max(1, std::min<int>(cpu::team_size(), static_cast<int>((up_total + 63) / 64)));
  // Whole experts per thread (gate_up, activation and down of one expert, then the next) where the
  // used experts split evenly over the team, or are many: no barrier between the two phases, where
  // a thread that drew the slower memory made the other wait twice. Otherwise (a shared expert, or
  // a few experts that do not divide) both phases are split by rows across the threads, as above.
  // Every row goes through the same kernels either way, so the floats do not depend on the choice.
  const bool by_expert = !shared_fast && nt > 1 && (U % nt == 0 || U >= 8 * nt);
  const auto body = [&] {
    const int t = omp_get_thread_num(), n_threads = omp_get_num_threads();
    if (by_expert) {
      for (int64_t u = U * t / n_threads; u < U * (t + 1) / n_threads; ++u) {
        run_rows(up_jobs[u], 0, I2, isa);
        activate(start[u], start[u + 1]);
        run_rows(down_jobs[u], 0, H, isa);
      }
    } else {
      run_share(up_jobs, up_total, t, n_threads, isa);
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t r = 0; r < act_rows; ++r) activate(r, r + 1);
      run_share(down_jobs, down_total, t, n_threads, isa);
    }
#pragma omp barrier
    // Each token's k results in slot order, the shared expert's after, then one rounding.
#pragma omp for schedule(static)
    for (int64_t tc = 0; tc < T * (H / 32); ++tc) {
      const int64_t tok = tc / (H / 32), c0 = tc % (H / 32) * 32;
      float acc[32] = {};
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t p = tok * top_k + j;
        const float wj = w[p], *yr = y + row_of[p] * H + c0;
        for (int c = 0; c < 32; ++c) acc[c] += wj * yr[c];
      }
      if (shared_fast) {
        for (int c = 0; c < 32; ++c) acc[c] += sg[tok] * sy[tok * H + c0 + c];
      }
      std::memcpy(o + tok * H + c0, acc, sizeof(acc));
    }
  };
  if (cpu::Crew* crew = cpu::t_crew; crew != nullptr && nt == crew->size()) {
    // A decode step's crew (crew.h): one job that every thread of the crew's region runs, so the
    // orphaned barriers and `omp for` loops above bind to that region's team, as they bind to this
    // function's own region otherwise. (Not team_region: body reads the region's thread numbers,
    // and with one thread team_region would run it on the leader inside the crew's region.)
    crew->run([&](int, int) { body(); });
  } else {
#pragma omp parallel num_threads(nt)
    body();
  }
  at::Tensor out = at::empty({T, H}, x.options());
  if (x.scalar_type() == at::kFloat) {
    std::memcpy(out.data_ptr<float>(), o, T * H * sizeof(float));
  } else if (x.scalar_type() == at::kBFloat16) {
    // Round to nearest even, as at::Tensor::copy_ (the scalar and AVX2 forms agree bit for bit).
    (isa != cpu::Isa::kPortable ? cpu::f32_to_bf16_avx2 : cpu::f32_to_bf16)(
        o, reinterpret_cast<uint16_t*>(out.data_ptr()), T * H);
  } else {
    out.copy_(at::from_blob(o, {T, H}, x.options().dtype(at::kFloat)));
  }
  return has_shared && !shared_fast ? add_shared_ops(out) : out;
}

}  // namespace pagewire
