// Gated DeltaNet ops (Qwen3-Next, Qwen3.5, Qwen3.5-MoE linear-attention layers), CPU: the causal
// conv1d with its per-sequence state, the gating (decay g and beta), the gated delta rule (chunked
// for prefill, the one-token recurrent form for decode, one call for a mixed batch), and the gated
// output RMSNorm. Every op works on a batch of sequences laid out as paged attention's are
// (query_start_loc), each sequence reading and updating its own state slot in place.
//
// Rounding follows transformers' torch implementation (modeling_qwen3_next.py): the conv and its
// SiLU round to the activation dtype, the delta rule runs in float32 on l2-normalised q and k and
// keeps its state in float32, the norm rounds where transformers materialises a bf16 tensor.
// The heavy loops are the ISA bodies of gdn_body.h (portable here, AVX2 and AVX-512 in their files).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_features.h"
#include "gdn_ops.h"

namespace pagewire::cpu {
namespace {

struct Portable {
  static float dot(const float* a, const float* b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  static void axpy(float a, const float* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
  }
  static void axpy2(float a, float b, const float* x, float* y, float* z, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      y[i] += a * x[i];
      z[i] += b * x[i];
    }
  }
  static void scale(float a, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] *= a;
  }
  static void axpby_acc(float a, float* y, float b, const float* x, float c, float* z, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      y[i] = a * y[i] + b * x[i];
      z[i] += c * y[i];
    }
  }
  static void muladd(const float* w, const float* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += w[i] * x[i];
  }
};

}  // namespace
}  // namespace pagewire::cpu

#include "gdn_body.h"

namespace pagewire::cpu {
void gdn_chunk_portable(const GdnChunk& c) { chunk_body<Portable>(c); }
void gdn_step_portable(const GdnChunk& c) { step_body<Portable>(c); }
void gdn_conv_row_portable(const float* const* rows, const float* wt, float* out, int64_t K, int64_t C) {
  conv_row_body<Portable>(rows, wt, out, K, C);
}
}  // namespace pagewire::cpu

