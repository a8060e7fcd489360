// CUDA kernel of rejection_sample: exact verification of drafted tokens (Leviathan et al. 2023 /
// Chen et al. 2023), the same contract as the CPU kernel in csrc/cpu/spec_decode.cpp (see ops.h).
//
// One CUDA block per sequence. Thread 0 walks the drafts (k is small, and each acceptance depends
// on the previous one); the residual or bonus draw over the vocabulary is cooperative: each thread
// sums its contiguous chunk of max(p - q, 0) in float64, thread 0 scans the chunk sums to find the
// chunk holding the threshold u * total, and then walks only that chunk. Chunk sums change the
// float64 summation order against the CPU kernel, so a draw can differ from it only when u * total
// falls within rounding of a bucket edge.
//
// cu_num_draft is read on the host (S + 1 int64) to size the output: one small device-to-host copy.
// Argument checks are shared with the CPU kernel (csrc/spec_decode_checks.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <tuple>

#include "../spec_decode_checks.h"
#include "ops_cuda.h"

namespace pagewire {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ double residual_weight(const float* p, const float* q, int64_t q_token, int64_t x) {
  double w = static_cast<double>(p[x]);
  if (q != nullptr) w -= static_cast<double>(q[x]);
  else if (x == q_token) w -= 1.0;
  return w > 0.0 ? w : 0.0;
}

// Block-cooperative inverse-CDF draw from max(p - q, 0); every thread calls it; returns -1 (to
// every thread) when all weights are 0.
__device__ int64_t block_sample_residual(const float* p, const float* q, int64_t q_token, int64_t vocab, double u,
                                         double* sums, int64_t* result) {
  const int64_t chunk = (vocab + kThreads - 1) / kThreads;
  const int64_t lo = threadIdx.x * chunk, hi = min(vocab, lo + chunk);
  double s = 0.0;
  for (int64_t x = lo; x < hi; ++x) s += residual_weight(p, q, q_token, x);
  sums[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int t = 0; t < kThreads; ++t) total += sums[t];
    int64_t pick = -1;
    if (total > 0.0) {
      const double threshold = u * total;
      double cum = 0.0;
      int64_t last = -1;
      for (int t = 0; t < kThreads && pick < 0; ++t) {
        if (sums[t] <= 0.0) continue;
        const int64_t clo = t * chunk, chi = min(vocab, clo + chunk);
        if (cum + sums[t] <= threshold) {  // the whole chunk lies below the threshold
          cum += sums[t];
          for (int64_t x = chi - 1; x >= clo; --x)
            if (residual_weight(p, q, q_token, x) > 0.0) { last = x; break; }
          continue;
        }
        for (int64_t x = clo; x < chi; ++x) {
          const double w = residual_weight(p, q, q_token, x);
          if (w <= 0.0) continue;
          cum += w;
          last = x;
          if (cum > threshold) { pick = x; break; }
        }
      }
      if (pick < 0) pick = last;
    }
    *result = pick;
  }
  __syncthreads();
  const int64_t r = *result;
  __syncthreads();  // sums/result are reused by the next call
  return r;
}

