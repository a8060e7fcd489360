// The Q8_0 quantised-weight CPU ops (layout in quant_kernel.h, GGUF's Q8_0 byte for byte):
// quantize_q8_0 (weights at load, GGUF's rounding), dequantize_q8_0 (tests, fallbacks), and
// linear_q8_0: x @ dequant(w)^T (+ bias) with x quantised per row on the fly, through the best
// kernel this CPU has: AMX tiles from 4 rows, AVX-512 VNNI, AVX2, or the portable one. Large batches (prefill) dequantise
// the weight and run ATen's GEMM, which is compute-bound there rather than bandwidth-bound.
// interleave_q8_0 rearranges a weight into the x8 layout (quant_kernel.h), which dequantize_q8_0 and
// linear_q8_0 take with interleaved=True: linear_q8_0 then runs the x8 kernel (x8_body.h: linear_x8_avx2.cpp, or linear_x8_vnni.cpp on AVX-512 VNNI CPUs).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../ops.h"
#include "cpu_features.h"
#include "dispatch_mode.h"
#include "maybe_parallel.h"
#include "chunked_gemm.h"
#include "float_rows.h"
#include "quant_kernel.h"

namespace pagewire {
namespace cpu {

void bf16_to_f32(const uint16_t* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(out + i, &bits, 4);
  }
}

void f32_to_bf16(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c10::BFloat16(x[i]).x;  // c10's round to nearest even
}

void quantize_rows_q8(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t nb = K / kQ8Block;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + m * ldx + b * kQ8Block;
      float amax = 0.f;
      for (int j = 0; j < kQ8Block; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float scale = amax / 127.f;
      const float inv = scale != 0.f ? 1.f / scale : 0.f;
      int8_t* qo = q + m * K + b * kQ8Block;
      int32_t sum = 0;
      for (int j = 0; j < kQ8Block; ++j) {
        qo[j] = static_cast<int8_t>(std::round(v[j] * inv));
        sum += qo[j];
      }
      d[m * nb + b] = scale;
      if (s != nullptr) s[m * nb + b] = scale * static_cast<float>(sum);
    }
  }
}

void linear_q8_0_portable(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                          int64_t N) {
  const int64_t nb = x.K / kQ8Block, row_bytes = nb * kQ8BlockBytes;
#pragma omp parallel for schedule(static) if (N * x.K * x.M >= 65536)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    for (int64_t m = 0; m < x.M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        uint16_t dh;
        std::memcpy(&dh, wr + b * kQ8BlockBytes, 2);
        const int8_t* wq = reinterpret_cast<const int8_t*>(wr + b * kQ8BlockBytes + 2);
        const int8_t* xq = x.q + m * x.K + b * kQ8Block;
        int32_t dot = 0;
        for (int j = 0; j < kQ8Block; ++j) dot += static_cast<int32_t>(wq[j]) * static_cast<int32_t>(xq[j]);
        acc += static_cast<float>(dot) * (fp16_to_float(dh) * x.d[m * nb + b]);
      }
      out[m * ldo + n] = acc + (bias != nullptr ? bias[n] : 0.f);
    }
  }
}

void interleave_q8_0_group(const uint8_t* src, int64_t row_bytes, uint8_t* dst, int64_t K) {
  for (int64_t b = 0; b < K / kQ8Block; ++b) {
    uint8_t* o = dst + b * kQ8Interleave * kQ8BlockBytes;
    for (int r = 0; r < kQ8Interleave; ++r) {
      const uint8_t* blk = src + r * row_bytes + b * kQ8BlockBytes;
      std::memcpy(o + 2 * r, blk, 2);
      for (int c = 0; c < 8; ++c) std::memcpy(o + 16 + 32 * c + 4 * r, blk + 2 + 4 * c, 4);
    }
  }
}

void deinterleave_q8_0_group(const uint8_t* src, uint8_t* dst, int64_t row_bytes, int64_t K) {
  for (int64_t b = 0; b < K / kQ8Block; ++b) {
    const uint8_t* in = src + b * kQ8Interleave * kQ8BlockBytes;
    for (int r = 0; r < kQ8Interleave; ++r) {
      uint8_t* blk = dst + r * row_bytes + b * kQ8BlockBytes;
      std::memcpy(blk, in + 2 * r, 2);
      for (int c = 0; c < 8; ++c) std::memcpy(blk + 2 + 4 * c, in + 16 + 32 * c + 4 * r, 4);
    }
  }
}

}  // namespace cpu