namespace pagewire {
namespace {

using ChunkFn = void (*)(const cpu::GdnChunk&);
using ConvRowFn = void (*)(const float* const*, const float*, float*, int64_t, int64_t);

struct Bodies {
  ChunkFn chunk, step;
  ConvRowFn conv_row;
};

Bodies bodies() {
  const cpu::Isa isa = cpu::active_isa();
  if (isa >= cpu::Isa::kAvx512) return {cpu::gdn_chunk_avx512, cpu::gdn_step_avx512, cpu::gdn_conv_row_avx512};
  if (isa >= cpu::Isa::kAvx2) return {cpu::gdn_chunk_avx2, cpu::gdn_step_avx2, cpu::gdn_conv_row_avx2};
  return {cpu::gdn_chunk_portable, cpu::gdn_step_portable, cpu::gdn_conv_row_portable};
}

template <typename scalar_t>
inline float rnd(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// Checks slots int64 [S] (distinct, inside [0, num_slots)) and query_start_loc int32 [S + 1]
// (non-decreasing, from 0 to T); returns S.
int64_t check_batch(const at::Tensor& slots, const at::Tensor& qsl, int64_t T, int64_t num_slots) {
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "slots must be a contiguous CPU int64 [S] tensor, got ", slots.scalar_type(), " ", slots.sizes());
  const int64_t S = slots.size(0);
  TORCH_CHECK(qsl.device().is_cpu() && qsl.scalar_type() == at::kInt && qsl.dim() == 1 && qsl.size(0) == S + 1 &&
                  qsl.is_contiguous(),
              "query_start_loc must be a contiguous CPU int32 [S + 1] tensor with S = ", S, ", got ",
              qsl.scalar_type(), " ", qsl.sizes());
  const int32_t* q = qsl.data_ptr<int32_t>();
  TORCH_CHECK(q[0] == 0 && q[S] == T, "query_start_loc must run from 0 to T = ", T, ", got ", q[0], "..", q[S]);
  std::vector<bool> used(static_cast<size_t>(num_slots), false);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(q[s + 1] >= q[s], "query_start_loc must be non-decreasing");
    TORCH_CHECK(sp[s] >= 0 && sp[s] < num_slots, "slots[", s, "] = ", sp[s], " is outside [0, ", num_slots, ")");
    TORCH_CHECK(!used[sp[s]], "slots[", s, "] = ", sp[s], " appears twice: each sequence needs its own state");
    used[sp[s]] = true;
  }
  return S;
}

template <typename scalar_t>
at::Tensor conv_impl(const at::Tensor& x, const at::Tensor& wt, const float* bias, at::Tensor& states,
                     const int64_t* slots, const int32_t* qsl, int64_t S, bool act_silu) {
  const int64_t T = x.size(0), C = x.size(1), K = wt.size(0), R = K - 1;
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const int64_t ldx = x.stride(0);
  scalar_t* st = states.data_ptr<scalar_t>();
  const int64_t slot_stride = R * C;
  at::Tensor out = at::empty({T, C}, x.options());
  scalar_t* op = out.data_ptr<scalar_t>();
  const float* w = wt.data_ptr<float>();
  std::vector<int64_t> seq_of(T);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t = qsl[s]; t < qsl[s + 1]; ++t) seq_of[t] = s;
  const ConvRowFn row_fn = bodies().conv_row;
#pragma omp parallel if (T * C * K >= (1 << 15))
  {
    std::vector<float> buf(K * C), acc(C);
    std::vector<const float*> rows(K);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = seq_of[t], i = t - qsl[s];
      const scalar_t* state = st + slots[s] * slot_stride;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t p = i - R + k;  // the window's k-th input, relative to the sequence's first new token
        const scalar_t* src = p >= 0 ? xp + (qsl[s] + p) * ldx : state + (R + p) * C;
        float* dst = buf.data() + k * C;
        for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<float>(src[c]);
        rows[k] = dst;
      }
      row_fn(rows.data(), w, acc.data(), K, C);
      scalar_t* o = op + t * C;
      for (int64_t c = 0; c < C; ++c) {
        const float v = rnd<scalar_t>(bias != nullptr ? acc[c] + bias[c] : acc[c]);
        o[c] = static_cast<scalar_t>(act_silu ? silu(v) : v);
      }
    }
  }
  // The new state: the last K - 1 inputs of cat(state, x_seq), shifted in place (ascending rows
  // read old rows L + r > r, not yet overwritten).
  for (int64_t s = 0; s < S; ++s) {
    const int64_t L = qsl[s + 1] - qsl[s];
    if (L == 0) continue;
    scalar_t* state = st + slots[s] * slot_stride;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t p = L - R + r;
      const scalar_t* src = p >= 0 ? xp + (qsl[s] + p) * ldx : state + (L + r) * C;
      for (int64_t c = 0; c < C; ++c) state[r * C + c] = src[c];
    }
  }
  return out;
}

// One (sequence, value head) of the delta rule: the sequence's tokens in chunks of at most `chunk`,
// gathered to float32 (q and k l2-normalised as transformers' l2norm, q then scaled), the state
// updated in place.
template <typename scalar_t>
struct RuleArgs {
  const scalar_t *q, *k, *v;
  int64_t q_st, q_sh, k_st, k_sh, v_st, v_sh;
  const float *g, *beta;  // [T, Hv] contiguous
  float* states;          // [N, Hv, Dk, Dv]
  scalar_t* out;          // [T, Hv, Dv]
  int64_t Hv, Dk, Dv, rep, chunk;
};

inline void l2norm_row(float* x, int64_t n, float scale) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv;
  if (scale != 1.0f)
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] * scale;
}

