// Fused elementwise CPU ops for the decoder layer: RMSNorm (optionally with the residual add),
// rotary embedding in place on q and k (optionally after Qwen3's per-head q/k RMSNorm) and the
// gated activations SiLU-and-mul and GELU-tanh-and-mul. Each replaces 4-8 small ATen kernels, whose per-call overhead dominates a decode
// step's non-GEMM time at batch 1.
//
// Rounding follows transformers step for step (the reference the model tests compare against):
// statistics and products in fp32, rounded to the activation dtype wherever transformers
// materialises a bf16/fp16 tensor. Portable C++ compiled for the baseline ISA; the loops are
// simple enough for the compiler to vectorise, and rows run in parallel when there are many.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../ops.h"
#include "cpu_features.h"
#include "fused_kernel.h"
#include "maybe_parallel.h"

namespace pagewire {
namespace {

// Elements of work below which a single thread is faster than waking the OpenMP team.
constexpr int64_t kParallelElems = cpu::kFusedParallelElems;

// Conversions between float and the element type. bf16 is spelled out with branch-free bit
// operations (round to nearest even; NaN stays NaN), which the compiler vectorises, where
// c10::BFloat16's own conversion branches per element.
template <typename scalar_t>
inline float to_f(scalar_t v) {
  return static_cast<float>(v);
}
template <>
inline float to_f<c10::BFloat16>(c10::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <typename scalar_t>
inline scalar_t from_f(float v) {
  return static_cast<scalar_t>(v);
}
template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return c10::BFloat16(static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded),
                       c10::BFloat16::from_bits());
}

// v rounded to scalar_t and back: what a transformers tensor of that dtype would hold.
template <typename scalar_t>
inline float rnd(float v) {
  return to_f<scalar_t>(from_f<scalar_t>(v));
}

template <typename scalar_t>
inline float inv_rms(const float* v, int64_t d, float eps) {
  // Eight partial sums: vectorisable without -ffast-math and closer to torch's own blocked mean.
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    for (int j = 0; j < 8; ++j) part[j] += v[k + j] * v[k + j];
  }
  for (; k < d; ++k) part[0] += v[k] * v[k];
  const float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  return 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
}

// out[k] = weight[k] * (v[k] * inv) with transformers' rounding: the normalised value is cast to
// the activation dtype before the weight multiplies it (for fp32 both casts are no-ops).
template <typename scalar_t>
inline void scale_row(const float* v, int64_t d, float inv, const scalar_t* weight, scalar_t* out) {
  for (int64_t k = 0; k < d; ++k) {
    out[k] = from_f<scalar_t>(to_f<scalar_t>(weight[k]) * rnd<scalar_t>(v[k] * inv));
  }
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const char* x_name) {
  TORCH_CHECK(x.device().is_cpu(), x_name, " must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2, x_name, " must be [T, hidden], got shape ", x.sizes());
  TORCH_CHECK(x.stride(1) == 1, x_name, " must be contiguous in its last dim");
  TORCH_CHECK(weight.device().is_cpu(), "weight must be a CPU tensor, got ", weight.device());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [hidden] with hidden = ", x.size(1),
              ", got shape ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight dtype ", weight.scalar_type(), " must equal ", x_name,
              " dtype ", x.scalar_type());
}

// Normalises one row xr of d values into `out` (adding dr into xr first when dr != nullptr); v is
// d floats of scratch. A function of its own with restrict pointers: inside the row loop's lambda
// GCC no longer vectorised the residual add (a T = 8 norm took 11.5 us on one thread against 7.5).
template <typename scalar_t>
void norm_row(scalar_t* __restrict xr, const scalar_t* __restrict dr, const scalar_t* __restrict weight,
              scalar_t* __restrict out, int64_t d, float eps, float* __restrict v) {
  if (dr != nullptr) {
    // residual = residual + delta, rounded to the residual's dtype as `hidden + residual` is. Two
    // passes (the rounded sums into v, then v back into the residual, exact since each is already
    // a scalar_t value): one pass that stores into xr while it reads was left scalar by GCC's
    // runtime alias check.
    for (int64_t k = 0; k < d; ++k) v[k] = rnd<scalar_t>(to_f<scalar_t>(xr[k]) + to_f<scalar_t>(dr[k]));
    for (int64_t k = 0; k < d; ++k) xr[k] = from_f<scalar_t>(v[k]);
  } else {
    for (int64_t k = 0; k < d; ++k) v[k] = to_f<scalar_t>(xr[k]);
  }
  scale_row<scalar_t>(v, d, inv_rms<scalar_t>(v, d, eps), weight, out);
}