__global__ void rejection_sample_kernel(const int64_t* __restrict__ drafts, const int64_t* __restrict__ cu,
                                        const float* __restrict__ draft_probs, const float* __restrict__ target_probs,
                                        const int64_t* __restrict__ target_argmax, const bool* __restrict__ greedy,
                                        const double* __restrict__ uniform, int64_t vocab, int64_t width,
                                        int64_t* __restrict__ out, int64_t* __restrict__ num_emitted) {
  __shared__ double sums[kThreads];
  __shared__ int64_t result;
  __shared__ int64_t reject_at;  // first rejected draft index, or k when all were accepted
  const int64_t i = blockIdx.x;
  const int64_t k = cu[i + 1] - cu[i];
  const int64_t row0 = cu[i] + i;
  int64_t* oi = out + i * width;
  if (greedy[i]) {
    if (threadIdx.x == 0) {
      int64_t n = 0;
      bool rejected = false;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t t = target_argmax[row0 + j];
        oi[n++] = t;
        if (drafts[cu[i] + j] != t) { rejected = true; break; }
      }
      if (!rejected) oi[n++] = target_argmax[row0 + k];
      num_emitted[i] = n;
    }
    return;
  }
  if (target_probs == nullptr) {  // a sampled row without target_probs: emit nothing (see below)
    if (threadIdx.x == 0) num_emitted[i] = 0;
    return;
  }
  if (threadIdx.x == 0) {
    int64_t j = 0;
    for (; j < k; ++j) {
      const int64_t d = drafts[cu[i] + j];
      const double pd = target_probs[(row0 + j) * vocab + d];
      const double qd = draft_probs != nullptr ? static_cast<double>(draft_probs[(cu[i] + j) * vocab + d]) : 1.0;
      if (!(uniform[row0 + j] * qd < pd)) break;
      oi[j] = d;
    }
    reject_at = j;
  }
  __syncthreads();
  const int64_t j = reject_at;
  const double u = uniform[row0 + k];
  int64_t t;
  if (j < k) {
    const float* p = target_probs + (row0 + j) * vocab;
    const float* q = draft_probs != nullptr ? draft_probs + (cu[i] + j) * vocab : nullptr;
    t = block_sample_residual(p, q, q != nullptr ? -1 : drafts[cu[i] + j], vocab, u, sums, &result);
    if (t < 0) t = block_sample_residual(p, nullptr, -1, vocab, u, sums, &result);
  } else {
    t = block_sample_residual(target_probs + (row0 + k) * vocab, nullptr, -1, vocab, u, sums, &result);
  }
  if (threadIdx.x == 0) {
    oi[j] = t;
    num_emitted[i] = j + 1;
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rejection_sample_cuda(const at::Tensor& draft_token_ids,
                                                         const at::Tensor& cu_num_draft,
                                                         const c10::optional<at::Tensor>& draft_probs,
                                                         const c10::optional<at::Tensor>& target_probs,
                                                         const at::Tensor& target_argmax, const at::Tensor& is_greedy,
                                                         const at::Tensor& uniform) {
  const at::Device device = target_argmax.device();
  at::Tensor cu_host;  // the output's width (the largest k_i) is read off cu_num_draft on the host
  const RejectionSampleDims dims = check_rejection_sample_args(draft_token_ids, cu_num_draft, cu_host, draft_probs,
                                                               target_probs, target_argmax, is_greedy, uniform, device);
  const int64_t S = dims.num_seqs, max_k = dims.max_k, vocab = dims.vocab;
  // Checking that every row is greedy when target_probs is None would read is_greedy back to the
  // host; the kernel makes such a sampled row emit 0 tokens, which server.kernels.ops refuses.
  at::Tensor tp_c, dp_c;
  const float* tp = nullptr;
  const float* dp = nullptr;
  if (target_probs.has_value()) {
    tp_c = target_probs->contiguous();
    tp = tp_c.data_ptr<float>();
  }
  if (draft_probs.has_value()) {
    dp_c = draft_probs->contiguous();
    dp = dp_c.data_ptr<float>();
  }
  at::Tensor out = at::full({S, max_k + 1}, -1, draft_token_ids.options());
  at::Tensor num_emitted = at::empty({S}, draft_token_ids.options());
  if (S == 0) return {out, num_emitted};
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor drafts = draft_token_ids.contiguous(), cu = cu_num_draft.contiguous();
  const at::Tensor amax = target_argmax.contiguous(), greedy = is_greedy.contiguous(), uni = uniform.contiguous();
  // Without target_probs every row must be greedy (checking is_greedy here would cost a
  // device-to-host copy); a sampled row then emits 0 tokens, which server.kernels.ops refuses.
  rejection_sample_kernel<<<static_cast<unsigned>(S), kThreads, 0, stream>>>(
      drafts.data_ptr<int64_t>(), cu.data_ptr<int64_t>(), dp, tp, amax.data_ptr<int64_t>(), greedy.data_ptr<bool>(),
      uni.data_ptr<double>(), vocab, max_k + 1, out.data_ptr<int64_t>(), num_emitted.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, num_emitted};
}

}  // namespace pagewire
