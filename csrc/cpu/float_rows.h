// Activations in and results out of the integer (quantised-weight) linear kernels without ATen's
// conversion ops. The kernels read fp32 rows and write fp32 rows; the model runs in bf16. Going
// through `x.to(kFloat)` and `out.to(kBFloat16)` costs two TensorIterator launches and two
// allocations per call, about 3 us: at decode, with four to six such calls in each of 30 layers
// of a small model (SmolLM2-135M), that was 0.4 ms of a 5.5 ms token. Here the bf16 rows are
// widened into a per-thread buffer and the fp32 results rounded into the output tensor with the
// AVX2 converters (quant_kernel.h), which round to nearest even as ATen does, so the bits are
// the same. Other dtypes (fp16) keep the ATen conversion.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <omp.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "quant_kernel.h"
#include "team_kernel.h"

namespace pagewire::cpu {

// x [M, K] (any floating dtype) as contiguous fp32 rows: x's own memory when it is fp32 and
// contiguous, else `buf` (bf16, widened) or `keep` (another dtype, ATen's conversion).
inline const float* float_rows(const at::Tensor& x, std::vector<float>& buf, at::Tensor& keep, bool avx2) {
  if (x.scalar_type() == at::kFloat && x.is_contiguous()) return x.data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16) {
    const at::Tensor xc = x.contiguous();
    const int64_t n = xc.numel();
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
    (avx2 ? bf16_to_f32_avx2 : bf16_to_f32)(reinterpret_cast<const uint16_t*>(xc.data_ptr()), buf.data(), n);
    return buf.data();
  }
  keep = x.to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// Where a kernel writes its fp32 [M, N] result for an output of dtype `dtype`: the output tensor
// itself when fp32, else a per-thread buffer that finish() rounds into the output.
class FloatOut {
 public:
  // Elements from which finish() rounds in parallel (several rows only: one row's columns are too
  // few to pay for waking the team).
  static constexpr int64_t kParallelConvert = 1 << 12;
  FloatOut(int64_t M, int64_t N, const at::TensorOptions& opts, bool avx2)
      : dtype_(opts.dtype().toScalarType()),
        out_(at::empty({M, N}, dtype_ == at::kBFloat16 ? opts : opts.dtype(at::kFloat))),
        avx2_(avx2) {
    if (dtype_ != at::kBFloat16) return;
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < M * N) scratch.resize(M * N);
    buf_ = scratch.data();
  }
  float* data() { return buf_ != nullptr ? buf_ : out_.data_ptr<float>(); }
  // The output in `dtype`; call once, after the kernel has written data().
  at::Tensor finish() {
    if (buf_ != nullptr) {
      const int64_t M = out_.size(0), N = out_.size(1);
      if (M < 2 || M * N < kParallelConvert) {
        (avx2_ ? f32_to_bf16_avx2 : f32_to_bf16)(buf_, reinterpret_cast<uint16_t*>(out_.data_ptr()), M * N);
        return out_;
      }
#pragma omp parallel
      round_slice();
      return out_;
    }
    return dtype_ == at::kFloat ? out_ : out_.to(dtype_);
  }
  // Inside a parallel region, each thread of the team: round this thread's slice of the columns of
  // every row. The kernels split N the same way (contiguous slices in thread order), so it mostly
  // reads the floats its own core just wrote, rather than one thread reading half of them from the
  // other core's cache. Nothing to do for an fp32 output.
  void round_slice() {
    if (buf_ == nullptr) return;
    const auto convert = avx2_ ? f32_to_bf16_avx2 : f32_to_bf16;
    uint16_t* o = reinterpret_cast<uint16_t*>(out_.data_ptr());
    const int64_t M = out_.size(0), N = out_.size(1);
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t c0 = N * t / nt, c1 = N * (t + 1) / nt;
    for (int64_t m = 0; m < M; ++m) convert(buf_ + m * N + c0, o + m * N + c0, c1 - c0);
  }
  // Whether round_slice() (with the kernel's own fp32 output: bf16 or fp32) gives the output.
  bool rounds_in_team() const { return dtype_ == at::kBFloat16 || dtype_ == at::kFloat; }
  // The output after every thread's round_slice().
  const at::Tensor& tensor() const { return out_; }

 private:
  at::ScalarType dtype_;
  at::Tensor out_;
  float* buf_ = nullptr;
  bool avx2_;
};