template <typename scalar_t>
void rule_head(const RuleArgs<scalar_t>& a, const Bodies& fn, int64_t t0, int64_t L, int64_t slot, int64_t h,
               std::vector<float>& ws) {
  const int64_t Dk = a.Dk, Dv = a.Dv, C = a.chunk, hk = h / a.rep;
  float* q = ws.data();
  float* k = q + C * Dk;
  float* v = k + C * Dk;
  float* o = v + C * Dv;
  float* g = o + C * Dv;
  float* beta = g + C;
  float* work = beta + C;
  float* state = a.states + (slot * a.Hv + h) * Dk * Dv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  for (int64_t c0 = 0; c0 < L; c0 += C) {
    const int64_t n = std::min(C, L - c0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + c0 + i;
      const scalar_t* qs = a.q + t * a.q_st + hk * a.q_sh;
      const scalar_t* ks = a.k + t * a.k_st + hk * a.k_sh;
      const scalar_t* vs = a.v + t * a.v_st + h * a.v_sh;
      for (int64_t d = 0; d < Dk; ++d) q[i * Dk + d] = static_cast<float>(qs[d]);
      for (int64_t d = 0; d < Dk; ++d) k[i * Dk + d] = static_cast<float>(ks[d]);
      for (int64_t e = 0; e < Dv; ++e) v[i * Dv + e] = static_cast<float>(vs[e]);
      l2norm_row(q + i * Dk, Dk, scale);
      l2norm_row(k + i * Dk, Dk, 1.0f);
      g[i] = a.g[t * a.Hv + h];
      beta[i] = a.beta[t * a.Hv + h];
    }
    const cpu::GdnChunk c{q, k, v, g, beta, state, o, work, n, Dk, Dv};
    (n == 1 ? fn.step : fn.chunk)(c);
    for (int64_t i = 0; i < n; ++i) {
      scalar_t* dst = a.out + ((t0 + c0 + i) * a.Hv + h) * Dv;
      for (int64_t e = 0; e < Dv; ++e) dst[e] = static_cast<scalar_t>(o[i * Dv + e]);
    }
  }
}

// Every (sequence, value head) of the batch in parallel, each with its own workspace.
template <typename scalar_t>
void rule_batch(const RuleArgs<scalar_t>& a, const Bodies& fn, const int32_t* qsl, const int64_t* sp, int64_t S,
                int64_t T, int64_t ws_floats) {
  const int64_t Hv = a.Hv;
#pragma omp parallel if (T * Hv * a.Dk * a.Dv >= (1 << 16))
  {
    std::vector<float> ws(ws_floats);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < S * Hv; ++item) {
      const int64_t s = item / Hv, h = item % Hv;
      const int64_t L = qsl[s + 1] - qsl[s];
      if (L > 0) rule_head<scalar_t>(a, fn, qsl[s], L, sp[s], h, ws);
    }
  }
}

// weight * RMSNorm(x) * silu(gate) per [T, H] row of D values, rounded as transformers' RMSNormGated.
template <typename scalar_t>
void gated_norm_rows(const at::Tensor& x, const at::Tensor& gate, const scalar_t* wp, scalar_t* op, float eps) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* zp = gate.data_ptr<scalar_t>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), zs0 = gate.stride(0), zs1 = gate.stride(1);
#pragma omp parallel for schedule(static) if (T * H * D >= (1 << 16))
  for (int64_t r = 0; r < T * H; ++r) {
    const int64_t t = r / H, h = r % H;
    const scalar_t* xr = xp + t * xs0 + h * xs1;
    const scalar_t* zr = zp + t * zs0 + h * zs1;
    float ss = 0.0f;
    for (int64_t d = 0; d < D; ++d) ss += static_cast<float>(xr[d]) * static_cast<float>(xr[d]);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    scalar_t* o = op + r * D;
    for (int64_t d = 0; d < D; ++d) {
      // weight * normed (both in the activation dtype), times silu(gate) in float32
      const float n = rnd<scalar_t>(static_cast<float>(wp[d]) * rnd<scalar_t>(static_cast<float>(xr[d]) * inv));
      o[d] = static_cast<scalar_t>(n * silu(static_cast<float>(zr[d])));
    }
  }
}

void check_heads(const at::Tensor& t, const char* name, int64_t T) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(0) == T && t.stride(2) == 1, name,
              " must be a CPU [T, heads, head_dim] tensor contiguous in head_dim with T = ", T, ", got ", t.sizes(),
              " strides ", t.strides());
}

