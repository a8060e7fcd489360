// decode_layer: one decoder layer of a small CPU batch (at most 16 tokens: decode steps) in one
// call, for every norm placement (pre: Llama; post: OLMo 2; both: Gemma), q/k norm per head or over
// the projection, full, partial or no RoPE, Granite's residual multiplier, and Gemma 4's parts (a
// layer reading an earlier layer's KV, values from the key projection, the weightless value norm,
// the per-layer input block and the layer scalar), and a step's stacked LoRA terms (LoraTerms: pagewire::lora_add). It runs exactly the
// C++ ops that the Python layer (server/models/decoder.py, DecoderLayer.forward) calls, in the same
// order on the same tensors, so it gives the same floats; what it saves is the Python between them: about ten op dispatches per layer through torch.ops, the wrappers' checks
// and the layer's own bytecode, which cost as much as the small matrices' kernels on a model like
// SmolLM2-135M (30 layers of 576-wide matrices; bench/RESULTS.md).
//
// Which kernel each matrix takes is decided in Python, by the same rules as ops.linear (fixed
// rules, the autotune table), and passed in as a kind per matrix (see run_linear).
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../ops.h"
#include "crew.h"
#include "layer_parts.h"
#include "quant4_kernel.h"
#include "quant_kernel.h"

namespace pagewire {

namespace {

// Bytes of one weight row of K values in a linear kind's block format (server/kernels/quant.py
// QTYPES; "x8" names the interleaved layout of the same bytes); 0 for a kind with no blocks.
int64_t block_row_bytes(const std::string& kind, int64_t k) {
  if (kind == "q8_0" || kind == "q8_0x8") return k % cpu::kQ8Block == 0 ? k / cpu::kQ8Block * cpu::kQ8BlockBytes : -1;
  cpu::Q4Type t;
  bool x8 = false;
  if (!cpu::parse_q4_name(kind, &t, &x8)) return 0;
  const int64_t values = cpu::q4_block_values(t);
  return k % values == 0 ? k / values * cpu::q4_block_bytes(t) : -1;
}

// A matrix whose row ranges are in different block formats (server/kernels/quant_parts.py
// QuantizedParts: a Q4_K_M file's qkv of Q4_K q/k rows and Q6_K v rows): kind
// "parts:KIND*ROWS+KIND*ROWS+...", w the parts' block bytes one after another (uint8 [bytes]).
// Each part runs its own format's kernel on a view of its bytes (nothing is dequantised) with its
// slice of the bias, and lands in its columns of the result: per element exactly what that part
// alone gives, which is what ops.linear computes for QuantizedParts. On AVX2 or better all parts
// run in one OpenMP region (layer_parts::linear_parts_region, cpu/linear_parts.cpp).
at::Tensor run_parts(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                     const std::string& kind) {
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "decode_layer: a '", kind, "' weight must be contiguous uint8 [bytes], got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(x.dim() == 2, "decode_layer: x must be [M, K], got ", x.sizes());
  const int64_t K = x.size(1);
  const bool has_bias = b.has_value() && b->defined();
  std::vector<layer_parts::LinearPart> parts;
  int64_t offset = 0, row = 0;
  size_t pos = 6;  // past "parts:"
  while (pos < kind.size()) {
    const size_t end = std::min(kind.find('+', pos), kind.size());
    const std::string entry = kind.substr(pos, end - pos);
    const size_t star = entry.find('*');
    TORCH_CHECK(star != std::string::npos && star > 0 && star + 1 < entry.size(),
                "decode_layer: part '", entry, "' of '", kind, "' is not KIND*ROWS");
    const std::string part_kind = entry.substr(0, star);
    const std::string digits = entry.substr(star + 1);
    TORCH_CHECK(digits.size() <= 12 && digits.find_first_not_of("0123456789") == std::string::npos,
                "decode_layer: part '", entry, "' of '", kind, "' has no row count");
    const int64_t rows = std::stoll(digits);
    const int64_t rb = block_row_bytes(part_kind, K);
    TORCH_CHECK(rb > 0 && rows > 0, "decode_layer: part '", entry, "' of '", kind,
                "' needs a block format whose block divides K = ", K, " and rows > 0");
    TORCH_CHECK(offset + rows * rb <= w.numel(), "decode_layer: '", kind, "' needs more than the weight's ", w.numel(),
                " bytes");
    parts.push_back({part_kind, w.narrow(0, offset, rows * rb).view({rows, rb})});
    offset += rows * rb;
    row += rows;
    pos = end + 1;
  }
  TORCH_CHECK(!parts.empty() && offset == w.numel(), "decode_layer: '", kind, "' accounts for ", offset,
              " of the weight's ", w.numel(), " bytes");
  TORCH_CHECK(!has_bias || b->size(0) == row, "decode_layer: bias has ", b->size(0), " rows, the parts ", row);
  // Every part in one OpenMP region where the CPU has one (x quantised once; one wake-up of the
  // threads instead of one per part), else part by part: the same floats either way.
  at::Tensor fused = layer_parts::linear_parts_region(x, parts, b);
  if (fused.defined()) return fused;
  std::vector<at::Tensor> outs;
  row = 0;
  for (const layer_parts::LinearPart& p : parts) {
    const int64_t rows = p.w.size(0);
    const c10::optional<at::Tensor> part_bias = has_bias ? c10::optional<at::Tensor>(b->narrow(0, row, rows)) : c10::nullopt;
    outs.push_back(run_linear_kind(x, p.w, part_bias, p.kind));
    row += rows;
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 1);
}

}  // namespace

// x @ w^T (+ b) by the path ops.linear would take: "kernel" (pagewire::linear), "torch"
// (F.linear, i.e. at::linear), "bf16x8" (pagewire::linear_bf16x8: a bf16 weight in the x8 layout),
// "bf16zx8" (pagewire::linear_bf16z: one packed, cpu/bf16z_layout.h),
// "q8_0" / "q8_0x8" (pagewire::linear_q8_0, row or interleaved layout), or a qtype of pagewire::linear_q4 ("q4_0", ..., "iq4_nl",
// "q4_0x8", ...: cpu::parse_q4_name), or "parts:..." (run_parts: row ranges in different
// block formats). Also moe_decode's router and shared expert, and the hybrid layers' matrices.
at::Tensor run_linear_kind(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                           const std::string& kind) {
  if (kind.rfind("parts:", 0) == 0) return run_parts(x, w, b, kind);
  if (kind == "kernel") return linear_cpu(x, w, b);
  if (kind == "torch") return at::linear(x, w, b);
  if (kind == "q8_0") return linear_q8_0_cpu(x, w, b, false);
  if (kind == "q8_0x8") return linear_q8_0_cpu(x, w, b, true);
  if (kind == "bf16x8") return linear_bf16x8_cpu(x, w, b);
  if (kind == "bf16zx8") return linear_bf16z_cpu(x, w, b);
  // Any other kind is a linear_q4 qtype (the 4-bit and K-quant formats), which checks the rest.
  cpu::Q4Type t;
  bool x8 = false;
  TORCH_CHECK(cpu::parse_q4_name(kind, &t, &x8), "decode_layer: unknown linear kind '", kind, "'");
  return linear_q4_cpu(x, w, kind, b);
}

namespace layer_parts {

at::Tensor run_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                      const std::string& kind) {
  cpu::crew_range_started();  // (a stack on a crew: its read-ahead moves past this matrix; crew.h)
  return run_linear_kind(x, w, b, kind);
}

// A sub-block's input (the Python layer's _enter): the residual stream with `delta` (the previous
// sub-block's output) added in place, then RMSNorm'ed by `norm` in one fused op; without an input
// norm (OLMo 2's post-norm layers) the stream itself.
at::Tensor enter(at::Tensor& hidden, const c10::optional<at::Tensor>& delta, const c10::optional<at::Tensor>& norm,
                 double eps) {
  const bool has_delta = delta.has_value() && delta->defined();
  if (!norm.has_value() || !norm->defined()) return has_delta ? hidden.add_(*delta) : hidden;
  return has_delta ? add_rms_norm_cpu(hidden, *delta, *norm, eps) : rms_norm_cpu(hidden, *norm, eps);
}

// A sub-block's output as it joins the residual stream (_leave): post-normed (OLMo 2, Gemma), then
// scaled by the residual multiplier (Granite). at::mul by a Scalar is the op Python's `out * m` runs.
at::Tensor leave(const at::Tensor& out, const c10::optional<at::Tensor>& post_norm, double eps,
                 double residual_multiplier) {
  at::Tensor r = post_norm.has_value() && post_norm->defined() ? rms_norm_cpu(out, *post_norm, eps) : out;
  return residual_multiplier != 1.0 ? at::mul(r, residual_multiplier) : r;
}

// The Python layer's torch-op RMSNorm (server/models/layers.py rms_norm, Gemma 4's value norm)
// op for op: statistics in fp32, the fp32 result scaled by w, or rounded to x's dtype and then
// scaled (transformers' rounding for bf16).
at::Tensor torch_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const bool f32 = x.scalar_type() == at::kFloat;
  const at::Tensor xf = f32 ? x : x.to(at::kFloat);
  const at::Tensor inv_rms = xf.pow(2).mean(at::IntArrayRef{-1}, true).add_(eps).rsqrt_();
  return f32 ? xf.mul(inv_rms).mul_(w) : w.mul(xf.mul(inv_rms).to(x.scalar_type()));
}

}  // namespace layer_parts