// Normalises the T rows of x (adding delta into x first when delta != nullptr).
template <typename scalar_t>
void norm_rows(scalar_t* x, int64_t ldx, const scalar_t* delta, int64_t ldd, const scalar_t* weight, scalar_t* out,
               int64_t ldo, int64_t T, int64_t d, float eps) {
  cpu::maybe_parallel_for(T, T * d >= kParallelElems, [&](int64_t t) {
    norm_row<scalar_t>(x + t * ldx, delta != nullptr ? delta + t * ldd : nullptr, weight, out + t * ldo, d, eps,
                       cpu::row_scratch(d));
  });
}

// Rotates (after the optional per-head norm) T rows of n heads of x in place; see rotary_embedding_cpu.
template <typename scalar_t>
void rope_rows(scalar_t* xp, int64_t st, int64_t sh, int64_t T, int64_t n, int64_t d, const int64_t* pp,
               const float* cp, const float* sp, const scalar_t* wp, float feps) {
  const int64_t half = d / 2;
  cpu::maybe_parallel_for(T, T * n * d >= kParallelElems, [&](int64_t t) {
    float* __restrict v = cpu::row_scratch(d, 0);
    float* __restrict c = cpu::row_scratch(half, 1);
    float* __restrict s = cpu::row_scratch(half, 2);
    // transformers casts cos/sin to the activation dtype before rotating.
    for (int64_t j = 0; j < half; ++j) {
      c[j] = rnd<scalar_t>(cp[pp[t] * half + j]);
      s[j] = rnd<scalar_t>(sp[pp[t] * half + j]);
    }
    for (int64_t h = 0; h < n; ++h) {
      scalar_t* xr = xp + t * st + h * sh;
      for (int64_t k = 0; k < d; ++k) v[k] = to_f<scalar_t>(xr[k]);
      if (wp != nullptr) {  // Qwen3: RMSNorm over head_dim first, with this head's weight row
        const float inv = inv_rms<scalar_t>(v, d, feps);
        const scalar_t* w = wp + h * d;
        for (int64_t k = 0; k < d; ++k) v[k] = rnd<scalar_t>(to_f<scalar_t>(w[k]) * rnd<scalar_t>(v[k] * inv));
      }
      // Rotate-half: x * cat(cos, cos) + cat(-x2, x1) * cat(sin, sin), each product and the
      // sum rounded to the dtype, as the three bf16 tensors in transformers are.
      for (int64_t j = 0; j < half; ++j) {
        const float a = v[j], b = v[j + half];
        xr[j] = from_f<scalar_t>(rnd<scalar_t>(a * c[j]) + rnd<scalar_t>(-b * s[j]));
        xr[j + half] = from_f<scalar_t>(rnd<scalar_t>(b * c[j]) + rnd<scalar_t>(a * s[j]));
      }
    }
  });
}

// The gated MLP activations, on one fp32 gate value as torch computes them (in fp32 for every
// activation dtype).
struct Silu {
  static float apply(float g) { return g / (1.0f + std::exp(-g)); }
};
struct GeluTanh {  // F.gelu(approximate="tanh"), torch's formula and constants
  static float apply(float g) {
    constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;  // sqrt(2 / pi)
    return 0.5f * g * (1.0f + std::tanh(kBeta * (g + kKappa * g * g * g)));
  }
};

// out[t] = act(gate) * up for T rows of x = cat(gate, up) (row stride ldx), I values each.
template <typename Act, typename scalar_t>
void gated_rows(const scalar_t* xp, int64_t ldx, scalar_t* op, int64_t T, int64_t I) {
  cpu::maybe_parallel_for(T, T * I >= kParallelElems, [&](int64_t t) {
    const scalar_t* g = xp + t * ldx;
    const scalar_t* u = g + I;
    scalar_t* o = op + t * I;
    for (int64_t j = 0; j < I; ++j) {
      // act(gate) is a tensor of the activation dtype in transformers, then times up.
      o[j] = from_f<scalar_t>(rnd<scalar_t>(Act::apply(to_f<scalar_t>(g[j]))) * to_f<scalar_t>(u[j]));
    }
  });
}