namespace {

// A row-layout copy of an interleaved weight (contiguous [N, row bytes]).
std::vector<uint8_t> deinterleaved(const at::Tensor& wc, int64_t K) {
  const int64_t N = wc.size(0), rb = wc.size(1), G = cpu::kQ8Interleave, done = N / G * G;
  const uint8_t* w = wc.data_ptr<uint8_t>();
  std::vector<uint8_t> rows(N * rb);
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
  for (int64_t g = 0; g < N / G; ++g) cpu::deinterleave_q8_0_group(w + g * G * rb, rows.data() + g * G * rb, rb, K);
  std::memcpy(rows.data() + done * rb, w + done * rb, (N - done) * rb);
  return rows;
}

// The K that a Q8_0 weight of shape [N, row_bytes] holds, checked against x's K.
void check_q8_weight(const at::Tensor& weight, int64_t K) {
  TORCH_CHECK(weight.device().is_cpu(), "weight must be a CPU tensor, got ", weight.device());
  TORCH_CHECK(weight.scalar_type() == at::kByte, "weight must be uint8 Q8_0 blocks, got ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2, "weight must be [N, K / 32 * 34] Q8_0 bytes, got shape ", weight.sizes());
  TORCH_CHECK(K % cpu::kQ8Block == 0, "K must be a multiple of 32 for Q8_0, got ", K);
  TORCH_CHECK(weight.size(1) == K / cpu::kQ8Block * cpu::kQ8BlockBytes, "weight must be [N, ",
              K / cpu::kQ8Block * cpu::kQ8BlockBytes, "] Q8_0 bytes for K = ", K, ", got shape ", weight.sizes());
}

}  // namespace

at::Tensor quantize_q8_0_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu(), "weight must be a CPU tensor, got ", weight.device());
  TORCH_CHECK(weight.dim() == 2, "weight must be [N, K], got shape ", weight.sizes());
  TORCH_CHECK(at::isFloatingType(weight.scalar_type()), "weight must be floating point, got ", weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % cpu::kQ8Block == 0, "weight K = ", K, " must be a multiple of 32 for Q8_0");
  const at::Tensor wf = weight.to(at::kFloat).contiguous();
  const int64_t nb = K / cpu::kQ8Block;
  at::Tensor out = at::empty({N, nb * cpu::kQ8BlockBytes}, weight.options().dtype(at::kByte));
  const float* src = wf.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = src + n * K + b * cpu::kQ8Block;
      uint8_t* blk = dst + (n * nb + b) * cpu::kQ8BlockBytes;
      float amax = 0.f;
      for (int j = 0; j < cpu::kQ8Block; ++j) amax = std::max(amax, std::fabs(v[j]));
      // GGUF's quantize_row_q8_0_ref: scale from the fp32 amax, values divided by the unrounded
      // scale and rounded half away from zero, the scale stored as fp16.
      const float d = amax / 127.f;
      const float inv = d != 0.f ? 1.f / d : 0.f;
      const uint16_t dh = c10::Half(d).x;
      std::memcpy(blk, &dh, 2);
      for (int j = 0; j < cpu::kQ8Block; ++j) blk[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(v[j] * inv)));
    }
  }
  return out;
}

at::Tensor interleave_q8_0_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) % cpu::kQ8BlockBytes == 0,
              "weight must be [N, K / 32 * 34] Q8_0 bytes, got shape ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1) / cpu::kQ8BlockBytes * cpu::kQ8Block;
  check_q8_weight(weight, K);
  const at::Tensor wc = weight.contiguous();
  at::Tensor out = at::empty(wc.sizes(), wc.options());
  const int64_t rb = wc.size(1), G = cpu::kQ8Interleave, done = N / G * G;
  const uint8_t* src = wc.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
  for (int64_t g = 0; g < N / G; ++g) cpu::interleave_q8_0_group(src + g * G * rb, rb, dst + g * G * rb, K);
  std::memcpy(dst + done * rb, src + done * rb, (N - done) * rb);  // the last N % 8 rows
  return out;
}