namespace {
using layer_parts::enter;
using layer_parts::leave;
using layer_parts::run_linear;
using layer_parts::torch_rms_norm;

// A step's stacked LoRA terms for one layer (LoraStep.fused_args): lora = [adapter (int32 [T], each
// row's index in the stack, -1: none), scales (float32 [n])] then, per matrix that has a term (qkv,
// o, gate_up, down in that order), its stacked A [R, in], its spans [n, P, 2] and one B^T per part
// (PEFT module); lora_spec = per matrix its part count P (-1: no term) then (row, rows, c0) per
// part. add() runs pagewire::lora_add (cpu/lora.cpp), the op LoraStep.add runs, on the same
// tensors, so a fused layer's floats equal the Python layer's.
class LoraTerms {
 public:
  LoraTerms(at::TensorList lora, at::IntArrayRef spec) : spec_(spec) {
    if (lora.empty()) return;
    TORCH_CHECK(lora.size() >= 2 && lora[0].scalar_type() == at::kInt && lora[0].dim() == 1,
                "decode_layer: lora[0] must be the int32 adapter index of each row, lora[1] the scales");
    adapter_ = lora[0];
    scales_ = lora[1];
    size_t t = 2, s = 0;
    for (int m = 0; m < 4; ++m) {
      TORCH_CHECK(s < spec.size(), "decode_layer: lora_spec is short of matrix ", m);
      const int64_t parts = spec[s++];
      if (parts < 0) continue;
      TORCH_CHECK(t + 2 + static_cast<size_t>(parts) <= lora.size() && s + 3 * static_cast<size_t>(parts) <= spec.size(),
                  "decode_layer: lora and lora_spec disagree at matrix ", m);
      Matrix& mx = m_[m];
      mx.a = lora[t];
      mx.spans = lora[t + 1];
      mx.bts = lora.slice(t + 2, parts);
      mx.spec0 = s;
      mx.parts = parts;
      t += 2 + parts;
      s += 3 * parts;
      mx.present = true;
    }
    TORCH_CHECK(t == lora.size() && s == spec.size(), "decode_layer: lora and lora_spec have unread entries");
  }