at::Tensor check_gated_input(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2 * I], got shape ", x.sizes());
  TORCH_CHECK(x.stride(1) == 1, "x must be contiguous in its last dim");
  return at::empty({x.size(0), x.size(1) / 2}, x.options());
}

}  // namespace

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight, "x");
  const int64_t T = x.size(0), d = x.size(1);
  at::Tensor out = at::empty({T, d}, x.options());
  const at::Tensor wc = weight.contiguous();
  if (cpu::active_isa() != cpu::Isa::kPortable && x.scalar_type() == at::kBFloat16) {
    cpu::rms_norm_rows_bf16_avx2(reinterpret_cast<uint16_t*>(const_cast<void*>(x.data_ptr())), x.stride(0), nullptr, 0,
                                 reinterpret_cast<const uint16_t*>(wc.data_ptr()),
                                 reinterpret_cast<uint16_t*>(out.data_ptr()), d, T, d, static_cast<float>(eps));
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "pagewire::rms_norm", [&] {
    norm_rows<scalar_t>(const_cast<scalar_t*>(x.data_ptr<scalar_t>()), x.stride(0), nullptr, 0,
                        wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), d, T, d, static_cast<float>(eps));
  });
  return out;
}

at::Tensor add_rms_norm_cpu(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_norm_args(residual, weight, "residual");
  TORCH_CHECK(delta.device().is_cpu(), "delta must be a CPU tensor, got ", delta.device());
  TORCH_CHECK(delta.sizes() == residual.sizes(), "delta shape ", delta.sizes(), " must equal residual shape ",
              residual.sizes());
  TORCH_CHECK(delta.scalar_type() == residual.scalar_type(), "delta dtype ", delta.scalar_type(),
              " must equal residual dtype ", residual.scalar_type());
  TORCH_CHECK(delta.stride(1) == 1, "delta must be contiguous in its last dim");
  const int64_t T = residual.size(0), d = residual.size(1);
  at::Tensor out = at::empty({T, d}, residual.options());
  const at::Tensor wc = weight.contiguous();
  if (cpu::active_isa() != cpu::Isa::kPortable && residual.scalar_type() == at::kBFloat16) {
    cpu::rms_norm_rows_bf16_avx2(reinterpret_cast<uint16_t*>(residual.data_ptr()), residual.stride(0),
                                 reinterpret_cast<const uint16_t*>(delta.data_ptr()), delta.stride(0),
                                 reinterpret_cast<const uint16_t*>(wc.data_ptr()),
                                 reinterpret_cast<uint16_t*>(out.data_ptr()), d, T, d, static_cast<float>(eps));
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "pagewire::add_rms_norm", [&] {
    norm_rows<scalar_t>(residual.data_ptr<scalar_t>(), residual.stride(0), delta.data_ptr<scalar_t>(),
                        delta.stride(0), wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), d, T, d,
                        static_cast<float>(eps));
  });
  return out;
}