namespace {

// Rows [n0, n0 + rows) of a Q8_0 weight (contiguous [N, row bytes]; interleaved: the x8 layout,
// n0 a multiple of 8) as fp32 [rows, K]. An interleaved group is moved back to its rows in a
// small per-group buffer first, so no row-layout copy of the whole weight is ever made.
at::Tensor dequantize_q8_rows(const at::Tensor& wc, bool interleaved, int64_t K, int64_t n0, int64_t rows) {
  const int64_t N = wc.size(0), rb = wc.size(1), G = cpu::kQ8Interleave;
  const int64_t grouped = interleaved ? N / G * G : 0;
  TORCH_CHECK(!interleaved || n0 % G == 0, "dequantize_q8_rows: n0 = ", n0, " must be a multiple of ", G);
  at::Tensor out = at::empty({rows, K}, wc.options().dtype(at::kFloat));
  const uint8_t* w = wc.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const auto row_out = [&](const uint8_t* row, float* o) { cpu::dequantize_q8_0_row(row, o, K); };
  // Work items: one interleaved group (8 rows) or one row-layout row.
  const int64_t n1 = n0 + rows, g_end = std::min(n1, grouped);
  const int64_t groups = g_end > n0 ? (g_end - n0) / G : 0, first_row = n0 + groups * G;
  // Split over the team only when large (maybe_parallel.h: a GGUF embedding row a decode step
  // builds no team of one); each thread moves groups back to rows in a buffer of its own.
  const bool parallel = rows * K >= (1 << 16);
  cpu::maybe_parallel_for(groups, parallel, [&](int64_t g) {
    thread_local std::vector<uint8_t> buf;
    if (static_cast<int64_t>(buf.size()) < G * rb) buf.resize(G * rb);
    const int64_t r0 = n0 + g * G;
    cpu::deinterleave_q8_0_group(w + r0 * rb, buf.data(), rb, K);
    for (int64_t r = 0; r < G; ++r) row_out(buf.data() + r * rb, dst + (r0 - n0 + r) * K);
  });
  cpu::maybe_parallel_for(n1 - first_row, parallel, [&](int64_t i) {
    const int64_t n = first_row + i;
    row_out(w + n * rb, dst + (n - n0) * K);
  });
  return out;
}

}  // namespace

at::Tensor dequantize_q8_0_cpu(const at::Tensor& weight, bool interleaved) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) % cpu::kQ8BlockBytes == 0,
              "weight must be [N, K / 32 * 34] Q8_0 bytes, got shape ", weight.sizes());
  const int64_t N = weight.size(0), nb = weight.size(1) / cpu::kQ8BlockBytes, K = nb * cpu::kQ8Block;
  check_q8_weight(weight, K);
  return dequantize_q8_rows(weight.contiguous(), interleaved, K, 0, N);
}

