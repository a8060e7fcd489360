// CUDA moe_experts: the routed experts of a mixture-of-experts layer (the CPU op's contract,
// csrc/cpu/moe.cpp, for float experts: gate_up [E, 2I, H] and down [E, H, I] in x's dtype).
//
// Three kernels on the current stream, no host synchronisation (the routing stays on the device):
//   1. per (token, slot) pair p and column i of I: h_gate, h_up = rows i and I + i of gate_up[e]
//      times x[t] (fp32 accumulation, + bias), each rounded to x's dtype as the CPU's linear output
//      is, then the activation with the CPU's roundings (silu_and_mul: fp32, one rounding;
//      swiglu_oai: transformers' torch ops in x's dtype, a rounding after each) -> act [P, I];
//   2. per pair and output column c of H: down[e] row c times act[p] (+ bias), rounded to x's dtype
//      -> ys [P, H] fp32;
//   3. per token and column: sum_j w[t, j] * ys[t * k + j] in slot order in fp32 (empty slots,
//      id < 0, skipped), one rounding to x's dtype.
// gpt-oss ("swiglu_oai") in bf16/fp16 rounds as the CPU op does there (transformers' order): each
// bias added to its rounded product, each weighted output rounded, the sum in expert order with
// a rounding per add.
// Compile-checked only (no CUDA torch here): nvcc 13.0 -arch=sm_90 -std=c++17 -c against the CPU
// torch wheel's headers (plus a stub c10/cuda/impl/cuda_cmake_macros.h, which only CUDA wheels
// ship); never run. Each dot product is one warp's: lanes stride the row, then a fixed shuffle tree, so a pair's
// result does not depend on which other pairs share the launch (batch-invariant). Experts kept in
// GGUF blocks are CPU-only (a CUDA serve quantises nothing: docs/gpu.md); they are refused here.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <string>

#include "ops_cuda.h"

namespace pagewire {
namespace {

constexpr int kWarps = 8;  // warps per CUDA block: one output column each

template <class T>
__device__ __forceinline__ float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <class T>
__device__ __forceinline__ float dot(const T* __restrict__ a, const T* __restrict__ b, int64_t n, int lane) {
  float s = 0.f;
  for (int64_t j = lane; j < n; j += 32) s += static_cast<float>(a[j]) * static_cast<float>(b[j]);
  return warp_sum(s);
}

// grid (P, ceil(I / kWarps)), block 32 * kWarps.
template <class T>
__global__ void gate_up_kernel(const T* __restrict__ x, const int64_t* __restrict__ ids, const T* __restrict__ gate_up,
                               const T* __restrict__ bias, T* __restrict__ act, int64_t k, int64_t E, int64_t H,
                               int64_t I, bool swiglu_oai, bool hf_order, float alpha, float limit) {
  const int64_t p = blockIdx.x, i = static_cast<int64_t>(blockIdx.y) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t e = ids[p];
  if (i >= I) return;
  if (e < 0 || e >= E) {  // an empty slot: step 3 skips it
    if (lane == 0) act[p * I + i] = static_cast<T>(0.f);
    return;
  }
  const T* xr = x + (p / k) * H;
  const T* w = gate_up + e * 2 * I * H;
  float g = dot(w + i * H, xr, H, lane), u = dot(w + (I + i) * H, xr, H, lane);
  if (lane != 0) return;
  if (hf_order) {
    g = round_to<T>(g);
    u = round_to<T>(u);
  }
  if (bias != nullptr) {
    g += static_cast<float>(bias[e * 2 * I + i]);
    u += static_cast<float>(bias[e * 2 * I + I + i]);
  }
  g = round_to<T>(g);
  u = round_to<T>(u);
  float a;
  if (!swiglu_oai) {
    a = g / (1.f + expf(-g)) * u;
  } else {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    const float sig = round_to<T>(1.f / (1.f + expf(-round_to<T>(g * alpha))));
    const float glu = round_to<T>(g * sig);
    a = round_to<T>(u + 1.f) * glu;
  }
  act[p * I + i] = static_cast<T>(a);
}

// grid (P, ceil(H / kWarps)), block 32 * kWarps.
template <class T>
__global__ void down_kernel(const T* __restrict__ act, const int64_t* __restrict__ ids, const T* __restrict__ down,
                            const T* __restrict__ bias, float* __restrict__ ys, int64_t E, int64_t H, int64_t I,
                            bool hf_order) {
  const int64_t p = blockIdx.x, c = static_cast<int64_t>(blockIdx.y) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t e = ids[p];
  if (c >= H || e < 0 || e >= E) return;
  float y = dot(down + (e * H + c) * I, act + p * I, I, lane);
  if (hf_order) y = round_to<T>(y);
  if (lane == 0) ys[p * H + c] = round_to<T>(y + (bias != nullptr ? static_cast<float>(bias[e * H + c]) : 0.f));
}

// grid (T, ceil(H / 256)), block 256.
template <class T>
__global__ void combine_kernel(const float* __restrict__ ys, const int64_t* __restrict__ ids,
                               const float* __restrict__ w, T* __restrict__ out, int64_t k, int64_t E, int64_t H,
                               bool hf_order) {
  const int64_t t = blockIdx.x, c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= H) return;
  float s = 0.f;
  if (hf_order) {  // experts in increasing id, each weighted output rounded, a rounding per add
    int64_t last = -1;
    for (int64_t n = 0; n < k; ++n) {
      int64_t j = -1;
      for (int64_t q = 0; q < k; ++q) {
        const int64_t e = ids[t * k + q];
        if (e > last && e < E && (j < 0 || e < ids[t * k + j])) j = q;
      }
      if (j < 0) break;
      last = ids[t * k + j];
      s = round_to<T>(s + round_to<T>(ys[(t * k + j) * H + c] * round_to<T>(w[t * k + j])));
    }
    out[t * H + c] = static_cast<T>(s);
    return;
  }
  for (int64_t j = 0; j < k; ++j) {
    const int64_t e = ids[t * k + j];
    if (e >= 0 && e < E) s += w[t * k + j] * ys[(t * k + j) * H + c];
  }
  out[t * H + c] = static_cast<T>(s);
}

}  // namespace

