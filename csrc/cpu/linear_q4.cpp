// The 4-bit quantised-weight CPU ops (GGUF's Q4_0, Q4_1 and Q4_K layouts, see quant4_kernel.h):
// quantize_q4_0 (float weights at load, GGUF's rounding), dequantize_q4 (tests, prefill), and
// linear_q4: x @ dequant(w)^T (+ bias) with x quantised per row to Q8 blocks on the fly, through
// the AVX-512 VNNI kernel (linear_q4_avx512.cpp) when the CPU has it, the AVX2 one
// (linear_q4_avx2.cpp) when it has that, and the portable one otherwise. Batches above
// kQ4KernelMaxRows (prefill) dequantise the weight a chunk of rows at a time and run ATen's GEMM
// on each chunk: compute-bound there, and the chunk keeps the dequantised copy small.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../ops.h"
#include "cpu_features.h"
#include "quant4_kernel.h"
#include "quant_kernel.h"

namespace pagewire {
namespace cpu {

namespace {

inline float load_fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_float(h);
}

// Sub-block sb (32 values) of a row: the unsigned 4-bit codes q[32] and (a, c) with value = a*q + c.
inline void decode_sub(Q4Type t, const uint8_t* row, int64_t sb, uint8_t* q, float* a, float* c) {
  if (t == Q4Type::kQ4_K) {
    const uint8_t* blk = row + (sb / 8) * kQ4_KBlockBytes;
    const int s = static_cast<int>(sb % 8);
    uint8_t sc, mn;
    q4_k_scale_min(s, blk + 4, &sc, &mn);
    *a = load_fp16(blk) * sc;
    *c = -(load_fp16(blk + 2) * mn);
    const uint8_t* qs = blk + 16 + (s / 2) * 32;
    const int shift = (s % 2) * 4;
    for (int j = 0; j < 32; ++j) q[j] = (qs[j] >> shift) & 0xF;
    return;
  }
  const uint8_t* blk = row + sb * q4_block_bytes(t);
  const float d = load_fp16(blk);
  *a = d;
  *c = t == Q4Type::kQ4_0 ? -8.f * d : load_fp16(blk + 2);
  const uint8_t* qs = blk + (t == Q4Type::kQ4_0 ? 2 : 4);
  for (int j = 0; j < 16; ++j) {
    q[j] = qs[j] & 0xF;
    q[j + 16] = qs[j] >> 4;
  }
}

}  // namespace

void dequantize_q4_row(Q4Type t, const uint8_t* w, float* out, int64_t K) {
  uint8_t q[32];
  float a, c;
  for (int64_t sb = 0; sb < K / 32; ++sb) {
    decode_sub(t, w, sb, q, &a, &c);
    float* o = out + sb * 32;
    if (t == Q4Type::kQ4_0) {
      for (int j = 0; j < 32; ++j) o[j] = a * static_cast<float>(static_cast<int>(q[j]) - 8);  // GGUF: d * (q - 8)
    } else {
      for (int j = 0; j < 32; ++j) o[j] = a * static_cast<float>(q[j]) + c;
    }
  }
}

void linear_q4_portable(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                        int64_t ldo, int64_t N) {
  const int64_t nb = x.K / 32, row_bytes = x.K / q4_block_values(t) * q4_block_bytes(t);
#pragma omp parallel for schedule(static) if (N * x.K * x.M >= 65536)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    std::vector<float> acc(x.M, 0.f);
    uint8_t q[32];
    float a, c;
    for (int64_t b = 0; b < nb; ++b) {
      decode_sub(t, wr, b, q, &a, &c);
      for (int64_t m = 0; m < x.M; ++m) {
        const int8_t* xq = x.q + m * x.K + b * 32;
        int32_t dot = 0;
        for (int j = 0; j < 32; ++j) dot += static_cast<int32_t>(q[j]) * static_cast<int32_t>(xq[j]);
        acc[m] += static_cast<float>(dot) * (a * x.d[m * nb + b]) + c * x.s[m * nb + b];
      }
    }
    for (int64_t m = 0; m < x.M; ++m) out[m * ldo + n] = acc[m] + (bias != nullptr ? bias[n] : 0.f);
  }
}

}  // namespace cpu