  // out += each row's own adapter term for matrix m (0 qkv, 1 o, 2 gate_up, 3 down), in place.
  void add(int m, const at::Tensor& x, const at::Tensor& out) const {
    const Matrix& mx = m_[m];
    if (!mx.present) return;
    at::Tensor o = out;
    lora_add_cpu(o, x, adapter_, mx.a, mx.spans, scales_, mx.bts, spec_.slice(mx.spec0, 3 * mx.parts));
  }

 private:
  struct Matrix {
    bool present = false;
    at::Tensor a, spans;
    at::TensorList bts;
    size_t spec0 = 0;
    int64_t parts = 0;
  };
  at::IntArrayRef spec_;
  at::Tensor adapter_, scales_;
  Matrix m_[4];
};

}  // namespace

at::Tensor decode_layer_cpu(at::Tensor& hidden, const c10::optional<at::Tensor>& delta,
                            const c10::optional<at::Tensor>& attn_norm, const c10::optional<at::Tensor>& attn_post_norm,
                            const c10::optional<at::Tensor>& mlp_norm, const c10::optional<at::Tensor>& mlp_post_norm,
                            double eps, double residual_multiplier, const at::Tensor& qkv_weight,
                            c10::string_view qkv_kind, const c10::optional<at::Tensor>& qkv_bias,
                            const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                            const at::Tensor& o_weight, c10::string_view o_kind, const c10::optional<at::Tensor>& o_bias,
                            const at::Tensor& gate_up_weight, c10::string_view gate_up_kind,
                            const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down_weight,
                            c10::string_view down_kind, const c10::optional<at::Tensor>& down_bias,
                            const at::Tensor& positions, const c10::optional<at::Tensor>& cos,
                            const c10::optional<at::Tensor>& sin, const c10::optional<at::Tensor>& qk_norm,
                            at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                            int64_t max_query_len, int64_t max_seq_len, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, double softcap, c10::string_view activation,
                            const c10::optional<at::Tensor>& v_norm, bool shares_kv, bool value_from_key,
                            const c10::optional<at::Tensor>& per_layer_input, const c10::optional<at::Tensor>& ple_gate,
                            c10::string_view ple_gate_kind, const c10::optional<at::Tensor>& ple_proj,
                            c10::string_view ple_proj_kind, const c10::optional<at::Tensor>& ple_norm,
                            const c10::optional<at::Tensor>& layer_scalar,
                            const c10::optional<at::Tensor>& sinks, c10::optional<at::TensorList> lora,
                            at::OptionalIntArrayRef lora_spec) {
  TORCH_CHECK(hidden.device().is_cpu() && hidden.dim() == 2, "hidden must be a CPU [T, hidden] tensor, got ",
              hidden.sizes(), " on ", hidden.device());
  const int64_t T = hidden.size(0);
  TORCH_CHECK(T <= kQ8KernelMaxRows, "decode_layer takes at most ", kQ8KernelMaxRows, " tokens, got ", T);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  // Checked before anything is written, so a bad argument leaves hidden and the caches untouched.
  const bool gelu = activation == "gelu_tanh";
  TORCH_CHECK(gelu || activation == "silu", "decode_layer: activation must be 'silu' or 'gelu_tanh', got '",
              std::string(activation), "'");
  const bool has_rope = cos.has_value() && cos->defined();
  TORCH_CHECK(has_rope == (sin.has_value() && sin->defined()), "decode_layer: cos and sin come together (both None: a NoPE layer)");
  const bool proj_norm = q_norm.has_value() && q_norm->defined();
  TORCH_CHECK(proj_norm == (k_norm.has_value() && k_norm->defined()), "decode_layer: q_norm and k_norm come together");
  const bool head_norm = qk_norm.has_value() && qk_norm->defined();
  TORCH_CHECK(!(head_norm && proj_norm), "decode_layer: q/k norm is per head (qk_norm) or over the projection (q_norm, k_norm), not both");
  const int64_t rotary_dim = has_rope ? 2 * cos->size(1) : 0;
  TORCH_CHECK(!has_rope || (rotary_dim > 0 && rotary_dim <= head_dim), "decode_layer: the RoPE tables rotate ",
              rotary_dim, " dims of a ", head_dim, "-dim head");
  // The per-head norm rides on the rotation (rotary_embedding's norm_weight) where RoPE turns the
  // whole head; on a partial-rotary or NoPE layer (GLM-4.5 with use_qk_norm) it is the Python
  // layer's torch-op RMSNorm over each head first (torch_rms_norm, the same ops), then RoPE turns
  // the leading dims alone.
  const bool norm_on_rotation = head_norm && rotary_dim == head_dim;
  // Gemma 4: a KV-sharing layer projects queries only and reads the caches it is given (its source
  // layer's); with value_from_key the values are the key projection (no v rows in qkv).
  TORCH_CHECK(!(shares_kv && (value_from_key || proj_norm)),
              "decode_layer: a layer reading another layer's KV has no keys to norm or take values from");
  const bool ple = ple_gate.has_value() && ple_gate->defined();
  TORCH_CHECK(ple == (ple_proj.has_value() && ple_proj->defined()) &&
                  ple == (ple_norm.has_value() && ple_norm->defined()) &&
                  ple == (per_layer_input.has_value() && per_layer_input->defined()),
              "decode_layer: per_layer_input, ple_gate, ple_proj and ple_norm come together");
  const bool scalar = layer_scalar.has_value() && layer_scalar->defined();
  const int64_t key_heads = shares_kv ? 0 : num_kv_heads;  // key heads this layer projects
  const int64_t own_kv = shares_kv ? 0 : (value_from_key ? 1 : 2) * kv_size;
  // Attention half: input norm (with the previous layer's MLP output added), qkv, q/k norm over the
  // projection (OLMo 2), RoPE on q and k in place (they are adjacent in qkv; partial rotary turns
  // only the leading dims, NoPE none), the value norm (Gemma 4), the KV write (none for a layer
  // reading another's KV), paged attention.
  const at::Tensor x = enter(hidden, delta, attn_norm, eps);
  const LoraTerms terms(lora.value_or(at::TensorList()), lora_spec.value_or(at::IntArrayRef()));
  const at::Tensor qkv = run_linear(x, qkv_weight, qkv_bias, std::string(qkv_kind));
  terms.add(0, x, qkv);
  TORCH_CHECK(qkv.size(1) == q_size + own_kv, "decode_layer: qkv has ", qkv.size(1), " columns, heads say ",
              q_size + own_kv);
  if (proj_norm) {
    qkv.narrow(1, 0, q_size).copy_(rms_norm_cpu(qkv.narrow(1, 0, q_size).contiguous(), *q_norm, eps));
    qkv.narrow(1, q_size, kv_size).copy_(rms_norm_cpu(qkv.narrow(1, q_size, kv_size).contiguous(), *k_norm, eps));
  }
  // attention_k_eq_v: the values are a copy of the key projection taken before norm and RoPE.
  at::Tensor value;
  if (value_from_key) {
    value = qkv.narrow(1, q_size, kv_size).clone(at::MemoryFormat::Contiguous).view({T, num_kv_heads, head_dim});
  } else if (!shares_kv) {
    value = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
  }
  at::Tensor qk = qkv.narrow(1, 0, q_size + key_heads * head_dim).view({T, num_heads + key_heads, head_dim});
  if (head_norm && !norm_on_rotation) qk.copy_(torch_rms_norm(qk, *qk_norm, eps));
  if (has_rope) {
    at::Tensor turned = rotary_dim == head_dim ? qk : qk.narrow(2, 0, rotary_dim);
    rotary_embedding_cpu(turned, positions, *cos, *sin, norm_on_rotation ? qk_norm : c10::nullopt, eps);
  }
  const at::Tensor query = qk.narrow(1, 0, num_heads);
  if (value.defined()) {
    if (v_norm.has_value() && v_norm->defined()) value = torch_rms_norm(value, *v_norm, eps);
    write_kv_cache_cpu(qk.narrow(1, num_heads, num_kv_heads), value, key_cache, value_cache, slot_mapping);
  }
  at::Tensor attn = at::empty({T, num_heads, head_dim}, hidden.options());
  paged_attention_cpu(attn, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                      sliding_window, max_query_len, max_seq_len, softcap, sinks);
  // MLP half: o projection (post-normed and scaled as it leaves) added into the residual stream by
  // the MLP's input norm, gate/up, the gated activation (SiLU or GELU-tanh) times up, down. The
  // down projection's output, as it leaves, is left for the next layer's norm to add (as in Python).
  const at::Tensor o = run_linear(attn.view({T, q_size}), o_weight, o_bias, std::string(o_kind));
  terms.add(1, attn.view({T, q_size}), o);
  const c10::optional<at::Tensor> attn_out = leave(o, attn_post_norm, eps, residual_multiplier);
  const at::Tensor x2 = enter(hidden, attn_out, mlp_norm, eps);
  // A sparse (mixture-of-experts) layer: gate_up_kind "none" stops here and returns the MLP's
  // input; the caller runs moe_decode on it (DecoderLayer.forward_fused).
  if (gate_up_kind == "none") return x2.is_same(hidden) ? x2.clone() : x2;
  const at::Tensor gate_up = run_linear(x2, gate_up_weight, gate_up_bias, std::string(gate_up_kind));
  terms.add(2, x2, gate_up);
  const at::Tensor act = gelu ? gelu_tanh_and_mul_cpu(gate_up) : silu_and_mul_cpu(gate_up);
  const at::Tensor down = run_linear(act, down_weight, down_bias, std::string(down_kind));
  terms.add(3, act, down);
  at::Tensor mlp = leave(down, mlp_post_norm, eps, residual_multiplier);
  if (!ple && !scalar) return mlp;
  // Gemma 4's end of layer (DecoderLayer._finish): the MLP output added, the per-layer input
  // block's norm(proj(act(gate(h)) * per_layer_input)) added, the stream scaled by the layer's
  // scalar. Nothing is left to add: an empty [0, H] result says so.
  hidden.add_(mlp);
  if (ple) {
    at::Tensor gate = run_linear(hidden, *ple_gate, c10::nullopt, std::string(ple_gate_kind));
    gate = gelu ? at::gelu(gate, "tanh") : at::silu(gate);
    hidden.add_(rms_norm_cpu(run_linear(gate.mul_(*per_layer_input), *ple_proj, c10::nullopt, std::string(ple_proj_kind)),
                             *ple_norm, eps));
  }
  if (scalar) hidden.mul_(*layer_scalar);
  return at::empty({0, hidden.size(1)}, hidden.options());
}

}  // namespace pagewire