at::Tensor moe_experts_cuda(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                            const at::Tensor& gate_up, c10::string_view gate_up_kind, const at::Tensor& down,
                            c10::string_view down_kind, const c10::optional<at::Tensor>& gate_up_bias,
                            const c10::optional<at::Tensor>& down_bias, c10::string_view activation_view,
                            double alpha, double limit) {
  const std::string activation(activation_view);
  TORCH_CHECK(std::string(gate_up_kind) == "float" && std::string(down_kind) == "float",
              "moe_experts: CUDA takes float experts only (kind 'float'), got '", std::string(gate_up_kind), "' and '",
              std::string(down_kind), "'");
  TORCH_CHECK(activation == "silu" || activation == "swiglu_oai",
              "moe_experts: activation must be 'silu' or 'swiglu_oai', got '", activation, "'");
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, "moe_experts: x must be a CUDA [T, H] tensor, got ", x.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_ids.scalar_type() == at::kLong &&
                  topk_ids.device() == x.device(),
              "moe_experts: topk_ids must be int64 [T, k] on x's device, T = ", T, ", got ", topk_ids.sizes());
  const int64_t k = topk_ids.size(1);
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.device() == x.device(),
              "moe_experts: topk_weights must be float32 ", topk_ids.sizes(), " on x's device");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == down.size(0) && gate_up.size(1) % 2 == 0,
              "moe_experts: gate_up and down must be [E, 2I, H] and [E, H, I], got ", gate_up.sizes(), " and ",
              down.sizes());
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(2) == H && down.size(1) == H && down.size(2) == I && gate_up.scalar_type() == x.scalar_type() &&
                  down.scalar_type() == x.scalar_type() && gate_up.device() == x.device() &&
                  down.device() == x.device(),
              "moe_experts: experts must be [E, 2I, H] and [E, H, I] of x's dtype on x's device, got ", gate_up.sizes(),
              " and ", down.sizes());
  const bool has_gub = gate_up_bias.has_value() && gate_up_bias->defined();
  const bool has_db = down_bias.has_value() && down_bias->defined();
  TORCH_CHECK(!has_gub || (gate_up_bias->sizes() == at::IntArrayRef({E, 2 * I}) &&
                           gate_up_bias->scalar_type() == x.scalar_type() && gate_up_bias->device() == x.device()),
              "moe_experts: gate_up_bias must be [E, 2I] of x's dtype on x's device");
  TORCH_CHECK(!has_db || (down_bias->sizes() == at::IntArrayRef({E, H}) && down_bias->scalar_type() == x.scalar_type() &&
                          down_bias->device() == x.device()),
              "moe_experts: down_bias must be [E, H] of x's dtype on x's device");
  at::Tensor out = at::empty({T, H}, x.options());
  const int64_t P = T * k;
  if (P == 0 || H == 0) return out;
  const at::Tensor xc = x.contiguous(), ids = topk_ids.contiguous(), wts = topk_weights.contiguous();
  const at::Tensor gu = gate_up.contiguous(), dn = down.contiguous();
  const at::Tensor gub = has_gub ? gate_up_bias->contiguous() : at::Tensor();
  const at::Tensor db = has_db ? down_bias->contiguous() : at::Tensor();
  at::Tensor act = at::empty({P, I}, x.options());
  at::Tensor ys = at::empty({P, H}, x.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool oai = activation == "swiglu_oai";
  const bool hf_order = oai && x.scalar_type() != at::kFloat;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "moe_experts_cuda", [&] {
    const dim3 block(32 * kWarps);
    gate_up_kernel<scalar_t><<<dim3(P, (I + kWarps - 1) / kWarps), block, 0, stream>>>(
        xc.data_ptr<scalar_t>(), ids.data_ptr<int64_t>(), gu.data_ptr<scalar_t>(),
        has_gub ? gub.data_ptr<scalar_t>() : nullptr, act.data_ptr<scalar_t>(), k, E, H, I, oai, hf_order,
        static_cast<float>(alpha), static_cast<float>(limit));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    down_kernel<scalar_t><<<dim3(P, (H + kWarps - 1) / kWarps), block, 0, stream>>>(
        act.data_ptr<scalar_t>(), ids.data_ptr<int64_t>(), dn.data_ptr<scalar_t>(),
        has_db ? db.data_ptr<scalar_t>() : nullptr, ys.data_ptr<float>(), E, H, I, hf_order);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    combine_kernel<scalar_t><<<dim3(T, (H + 255) / 256), 256, 0, stream>>>(
        ys.data_ptr<float>(), ids.data_ptr<int64_t>(), wts.data_ptr<float>(), out.data_ptr<scalar_t>(), k, E, H,
        hf_order);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace pagewire
