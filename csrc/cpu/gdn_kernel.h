// The torch-free interface of the Gated DeltaNet kernel bodies (Qwen3-Next, Qwen3.5): one body per
// ISA family, portable (gdn_ops.cpp), AVX2+FMA (gdn_avx2.cpp) and AVX-512 (gdn_avx512.cpp), all
// instantiated from the one template in gdn_body.h. gdn_ops.cpp gathers a head's tokens into float32
// rows, normalises q and k, and picks the body by cpu::active_isa(); call an ISA's body only when
// the active family is at least that one.
#pragma once

#include <cstdint>

namespace pagewire::cpu {

// One chunk of L tokens of one value head of the gated delta rule, in float32:
//   q, k [L, Dk] (q already l2-normalised and scaled by Dk^-1/2, k l2-normalised), v [L, Dv],
//   g [L] (log decay, <= 0), beta [L]; state [Dk, Dv] read as the state before the chunk and
//   overwritten with the state after it; out [L, Dv]. work: gdn_chunk_work_floats(L, Dk, Dv) floats.
// Per token t the rule is  S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t,
// computed for the chunk at once in the UT-transform form of transformers' torch_chunk_gated_delta_rule.
struct GdnChunk {
  const float *q, *k, *v, *g, *beta;
  float *state, *out, *work;
  int64_t L, Dk, Dv;
};
inline int64_t gdn_chunk_work_floats(int64_t L, int64_t Dk, int64_t Dv) {
  return 2 * L * L + 3 * L + L * Dk + L * Dv;
}
void gdn_chunk_portable(const GdnChunk& c);
void gdn_chunk_avx2(const GdnChunk& c);
void gdn_chunk_avx512(const GdnChunk& c);

// One token of one value head, the recurrent form (decode): same arguments with L = 1;
// work: Dv floats.
void gdn_step_portable(const GdnChunk& c);
void gdn_step_avx2(const GdnChunk& c);
void gdn_step_avx512(const GdnChunk& c);

// One output row of the depthwise causal conv1d: out[c] = sum_k wt[k * C + c] * rows[k][c] for the
// K window rows (oldest first), wt the weight transposed to [K, C], all float32.
void gdn_conv_row_portable(const float* const* rows, const float* wt, float* out, int64_t K, int64_t C);
void gdn_conv_row_avx2(const float* const* rows, const float* wt, float* out, int64_t K, int64_t C);
void gdn_conv_row_avx512(const float* const* rows, const float* wt, float* out, int64_t K, int64_t C);

}  // namespace pagewire::cpu
