// CPU kernels of speculative decoding: the n-gram (prompt lookup) proposer and exact verification
// by rejection sampling. Both are host-side loops over a batch's sequences; each sequence's work is
// independent, so sequences run in parallel when the batch is large enough to pay for the team.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "../ops.h"
#include "../spec_decode_checks.h"

namespace pagewire {
namespace {

// Sequences below which one thread beats waking the OpenMP team (each sequence is microseconds).
constexpr int64_t kParallelSeqs = 16;

// The proposal of one sequence: the longest suffix n-gram (min_n <= n <= max_n) that occurred
// earlier, at its latest such occurrence, and the k tokens that followed it. The continuation is
// copied like LZ77's overlapping copy: a proposal may run into tokens it proposed itself, so a
// periodic tail ("a b a b a b") still yields k tokens.
void propose_one(const int64_t* tok, int64_t len, int64_t k, int64_t min_n, int64_t max_n, int64_t* out) {
  for (int64_t j = 0; j < k; ++j) out[j] = -1;
  if (len < min_n + 1 || k <= 0) return;
  const int64_t cap = std::min(max_n, len - 1);  // an occurrence must end before the suffix does
  int64_t best_len = 0, best_end = -1;
  // Candidate occurrence ends at e (inclusive), e <= len - 2, scanned latest first; m = how many of
  // the suffix's last tokens it matches (up to cap). The first e reaching cap is the answer.
  for (int64_t e = len - 2; e >= 0; --e) {
    int64_t m = 0;
    const int64_t lim = std::min(cap, e + 1);
    while (m < lim && tok[e - m] == tok[len - 1 - m]) ++m;
    if (m > best_len) {
      best_len = m;
      best_end = e;
      if (m == cap) break;
    }
  }
  if (best_len < min_n) return;
  // tokens after the occurrence: ext[len + j] = ext[best_end + 1 + j], ext = tokens ++ proposal.
  for (int64_t j = 0; j < k; ++j) {
    const int64_t src = best_end + 1 + j;
    out[j] = src < len ? tok[src] : out[src - len];
  }
}

// Inverse-CDF draw from the unnormalised weights w(x) = max(p(x) - q(x), 0) (q = nullptr: all
// zero; q_token >= 0: a point mass on q_token), with threshold u * sum(w), u in [0, 1). Sums in
// float64. Returns -1 when every weight is 0.
int64_t sample_residual(const float* p, const float* q, int64_t q_token, int64_t vocab, double u) {
  auto weight = [&](int64_t x) -> double {
    double w = static_cast<double>(p[x]);
    if (q != nullptr) w -= static_cast<double>(q[x]);
    else if (x == q_token) w -= 1.0;
    return w > 0.0 ? w : 0.0;
  };
  double total = 0.0;
  for (int64_t x = 0; x < vocab; ++x) total += weight(x);
  if (!(total > 0.0)) return -1;
  const double threshold = u * total;
  double cum = 0.0;
  int64_t last = -1;
  for (int64_t x = 0; x < vocab; ++x) {
    const double w = weight(x);
    if (w <= 0.0) continue;
    cum += w;
    last = x;
    if (cum > threshold) return x;
  }
  return last;  // rounding left the threshold at the very top: the last positive weight
}

}  // namespace

at::Tensor ngram_propose_cpu(at::TensorList token_ids, const at::Tensor& num_tokens, int64_t k, int64_t min_n,
                             int64_t max_n) {
  const int64_t S = static_cast<int64_t>(token_ids.size());
  check_ngram_propose_args(S, num_tokens, k, min_n, max_n);
  const at::Tensor lens_c = num_tokens.contiguous();
  const int64_t* lens = lens_c.data_ptr<int64_t>();
  std::vector<const int64_t*> ptrs(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) {
    const at::Tensor& t = token_ids[i];
    check_ngram_tokens(t, i, lens[i]);
    ptrs[static_cast<size_t>(i)] = t.data_ptr<int64_t>();
  }
  at::Tensor out = at::empty({S, k}, num_tokens.options());
  int64_t* o = out.data_ptr<int64_t>();
#pragma omp parallel for schedule(dynamic, 1) if (S >= kParallelSeqs)
  for (int64_t i = 0; i < S; ++i) propose_one(ptrs[static_cast<size_t>(i)], lens[i], k, min_n, max_n, o + i * k);
  return out;
}

std::tuple<at::Tensor, at::Tensor> rejection_sample_cpu(const at::Tensor& draft_token_ids,
                                                        const at::Tensor& cu_num_draft,
                                                        const c10::optional<at::Tensor>& draft_probs,
                                                        const c10::optional<at::Tensor>& target_probs,
                                                        const at::Tensor& target_argmax, const at::Tensor& is_greedy,
                                                        const at::Tensor& uniform) {
  at::Tensor cu_c;
  const RejectionSampleDims dims = check_rejection_sample_args(draft_token_ids, cu_num_draft, cu_c, draft_probs,
                                                               target_probs, target_argmax, is_greedy, uniform,
                                                               at::Device(at::kCPU));
  const int64_t S = dims.num_seqs, ND = dims.num_drafts, max_k = dims.max_k, vocab = dims.vocab;
  const int64_t* cu = cu_c.data_ptr<int64_t>();
  const at::Tensor greedy_c = is_greedy.contiguous();
  const bool* greedy = greedy_c.data_ptr<bool>();
  bool any_sampled = false;
  for (int64_t i = 0; i < S; ++i) any_sampled |= !greedy[i];

  TORCH_CHECK(target_probs.has_value() || !any_sampled, "target_probs is required when a row is not greedy");
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
  const at::Tensor drafts_c = draft_token_ids.contiguous();
  const int64_t* drafts = drafts_c.data_ptr<int64_t>();
  const at::Tensor argmax_c = target_argmax.contiguous();
  const int64_t* amax = argmax_c.data_ptr<int64_t>();
  const at::Tensor uni_c = uniform.contiguous();
  const double* uni = uni_c.data_ptr<double>();
  if (vocab > 0) {
    for (int64_t j = 0; j < ND; ++j)
      TORCH_CHECK(drafts[j] >= 0 && drafts[j] < vocab, "draft_token_ids[", j, "] = ", drafts[j],
                  " is out of range [0, ", vocab, ")");
  }

  at::Tensor out = at::full({S, max_k + 1}, -1, draft_token_ids.options());
  at::Tensor num_emitted = at::empty({S}, draft_token_ids.options());
  int64_t* o = out.data_ptr<int64_t>();
  int64_t* ne = num_emitted.data_ptr<int64_t>();
  const int64_t width = max_k + 1;

#pragma omp parallel for schedule(dynamic, 1) if (S >= kParallelSeqs && any_sampled)
  for (int64_t i = 0; i < S; ++i) {
    const int64_t k = cu[i + 1] - cu[i];
    const int64_t row0 = cu[i] + i;  // target rows row0 .. row0 + k; drafts cu[i] .. cu[i] + k - 1
    int64_t* oi = o + i * width;
    int64_t n = 0;
    bool rejected = false;
    if (greedy[i]) {
      // Longest prefix of drafts equal to the target's argmax, then the target's own token there.
      for (int64_t j = 0; j < k; ++j) {
        const int64_t t = amax[row0 + j];
        oi[n++] = t;
        if (drafts[cu[i] + j] != t) {
          rejected = true;
          break;
        }
      }
      if (!rejected) oi[n++] = amax[row0 + k];
      ne[i] = n;
      continue;
    }
    const double u_final = uni[row0 + k];
    for (int64_t j = 0; j < k; ++j) {
      const int64_t d = drafts[cu[i] + j];
      const float* p = tp + (row0 + j) * vocab;
      const float* q = dp != nullptr ? dp + (cu[i] + j) * vocab : nullptr;
      const double pd = p[d];
      const double qd = q != nullptr ? static_cast<double>(q[d]) : 1.0;
      // Accept with probability min(1, p(d) / q(d)), written without the division.
      if (uni[row0 + j] * qd < pd) {
        oi[n++] = d;
        continue;
      }
      // Rejected: draw from the residual max(p - q, 0) renormalised; it is all zero only when
      // p == q up to rounding, and then p itself is the right distribution.
      int64_t t = sample_residual(p, q, q != nullptr ? -1 : d, vocab, u_final);
      if (t < 0) t = sample_residual(p, nullptr, -1, vocab, u_final);
      oi[n++] = t;
      rejected = true;
      break;
    }
    if (!rejected) oi[n++] = sample_residual(tp + (row0 + k) * vocab, nullptr, -1, vocab, u_final);
    ne[i] = n;
  }
  return {out, num_emitted};
}

}  // namespace pagewire
