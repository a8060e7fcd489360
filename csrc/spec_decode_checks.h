// Argument checks of the speculative-decoding ops, shared by their CPU (csrc/cpu/spec_decode.cpp) and
// CUDA (csrc/cuda/spec_decode.cu) implementations so both reject the same calls with the same
// messages. Header-only and host-only: everything here reads tensor metadata, plus cu_num_draft's
// S + 1 values (copied to the host on a GPU: the output's width depends on them anyway). Checks that need other tensors' data (draft ids in range, "a sampled
// row needs target_probs") stay with the CPU kernel, which reads that data on the host anyway.
#pragma once

#include <algorithm>
#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

namespace pagewire {

// The shapes rejection_sample works with, read off validated arguments.
struct RejectionSampleDims {
  int64_t num_seqs;     // S
  int64_t num_drafts;   // ND = cu_num_draft[S]
  int64_t target_rows;  // ND + S
  int64_t max_k;        // the largest k_i: the output is [S, max_k + 1]
  int64_t vocab;        // V of target_probs, 0 when it is None
};

namespace detail {

inline void check_spec_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Device& device) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", t.sizes());
}

}  // namespace detail

// ngram_propose (CPU only: the proposer reads host token lists). Checks the scalars and num_tokens;
// each token_ids entry is checked by check_ngram_tokens as the kernel collects its pointer.
inline void check_ngram_propose_args(int64_t num_lists, const at::Tensor& num_tokens, int64_t k, int64_t min_n,
                                     int64_t max_n) {
  TORCH_CHECK(k >= 0, "k must be >= 0, got ", k);
  TORCH_CHECK(min_n >= 1 && max_n >= min_n, "need 1 <= min_n <= max_n, got min_n=", min_n, ", max_n=", max_n);
  TORCH_CHECK(num_tokens.device().is_cpu() && num_tokens.scalar_type() == at::kLong && num_tokens.dim() == 1 &&
                  num_tokens.size(0) == num_lists,
              "num_tokens must be a CPU int64 tensor [S] with S=", num_lists, " (one per token_ids entry), got ",
              num_tokens.scalar_type(), " ", num_tokens.sizes());
}

inline void check_ngram_tokens(const at::Tensor& t, int64_t i, int64_t used) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(),
              "token_ids[", i, "] must be a contiguous CPU int64 vector, got ", t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(used >= 0 && used <= t.size(0), "num_tokens[", i, "] = ", used, " is out of range [0, ", t.size(0),
              "] (token_ids[", i, "]'s length)");
}

// rejection_sample. `device` is the device every tensor must be on (the dispatch key decided it).
// Sets `cu_host` to a contiguous host copy of cu_num_draft (the tensor itself on the CPU; one small
// device-to-host copy on a GPU), whose values it checks. Throws c10::Error (RuntimeError in Python)
// naming the offending argument.
inline RejectionSampleDims check_rejection_sample_args(const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft,
                                                       at::Tensor& cu_host, const c10::optional<at::Tensor>& draft_probs,
                                                       const c10::optional<at::Tensor>& target_probs,
                                                       const at::Tensor& target_argmax, const at::Tensor& is_greedy,
                                                       const at::Tensor& uniform, const at::Device& device) {
  detail::check_spec_vector(draft_token_ids, "draft_token_ids", at::kLong, device);
  detail::check_spec_vector(cu_num_draft, "cu_num_draft", at::kLong, device);
  detail::check_spec_vector(target_argmax, "target_argmax", at::kLong, device);
  detail::check_spec_vector(is_greedy, "is_greedy", at::kBool, device);
  detail::check_spec_vector(uniform, "uniform", at::kDouble, device);
  RejectionSampleDims d{};
  d.num_seqs = cu_num_draft.size(0) - 1;
  const int64_t S = d.num_seqs;
  TORCH_CHECK(S >= 0, "cu_num_draft must be [S + 1], got shape ", cu_num_draft.sizes());
  d.num_drafts = draft_token_ids.size(0);
  d.target_rows = d.num_drafts + S;  // k_i + 1 target rows per sequence
  TORCH_CHECK(is_greedy.size(0) == S, "is_greedy must be [S] with S=", S, ", got ", is_greedy.sizes());
  TORCH_CHECK(target_argmax.size(0) == d.target_rows, "target_argmax must be [num_drafts + S] = [", d.target_rows,
              "], got ", target_argmax.sizes());
  TORCH_CHECK(uniform.size(0) == d.target_rows, "uniform must be [num_drafts + S] = [", d.target_rows, "], got ",
              uniform.sizes());
  cu_host = cu_num_draft.to(at::kCPU).contiguous();
  const int64_t* cu = cu_host.data_ptr<int64_t>();
  TORCH_CHECK(S == 0 || cu[0] == 0, "cu_num_draft[0] must be 0, got ", S == 0 ? 0 : cu[0]);
  d.max_k = 0;
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(cu[i + 1] >= cu[i], "cu_num_draft must be non-decreasing, got ", cu[i], " then ", cu[i + 1]);
    d.max_k = std::max(d.max_k, cu[i + 1] - cu[i]);
  }
  TORCH_CHECK(S == 0 || cu[S] == d.num_drafts, "cu_num_draft[S] = ", S == 0 ? 0 : cu[S],
              " must equal len(draft_token_ids) = ", d.num_drafts);
  d.vocab = 0;
  if (target_probs.has_value()) {
    const at::Tensor& t = *target_probs;
    TORCH_CHECK(t.device() == device && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == d.target_rows,
                "target_probs must be a float32 tensor [num_drafts + S, V] = [", d.target_rows, ", V] on ", device,
                ", got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
    d.vocab = t.size(1);
  }
  if (draft_probs.has_value()) {
    const at::Tensor& q = *draft_probs;
    TORCH_CHECK(target_probs.has_value(), "draft_probs needs target_probs");
    TORCH_CHECK(q.device() == device && q.scalar_type() == at::kFloat && q.dim() == 2 && q.size(0) == d.num_drafts &&
                    q.size(1) == d.vocab,
                "draft_probs must be a float32 tensor [num_drafts, V] = [", d.num_drafts, ", ", d.vocab, "] on ",
                device, ", got ", q.scalar_type(), " ", q.sizes(), " on ", q.device());
  }
  return d;
}

}  // namespace pagewire
