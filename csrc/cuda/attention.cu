// CUDA paged attention: a deliberately simple kernel (one CUDA block per (query token, query head),
// one warp per KV position at a time with its own online softmax, warps merged at the end). It
// favours obvious correctness over speed; the CPU kernels are the tuned ones.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "../attention_checks.h"
#include "ops_cuda.h"

namespace pagewire {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxHeadDim = 256;
constexpr int kPerLane = kMaxHeadDim / 32;  // head_dim elements each lane owns (d = lane + 32 * i)

// grid (T, num_heads), block kWarps * 32 threads.
template <class T>
__global__ void paged_attention_kernel(T* __restrict__ out, const T* __restrict__ query,
                                       const T* __restrict__ key_cache, const T* __restrict__ value_cache,
                                       const int32_t* __restrict__ block_tables, const int32_t* __restrict__ seq_lens,
                                       const int32_t* __restrict__ query_start_loc, int num_seqs, int64_t out_st,
                                       int64_t out_sh, int64_t q_st, int64_t q_sh, int64_t bt_stride,
                                       int num_kv_heads, int block_size, int head_dim, int group, float scale,
                                       float softcap, int sliding_window, const float* __restrict__ sinks) {
  const int t = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // The token's sequence: the last s with query_start_loc[s] <= t.
  int lo_s = 0, hi_s = num_seqs - 1;
  while (lo_s < hi_s) {
    const int mid = (lo_s + hi_s + 1) / 2;
    if (query_start_loc[mid] <= t) lo_s = mid; else hi_s = mid - 1;
  }
  const int s = lo_s;
  const int q_len = query_start_loc[s + 1] - query_start_loc[s];
  const int pos = seq_lens[s] - q_len + (t - query_start_loc[s]);  // absolute position of this token
  const int first = sliding_window > 0 ? max(0, pos - sliding_window + 1) : 0;
  const int kvh = h / group;

  float q[kPerLane], acc[kPerLane];
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    q[i] = d < head_dim ? static_cast<float>(query[t * q_st + h * q_sh + d]) * scale : 0.f;
    acc[i] = 0.f;
  }
  float m = -FLT_MAX, l = 0.f;
  for (int p = first + warp; p <= pos; p += kWarps) {
    const int64_t phys = block_tables[s * bt_stride + p / block_size];
    const int64_t base = ((phys * num_kv_heads + kvh) * block_size + p % block_size) * head_dim;
    float dot = 0.f;
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < head_dim) dot += q[i] * static_cast<float>(key_cache[base + d]);
    }
    for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    if (softcap > 0.f) dot = softcap * tanhf(dot / softcap);  // q was scaled: the capped score
    const float m_new = fmaxf(m, dot);
    const float alpha = __expf(m - m_new), pexp = __expf(dot - m_new);
    l = l * alpha + pexp;
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      const float v = d < head_dim ? static_cast<float>(value_cache[base + d]) : 0.f;
      acc[i] = acc[i] * alpha + pexp * v;
    }
    m = m_new;
  }

  // Merge the warps' partial softmax states.
  __shared__ float sm[kWarps], sl[kWarps], sacc[kWarps][kMaxHeadDim];
  if (lane == 0) sm[warp] = m, sl[warp] = l;
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < head_dim) sacc[warp][d] = acc[i];
  }
  __syncthreads();
  float m_all = -FLT_MAX;
  for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, sm[w]);
  float l_all = 0.f, wscale[kWarps];
  if (sinks != nullptr) m_all = fmaxf(m_all, sinks[h]);  // the sink joins the softmax as one more logit
  for (int w = 0; w < kWarps; ++w) {
    wscale[w] = sl[w] > 0.f ? __expf(sm[w] - m_all) : 0.f;  // a warp that saw no position adds nothing
    l_all += sl[w] * wscale[w];
  }
  if (sinks != nullptr) l_all += __expf(sinks[h] - m_all);  // ... and adds no value
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.f;
    for (int w = 0; w < kWarps; ++w) o += sacc[w][d] * wscale[w];
    out[t * out_st + h * out_sh + d] = static_cast<T>(o / l_all);  // l_all > 0: pos sees itself
  }
}

}  // namespace

void paged_attention_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                          int64_t max_query_len, int64_t max_seq_len, double softcap,
                          const c10::optional<at::Tensor>& sinks) {
  const at::Device device = query.device();
  const PagedAttentionDims dims = check_paged_attention_args(out, query, key_cache, value_cache, block_tables,
                                                             seq_lens, query_start_loc, scale, softcap);
  const float* sink_ptr = check_sinks(sinks, dims, device) ? sinks->data_ptr<float>() : nullptr;
  const int64_t T = dims.num_tokens, num_heads = dims.num_heads, head_dim = dims.head_dim;
  const int64_t num_kv_heads = dims.num_kv_heads, S = dims.num_seqs;
  // CUDA-only limits: the kernel keeps head_dim / 32 values per lane and indexes block_tables rows
  // with a unit inner stride.
  TORCH_CHECK(head_dim <= kMaxHeadDim, "head_dim ", head_dim, " exceeds the CUDA kernel's maximum ", kMaxHeadDim);
  TORCH_CHECK(block_tables.stride(1) == 1, "block_tables must be contiguous in its last dim");
  if (T == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor lens = seq_lens.contiguous(), qsl = query_start_loc.contiguous();
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(num_heads));
  const int window = sliding_window > 0 ? static_cast<int>(std::min<int64_t>(sliding_window, 1 << 30)) : 0;
  auto launch = [&](auto tag) {
    using Elem = decltype(tag);
    paged_attention_kernel<Elem><<<grid, kWarps * 32, 0, stream>>>(
        static_cast<Elem*>(out.data_ptr()), static_cast<const Elem*>(query.data_ptr()),
        static_cast<const Elem*>(key_cache.data_ptr()), static_cast<const Elem*>(value_cache.data_ptr()),
        block_tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), qsl.data_ptr<int32_t>(), static_cast<int>(S),
        out.stride(0), out.stride(1), query.stride(0), query.stride(1), block_tables.stride(0),
        static_cast<int>(num_kv_heads), static_cast<int>(key_cache.size(2)), static_cast<int>(head_dim),
        static_cast<int>(num_heads / num_kv_heads), static_cast<float>(scale),
        static_cast<float>(softcap), window, sink_ptr);
  };
  switch (query.scalar_type()) {
    case at::kFloat:
      launch(float{});
      break;
    case at::kHalf:
      launch(c10::Half{});
      break;
    case at::kBFloat16:
      launch(c10::BFloat16{});
      break;
    default:
      TORCH_CHECK(false, "query dtype must be float32, bfloat16 or float16, got ", query.scalar_type());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace pagewire