void check_f32_th(const at::Tensor& t, const char* name, int64_t T, int64_t H) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == T &&
                  t.size(1) == H && t.is_contiguous(),
              name, " must be a contiguous CPU float32 [T, Hv] = [", T, ", ", H, "] tensor, got ", t.scalar_type(),
              " ", t.sizes());
}

}  // namespace

at::Tensor gdn_causal_conv1d_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                 at::Tensor& conv_states, const at::Tensor& slots, const at::Tensor& query_start_loc,
                                 c10::string_view activation) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "x must be a CPU [T, channels] tensor contiguous in its last dim, got ", x.sizes());
  const int64_t T = x.size(0), C = x.size(1);
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.size(0) == C && weight.size(1) >= 2,
              "weight must be [channels, kernel] = [", C, ", K >= 2], got ", weight.sizes());
  const int64_t K = weight.size(1);
  TORCH_CHECK(conv_states.device().is_cpu() && conv_states.dim() == 3 && conv_states.size(1) == K - 1 &&
                  conv_states.size(2) == C && conv_states.is_contiguous() &&
                  conv_states.scalar_type() == x.scalar_type(),
              "conv_states must be a contiguous CPU [slots, K - 1, channels] = [N, ", K - 1, ", ", C,
              "] tensor of x's dtype ", x.scalar_type(), ", got ", conv_states.scalar_type(), " ", conv_states.sizes());
  TORCH_CHECK(activation == "silu" || activation == "none", "activation must be \"silu\" or \"none\", got ",
              std::string(activation));
  const int64_t S = check_batch(slots, query_start_loc, T, conv_states.size(0));
  const at::Tensor wt = weight.to(at::kFloat).t().contiguous();  // [K, C]
  at::Tensor bf;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == C, "bias must be [channels] = [", C, "], got ", bias->sizes());
    bf = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "pagewire::gdn_causal_conv1d", [&] {
    out = conv_impl<scalar_t>(x, wt, has_bias ? bf.data_ptr<float>() : nullptr, conv_states,
                              slots.data_ptr<int64_t>(), query_start_loc.data_ptr<int32_t>(), S,
                              activation == "silu");
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> gdn_gating_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                                                  const at::Tensor& dt_bias) {
  TORCH_CHECK(a.device().is_cpu() && a.dim() == 2 && a.stride(1) == 1, "a must be a CPU [T, Hv] tensor, got ",
              a.sizes());
  TORCH_CHECK(b.device().is_cpu() && b.sizes() == a.sizes() && b.stride(1) == 1, "b must be [T, Hv] like a, got ",
              b.sizes());
  const int64_t T = a.size(0), H = a.size(1);
  TORCH_CHECK(A_log.dim() == 1 && A_log.size(0) == H && dt_bias.dim() == 1 && dt_bias.size(0) == H,
              "A_log and dt_bias must be [Hv] = [", H, "], got ", A_log.sizes(), " and ", dt_bias.sizes());
  const at::Tensor al = A_log.to(at::kFloat).contiguous(), db = dt_bias.to(at::kFloat).contiguous();
  at::Tensor g = at::empty({T, H}, a.options().dtype(at::kFloat));
  at::Tensor beta = at::empty({T, H}, a.options().dtype(at::kFloat));
  const float* alp = al.data_ptr<float>();
  const float* dbp = db.data_ptr<float>();
  float* gp = g.data_ptr<float>();
  float* bp = beta.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "pagewire::gdn_gating", [&] {
    const scalar_t* ap = a.data_ptr<scalar_t>();
    TORCH_CHECK(b.scalar_type() == a.scalar_type(), "b dtype must equal a dtype");
    const scalar_t* bsrc = b.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        // g = -exp(A_log) * softplus(a + dt_bias) in float32 (torch's softplus: linear above 20)
        const float x = static_cast<float>(ap[t * a.stride(0) + h]) + dbp[h];
        const float sp = x > 20.0f ? x : std::log1p(std::exp(x));
        gp[t * H + h] = -std::exp(alp[h]) * sp;
        // beta = sigmoid(b) in b's dtype, then float32 (transformers converts it in the rule)
        const float bv = static_cast<float>(bsrc[t * b.stride(0) + h]);
        bp[t * H + h] = rnd<scalar_t>(1.0f / (1.0f + std::exp(-bv)));
      }
    }
  });
  return {g, beta};
}