// quantize_rows_q8(_avx2) on M rows of K values (x contiguous, row stride K; s may be null), the
// rows split over the team from 4096 values on: each row is one thread's whole, so the bytes and
// scales are the same either way. (One engine thread quantising eight rows per linear call while
// the other core waited was about 4 % of a SmolLM2 batch-8 step; RESULTS, session 22.)
// Inside a parallel region, each thread of the team: quantize_rows_q8(_avx2) on its share of the
// M rows (each row one thread's whole, so the bytes and scales are the same however many threads).
inline void quantize_rows_slice(bool avx2, const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  const auto quantize = avx2 ? quantize_rows_q8_avx2 : quantize_rows_q8;
  const int64_t nb = K / kQ8Block;
  const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
  const int64_t m0 = M * t / nt, m1 = M * (t + 1) / nt;
  if (m1 > m0) quantize(x + m0 * K, K, m1 - m0, K, q + m0 * K, d + m0 * nb, s != nullptr ? s + m0 * nb : nullptr);
}

inline void quantize_activation_rows(bool avx2, const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  if (M < 2 || M * K < (1 << 12)) {
    (avx2 ? quantize_rows_q8_avx2 : quantize_rows_q8)(x, K, M, K, q, d, s);
    return;
  }
#pragma omp parallel
  quantize_rows_slice(avx2, x, M, K, q, d, s);
}

// An integer linear of several rows in one parallel region: each thread quantises its share of the
// activation rows, then (after a barrier) runs its share of the kernel, then (after another)
// rounds its slice of the output -- where quantize_activation_rows, the kernel and
// FloatOut::finish each opened a region of their own. A region costs a wake-up of the team and
// leaves the other core idle through the engine thread's code between regions; barriers inside
// one cost far less (a SmolLM2 batch-8 step opened about 500 regions; RESULTS, session 23). The
// same functions on the same rows and columns: the same bytes and floats as the three regions.
// `kernel` must split its work over the team under the TeamKernelScope (the x8 kernels do: team_for
// in team_kernel.h, for_x8_units in linear_x8_amx.cpp); it is checked. Use when fused_linear_applies().
template <class Kernel>
at::Tensor fused_linear(bool avx2, const float* xf, int64_t M, int64_t K, int8_t* q, float* d, float* s,
                        FloatOut& out, const Kernel& kernel) {
  std::atomic<bool> unsplit{false};
#pragma omp parallel
  {
    quantize_rows_slice(avx2, xf, M, K, q, d, s);
#pragma omp barrier
    {
      const TeamKernelScope team;
      kernel();
      if (!team.asked()) unsplit.store(true, std::memory_order_relaxed);
    }
#pragma omp barrier
    out.round_slice();
  }
  // Checked after the region (an exception must not leave one): every kernel here must split.
  TORCH_CHECK(!unsplit.load(), "internal error: a kernel run by fused_linear did not split its work over the team");
  return out.tensor();
}

// Whether fused_linear pays: several rows, a team to split over, as much work as the x8 kernels'
// own threshold for waking the team (team_kernel.h team_for's callers), and rows enough that quantising
// them would open a region too. Below that the unfused path opens one or two regions, and the
// fused one was no faster (SmolLM2 Q4_1 at 4 rows: 5.95 against 5.87 ms, within the noise; at 8
// rows 8.71 against 8.94; RESULTS, session 24).
inline bool fused_linear_applies(int64_t M, int64_t N, int64_t K, const FloatOut& out) {
  return M >= 2 && M * K >= (1 << 12) && N * K * M >= 65536 && out.rounds_in_team() && !omp_in_parallel() &&
         omp_get_max_threads() > 1;
}

// Checks an optional bias of a linear op with x [M, K] and N outputs: on CPU, [N], x's dtype.
// Returns whether there is one.
inline bool check_bias(const c10::optional<at::Tensor>& bias, int64_t N, const at::Tensor& x) {
  if (!bias.has_value() || !bias->defined()) return false;
  TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N, "bias must be a CPU [N] tensor, N = ",
              N, ", got shape ", bias->sizes());
  TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "bias dtype ", bias->scalar_type(), " must equal x dtype ",
              x.scalar_type());
  return true;
}

// What an integer linear op hands its kernel: x's rows and the bias as fp32 (float_rows) and the
// fp32 output (FloatOut, finish() gives it in x's dtype), each through its own per-thread buffer.
struct KernelRows {
  KernelRows(const at::Tensor& x, const c10::optional<at::Tensor>& bias, bool has_bias, int64_t N, bool avx2)
      : out(x.size(0), N, x.options(), avx2) {
    thread_local std::vector<float> xbuf, bbuf;
    xf = float_rows(x, xbuf, xkeep_, avx2);
    b = has_bias ? float_rows(*bias, bbuf, bkeep_, avx2) : nullptr;
  }
  const float* xf = nullptr;
  const float* b = nullptr;
  FloatOut out;

 private:
  at::Tensor xkeep_, bkeep_;
};

}  // namespace pagewire::cpu