namespace {

cpu::Q4Type parse_q4_type(const std::string& qtype) {
  if (qtype == "q4_0") return cpu::Q4Type::kQ4_0;
  if (qtype == "q4_1") return cpu::Q4Type::kQ4_1;
  if (qtype == "q4_k") return cpu::Q4Type::kQ4_K;
  TORCH_CHECK(false, "qtype must be 'q4_0', 'q4_1' or 'q4_k', got '", qtype, "'");
}

// Bytes per row of K values of type t, checking that K is a whole number of blocks.
int64_t q4_row_bytes(cpu::Q4Type t, const std::string& qtype, int64_t K) {
  const int bv = cpu::q4_block_values(t);
  TORCH_CHECK(K > 0 && K % bv == 0, "K must be a positive multiple of ", bv, " for ", qtype, ", got ", K);
  return K / bv * cpu::q4_block_bytes(t);
}

void check_q4_weight(const at::Tensor& weight, cpu::Q4Type t, const std::string& qtype, int64_t K) {
  TORCH_CHECK(weight.device().is_cpu(), "weight must be a CPU tensor, got ", weight.device());
  TORCH_CHECK(weight.scalar_type() == at::kByte, "weight must be uint8 ", qtype, " blocks, got ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2, "weight must be [N, row bytes] ", qtype, " blocks, got shape ", weight.sizes());
  const int64_t rb = q4_row_bytes(t, qtype, K);
  TORCH_CHECK(weight.size(1) == rb, "weight must be [N, ", rb, "] ", qtype, " bytes for K = ", K, ", got shape ",
              weight.sizes());
}

// float32 [rows, K] from rows [n0, n0 + rows) of a contiguous weight.
at::Tensor dequantize_rows(const at::Tensor& wc, cpu::Q4Type t, int64_t K, int64_t n0, int64_t rows) {
  const int64_t rb = wc.size(1);
  at::Tensor out = at::empty({rows, K}, wc.options().dtype(at::kFloat));
  const uint8_t* src = wc.data_ptr<uint8_t>() + n0 * rb;
  float* dst = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (rows * K >= (1 << 16))
  for (int64_t n = 0; n < rows; ++n) cpu::dequantize_q4_row(t, src + n * rb, dst + n * K, K);
  return out;
}

}  // namespace

at::Tensor quantize_q4_0_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu(), "weight must be a CPU tensor, got ", weight.device());
  TORCH_CHECK(weight.dim() == 2, "weight must be [N, K], got shape ", weight.sizes());
  TORCH_CHECK(at::isFloatingType(weight.scalar_type()), "weight must be floating point, got ", weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 32 == 0, "weight K = ", K, " must be a multiple of 32 for q4_0");
  const at::Tensor wf = weight.to(at::kFloat).contiguous();
  const int64_t nb = K / 32;
  at::Tensor out = at::empty({N, nb * cpu::kQ4_0BlockBytes}, weight.options().dtype(at::kByte));
  const float* src = wf.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = src + n * K + b * 32;
      uint8_t* blk = dst + (n * nb + b) * cpu::kQ4_0BlockBytes;
      // GGUF's quantize_row_q4_0_ref: d from the value of largest magnitude (sign kept) so that it
      // maps to code 0 (-8), codes truncated from x / d + 8.5 and capped at 15.
      float amax = 0.f, vmax = 0.f;
      for (int j = 0; j < 32; ++j) {
        if (std::fabs(v[j]) > amax) {
          amax = std::fabs(v[j]);
          vmax = v[j];
        }
      }
      const float d = vmax / -8.f;
      const float inv = d != 0.f ? 1.f / d : 0.f;
      const uint16_t dh = c10::Half(d).x;
      std::memcpy(blk, &dh, 2);
      for (int j = 0; j < 16; ++j) {
        const int lo = std::min(15, static_cast<int>(static_cast<int8_t>(v[j] * inv + 8.5f)));
        const int hi = std::min(15, static_cast<int>(static_cast<int8_t>(v[j + 16] * inv + 8.5f)));
        blk[2 + j] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
  return out;
}

at::Tensor dequantize_q4_cpu(const at::Tensor& weight, c10::string_view qtype_view) {
  const std::string qtype(qtype_view);
  const cpu::Q4Type t = parse_q4_type(qtype);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) % cpu::q4_block_bytes(t) == 0, "weight must be [N, row bytes] ",
              qtype, " blocks, got shape ", weight.sizes());
  const int64_t K = weight.size(1) / cpu::q4_block_bytes(t) * cpu::q4_block_values(t);
  check_q4_weight(weight, t, qtype, K);
  return dequantize_rows(weight.contiguous(), t, K, 0, weight.size(0));
}

at::Tensor linear_q4_cpu(const at::Tensor& x, const at::Tensor& weight, c10::string_view qtype_view,
                         const c10::optional<at::Tensor>& bias) {
  const std::string qtype(qtype_view);
  const cpu::Q4Type t = parse_q4_type(qtype);
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got shape ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be floating point, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  check_q4_weight(weight, t, qtype, K);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N, "bias must be a CPU [N] tensor, N = ",
                N, ", got shape ", bias->sizes());
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "bias dtype ", bias->scalar_type(), " must equal x dtype ",
                x.scalar_type());
  }
  const at::Tensor wc = weight.contiguous();
  if (M > kQ4KernelMaxRows) {
    // Prefill: ATen's GEMM on dequantised chunks of rows (each chunk about 2 MB of fp32, so the
    // copy stays in cache and memory does not hold a whole dequantised matrix).
    at::Tensor out = at::empty({M, N}, x.options());
    const int64_t chunk = std::max<int64_t>(64, (int64_t{1} << 19) / K);
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
      const int64_t rows = std::min(chunk, N - n0);
      const at::Tensor w = dequantize_rows(wc, t, K, n0, rows).to(x.scalar_type());
      const c10::optional<at::Tensor> b =
          has_bias ? c10::optional<at::Tensor>(bias->narrow(0, n0, rows)) : c10::optional<at::Tensor>();
      out.narrow(1, n0, rows).copy_(at::linear(x, w, b));
    }
    return out;
  }
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out.to(x.scalar_type());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  // Per calling thread (the engine thread), reused across calls: no allocation per decode step.
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xs;
  const int64_t nb = K / 32;
  if (static_cast<int64_t>(xq.size()) < M * K) xq.resize(M * K);
  if (static_cast<int64_t>(xd.size()) < M * nb) {
    xd.resize(M * nb);
    xs.resize(M * nb);
  }
  const cpu::Isa isa = cpu::active_isa();
  const bool portable = isa == cpu::Isa::kPortable;
  (portable ? cpu::quantize_rows_q8 : cpu::quantize_rows_q8_avx2)(xf.data_ptr<float>(), K, M, K, xq.data(),
                                                                    xd.data(), xs.data());
  const cpu::Q8SumActivations act{xq.data(), xd.data(), xs.data(), M, K};
  const auto kernel = portable                      ? cpu::linear_q4_portable
                      : isa >= cpu::Isa::kAvx512 ? cpu::linear_q4_avx512
                                                 : cpu::linear_q4_avx2;
  kernel(t, act, wc.data_ptr<uint8_t>(), has_bias ? bf.data_ptr<float>() : nullptr, out.data_ptr<float>(), N, N);
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace pagewire