void rotary_embedding_cpu(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                          const c10::optional<at::Tensor>& norm_weight, double eps) {
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 3, "x must be [T, heads, head_dim], got shape ", x.sizes());
  TORCH_CHECK(x.stride(2) == 1, "x must be contiguous in head_dim");
  const int64_t T = x.size(0), n = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0, "x head_dim must be even, got ", d);
  TORCH_CHECK(positions.device().is_cpu() && positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == T,
              "positions must be a CPU int64 tensor of shape [", T, "], got ", positions.scalar_type(), " ",
              positions.sizes());
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{cos, "cos"},
                                std::pair<const at::Tensor&, const char*>{sin, "sin"}}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(1) == half &&
                    t.is_contiguous(),
                name, " must be a contiguous CPU float32 table [max_positions, ", half, "], got ", t.scalar_type(),
                " ", t.sizes());
  }
  TORCH_CHECK(sin.size(0) == cos.size(0), "sin and cos must have the same number of positions");
  const bool has_norm = norm_weight.has_value() && norm_weight->defined();
  at::Tensor wc;
  if (has_norm) {
    TORCH_CHECK(norm_weight->device().is_cpu(), "norm_weight must be a CPU tensor");
    TORCH_CHECK(norm_weight->dim() == 2 && norm_weight->size(0) == n && norm_weight->size(1) == d,
                "norm_weight must be [heads, head_dim] = [", n, ", ", d, "], got shape ", norm_weight->sizes());
    TORCH_CHECK(norm_weight->scalar_type() == x.scalar_type(), "norm_weight dtype ", norm_weight->scalar_type(),
                " must equal x dtype ", x.scalar_type());
    wc = norm_weight->contiguous();
  }
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "positions[", t, "] = ", pp[t], " is outside [0, ", max_pos, ")");
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  if (cpu::active_isa() != cpu::Isa::kPortable && x.scalar_type() == at::kBFloat16) {
    cpu::rope_rows_bf16_avx2(reinterpret_cast<uint16_t*>(x.data_ptr()), x.stride(0), x.stride(1), T, n, d, pp, cp, sp,
                             has_norm ? reinterpret_cast<const uint16_t*>(wc.data_ptr()) : nullptr, feps);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "pagewire::rotary_embedding", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), T, n, d, pp, cp, sp,
                        has_norm ? wc.data_ptr<scalar_t>() : nullptr, feps);
  });
}

namespace {

using GatedBf16Body = void (*)(const uint16_t*, int64_t, uint16_t*, int64_t, int64_t);
using GatedF32Body = void (*)(const float*, int64_t, float*, int64_t, int64_t);

// Runs a gated op's vector body for x's dtype on the active family (AVX-512 from Isa::kAvx512,
// AVX2 from Isa::kAvx2; the same bits either way) and says whether there was one: bf16 and fp32
// have them, fp16 and the portable family take gated_rows.
bool vector_gated(const at::Tensor& x, const at::Tensor& out, GatedBf16Body bf16_avx2, GatedBf16Body bf16_avx512,
                  GatedF32Body f32_avx2, GatedF32Body f32_avx512) {
  const cpu::Isa isa = cpu::active_isa();
  if (isa == cpu::Isa::kPortable) return false;
  const bool wide = isa >= cpu::Isa::kAvx512;
  const int64_t T = x.size(0), I = out.size(1);
  if (x.scalar_type() == at::kBFloat16) {
    (wide ? bf16_avx512 : bf16_avx2)(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                                     reinterpret_cast<uint16_t*>(out.data_ptr()), T, I);
    return true;
  }
  if (x.scalar_type() == at::kFloat) {
    (wide ? f32_avx512 : f32_avx2)(x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(), T, I);
    return true;
  }
  return false;
}

}  // namespace

at::Tensor silu_and_mul_cpu(const at::Tensor& x) {
  at::Tensor out = check_gated_input(x);
  if (vector_gated(x, out, cpu::silu_and_mul_bf16_avx2, cpu::silu_and_mul_bf16_avx512, cpu::silu_and_mul_f32_avx2,
                   cpu::silu_and_mul_f32_avx512)) {
    return out;
  }
  const int64_t T = x.size(0), I = out.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "pagewire::silu_and_mul", [&] {
    gated_rows<Silu, scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), out.data_ptr<scalar_t>(), T, I);
  });
  return out;
}

at::Tensor gelu_tanh_and_mul_cpu(const at::Tensor& x) {
  at::Tensor out = check_gated_input(x);
  if (vector_gated(x, out, cpu::gelu_tanh_and_mul_bf16_avx2, cpu::gelu_tanh_and_mul_bf16_avx512,
                   cpu::gelu_tanh_and_mul_f32_avx2, cpu::gelu_tanh_and_mul_f32_avx512)) {
    return out;
  }
  const int64_t T = x.size(0), I = out.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "pagewire::gelu_tanh_and_mul", [&] {
    gated_rows<GeluTanh, scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), out.data_ptr<scalar_t>(), T, I);
  });
  return out;
}

}  // namespace pagewire