at::Tensor gated_delta_rule_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, at::Tensor& states, const at::Tensor& slots,
                                const at::Tensor& query_start_loc, int64_t chunk_size) {
  const int64_t T = v.size(0);
  check_heads(q, "q", T);
  check_heads(k, "k", T);
  check_heads(v, "v", T);
  TORCH_CHECK(q.sizes() == k.sizes(), "q and k must have the same shape, got ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK(q.scalar_type() == v.scalar_type() && k.scalar_type() == v.scalar_type(),
              "q, k and v must share a dtype");
  const int64_t Hk = q.size(1), Dk = q.size(2), Hv = v.size(1), Dv = v.size(2);
  TORCH_CHECK(Hv % Hk == 0, "value heads (", Hv, ") must be a multiple of key heads (", Hk, ")");
  check_f32_th(g, "g", T, Hv);
  check_f32_th(beta, "beta", T, Hv);
  TORCH_CHECK(states.device().is_cpu() && states.scalar_type() == at::kFloat && states.dim() == 4 &&
                  states.size(1) == Hv && states.size(2) == Dk && states.size(3) == Dv && states.is_contiguous(),
              "states must be a contiguous CPU float32 [slots, Hv, Dk, Dv] = [N, ", Hv, ", ", Dk, ", ", Dv,
              "] tensor, got ", states.scalar_type(), " ", states.sizes());
  TORCH_CHECK(chunk_size >= 1 && chunk_size <= 256, "chunk_size must be in [1, 256], got ", chunk_size);
  const int64_t S = check_batch(slots, query_start_loc, T, states.size(0));
  at::Tensor out = at::empty({T, Hv, Dv}, v.options());
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const Bodies fn = bodies();
  // A sequence's tokens run in chunks of chunk_size, so a batch whose longest sequence is shorter
  // (every decode step) chunks the same with C = that length, and each thread's workspace shrinks
  // from ~230 KB (chunk 64, heads of 128) to a few KB.
  int64_t longest = 1;
  for (int64_t s = 0; s < S; ++s) longest = std::max<int64_t>(longest, qsl[s + 1] - qsl[s]);
  const int64_t C = std::min(chunk_size, longest);
  const int64_t ws_floats = 2 * C * Dk + 2 * C * Dv + 2 * C + std::max(cpu::gdn_chunk_work_floats(C, Dk, Dv), Dv);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "pagewire::gated_delta_rule", [&] {
    const RuleArgs<scalar_t> a{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                               q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               g.data_ptr<float>(), beta.data_ptr<float>(), states.data_ptr<float>(),
                               out.data_ptr<scalar_t>(), Hv, Dk, Dv, Hv / Hk, C};
    rule_batch<scalar_t>(a, fn, qsl, sp, S, T, ws_floats);
  });
  return out;
}

at::Tensor gated_rms_norm_cpu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1,
              "x must be a CPU [T, heads, head_dim] tensor contiguous in head_dim, got ", x.sizes());
  TORCH_CHECK(gate.device().is_cpu() && gate.sizes() == x.sizes() && gate.stride(2) == 1 &&
                  gate.scalar_type() == x.scalar_type(),
              "gate must be a CPU tensor of x's shape ", x.sizes(), " and dtype, contiguous in head_dim, got ",
              gate.scalar_type(), " ", gate.sizes());
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D && weight.scalar_type() == x.scalar_type(),
              "weight must be [head_dim] = [", D, "] of x's dtype, got ", weight.scalar_type(), " ", weight.sizes());
  at::Tensor out = at::empty({T, H, D}, x.options());
  const at::Tensor wc = weight.contiguous();
  const float feps = static_cast<float>(eps);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "pagewire::gated_rms_norm", [&] {
    gated_norm_rows<scalar_t>(x, gate, wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), feps);
  });
  return out;
}

}  // namespace pagewire