namespace {

// linear_q8_0_cpu (every_m false: above kQ8KernelMaxRows, dequantise + GEMM) and
// linear_q8_0_rows_cpu (every_m true: the kernel in blocks of kQ8KernelMaxRows rows).
at::Tensor linear_q8_0_impl(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                            bool interleaved, bool every_m) {
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got shape ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be floating point, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  check_q8_weight(weight, K);
  const bool has_bias = cpu::check_bias(bias, N, x);
  if (M > kQ8KernelMaxRows && !every_m) {
    // Prefill: the GEMM is compute-bound, where ATen's blocked kernels win; on dequantised chunks
    // of rows (chunked_gemm.h). Dequantising the whole matrix at once allocated N x K floats per call,
    // and their page faults made a 32000-row lm_head at 24 rows take 57 ms (bench.kernels linear
    // on an AMX Xeon; 12 ms chunked).
    const at::Tensor wc = weight.contiguous();
    return cpu::chunked_gemm(x, N, bias, has_bias, [&](int64_t n0, int64_t rows) {
      return dequantize_q8_rows(wc, interleaved, K, n0, rows);
    });
  }
  if (M == 0 || N == 0) return at::empty({M, N}, x.options());
  const cpu::Isa isa = cpu::active_isa();
  const bool portable = isa == cpu::Isa::kPortable;
  // bf16 rows in and out through per-thread fp32 buffers (float_rows.h), not ATen conversions.
  cpu::KernelRows io(x, bias, has_bias, N, !portable);
  const float *xf = io.xf, *b = io.b;
  const at::Tensor wc = weight.contiguous();
  // Per calling thread (the engine thread), reused across calls: no allocation per decode step.
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd;
  if (static_cast<int64_t>(xq.size()) < M * K) xq.resize(M * K);
  if (static_cast<int64_t>(xd.size()) < M * K / cpu::kQ8Block) xd.resize(M * K / cpu::kQ8Block);
  // Rows [r0, r0 + rows) of the activations (quantised) and of the output; at most
  // kQ8KernelMaxRows rows a block, each block the call a batch of just those rows would make.
  // (Plain pointers: the team's threads run the fused kernel below, and a thread_local named there
  // would be each worker's own.)
  int8_t* const qp = xq.data();
  float* const dp = xd.data();
  const auto block = [=](int64_t r0, int64_t rows) {
    return cpu::Q8Activations{qp + r0 * K, dp + r0 * (K / cpu::kQ8Block), rows, K};
  };
  const auto blocks = [&](const auto& body) {
    for (int64_t r0 = 0; r0 < M; r0 += kQ8KernelMaxRows) body(r0, std::min(kQ8KernelMaxRows, M - r0));
  };
  // AMX from kAmxMinRows rows: bit for bit the x8 kernels' floats, so batch-invariant mode's rule
  // (use_amx is off there) only keeps the choice where it always was.
  const auto x8 = [&](int64_t rows) {
    return cpu::use_amx(isa, rows)       ? cpu::linear_q8_0x8_amx
           : isa >= cpu::Isa::kAvx512 ? cpu::linear_q8_0x8_vnni
                                      : cpu::linear_q8_0x8_avx2;
  };
  const uint8_t* w = wc.data_ptr<uint8_t>();
  float* o = io.out.data();
  if (interleaved && !portable && N % cpu::kQ8Interleave == 0 && cpu::fused_linear_applies(M, N, K, io.out)) {
    // Quantise, kernel and rounding in one parallel region (float_rows.h fused_linear); each block's
    // kernel splits its loop over the team.
    return cpu::fused_linear(true, xf, M, K, xq.data(), xd.data(), nullptr, io.out, [&] {
      blocks([&](int64_t r0, int64_t rows) { x8(rows)(block(r0, rows), w, b, o + r0 * N, N, N); });
    });
  }
  cpu::quantize_activation_rows(!portable, xf, M, K, xq.data(), xd.data(), nullptr);
  // AMX from kAmxMinRows rows (as for bf16, dispatch_mode.h: not in batch-invariant mode).
  const auto kernel = [&](int64_t rows) {
    return portable                      ? cpu::linear_q8_0_portable
           : cpu::use_amx(isa, rows)  ? cpu::linear_q8_0_amx
           : isa >= cpu::Isa::kAvx512 ? cpu::linear_q8_0_avx512
                                      : cpu::linear_q8_0_avx2;
  };
  if (!interleaved) {
    blocks([&](int64_t r0, int64_t rows) { kernel(rows)(block(r0, rows), w, b, o + r0 * N, N, N); });
  } else if (!portable) {
    // Whole groups through the family's x8 kernel (VNNI from AVX-512 up), the last N % 8 rows, in
    // row layout, through the family's row kernel.
    const int64_t done = N / cpu::kQ8Interleave * cpu::kQ8Interleave, rb = wc.size(1);
    blocks([&](int64_t r0, int64_t rows) {
      const cpu::Q8Activations a = block(r0, rows);
      x8(rows)(a, w, b, o + r0 * N, N, done);
      if (done < N) kernel(rows)(a, w + done * rb, b != nullptr ? b + done : nullptr, o + r0 * N + done, N, N - done);
    });
  } else {
    // No AVX2 (or PAGEWIRE_CPU_ISA=portable after the weight was interleaved): the portable kernel
    // on a row-layout copy. Slow, but only reached when the family is forced below the one the
    // weight was prepared for.
    const std::vector<uint8_t> rows = deinterleaved(wc, K);
    blocks([&](int64_t r0, int64_t n) { kernel(n)(block(r0, n), rows.data(), b, o + r0 * N, N, N); });
  }
  return io.out.finish();
}

}  // namespace

at::Tensor linear_q8_0_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           bool interleaved) {
  return linear_q8_0_impl(x, weight, bias, interleaved, false);
}

at::Tensor linear_q8_0_rows_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                bool interleaved) {
  return linear_q8_0_impl(x, weight, bias, interleaved, true);
}

}  // namespace pagewire
