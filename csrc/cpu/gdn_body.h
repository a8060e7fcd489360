// The Gated DeltaNet kernel bodies, written once over a vector-primitive struct V (a row of n
// floats at a time: dot, axpy, ...), and instantiated per ISA family by gdn_ops.cpp (portable),
// gdn_avx2.cpp and gdn_avx512.cpp after their target pragmas. Everything here is in an anonymous
// namespace on purpose: each file's instantiations are compiled for its own ISA and must never be
// merged by the linker with another file's (which an inline template's weak symbol would allow).
// Include <cmath> and <cstdint> before the target pragma, then this header.
#pragma once

#include "gdn_kernel.h"

namespace pagewire::cpu {
namespace {

// V needs:  dot(a, b, n);  axpy(a, x, y, n): y += a x;  axpy2(a, b, x, y, z, n): y += a x, z += b x;
// scale(a, y, n): y *= a;  axpby_acc(a, y, b, x, c, z, n): y = a y + b x, then z += c y;
// muladd(w, x, y, n): y += w .* x.

template <class V>
void chunk_body(const GdnChunk& c) {
  const int64_t L = c.L, Dk = c.Dk, Dv = c.Dv;
  float* A = c.work;            // [L, L] UT system, strictly lower
  float* attn = A + L * L;      // [L, L] intra-chunk q.k with decay, lower incl. diagonal
  float* cum = attn + L * L;    // [L] cumulative log decay
  float* ec = cum + L;          // exp(cum_i)
  float* kd = ec + L;           // exp(cum_last - cum_i)
  float* w = kd + L;            // [L, Dk] solved decayed k_beta (transformers' k_cumdecay)
  float* u = w + L * Dk;        // [L, Dv] solved v_beta, then the new values (v_new)
  float acc = 0.0f;
  for (int64_t i = 0; i < L; ++i) {
    acc += c.g[i];
    cum[i] = acc;
  }
  for (int64_t i = 0; i < L; ++i) {
    ec[i] = std::exp(cum[i]);
    kd[i] = std::exp(cum[L - 1] - cum[i]);
  }
  for (int64_t i = 0; i < L; ++i) {
    const float* qi = c.q + i * Dk;
    const float* ki = c.k + i * Dk;
    for (int64_t j = 0; j <= i; ++j) {
      const float dec = std::exp(cum[i] - cum[j]);
      const float* kj = c.k + j * Dk;
      if (j < i) A[i * L + j] = c.beta[i] * V::dot(ki, kj, Dk) * dec;
      attn[i * L + j] = V::dot(qi, kj, Dk) * dec;
    }
  }
  // Forward substitution of the unit lower-triangular system (I + A) X = B for
  // B = v_beta (-> u) and B = k_beta exp(cum) (-> w).
  for (int64_t i = 0; i < L; ++i) {
    float* ui = u + i * Dv;
    float* wi = w + i * Dk;
    for (int64_t e = 0; e < Dv; ++e) ui[e] = c.v[i * Dv + e] * c.beta[i];
    const float kb = c.beta[i] * ec[i];
    for (int64_t d = 0; d < Dk; ++d) wi[d] = c.k[i * Dk + d] * kb;
    for (int64_t j = 0; j < i; ++j) {
      const float a = -A[i * L + j];
      V::axpy(a, u + j * Dv, ui, Dv);
      V::axpy(a, w + j * Dk, wi, Dk);
    }
  }
  // Reading the state before the chunk: v_new_i = u_i - w_i S, o_i = exp(cum_i) q_i S (one pass over S per row).
  for (int64_t i = 0; i < L; ++i) {
    float* ui = u + i * Dv;
    float* oi = c.out + i * Dv;
    for (int64_t e = 0; e < Dv; ++e) oi[e] = 0.0f;
    const float* qi = c.q + i * Dk;
    const float* wi = w + i * Dk;
    for (int64_t d = 0; d < Dk; ++d) V::axpy2(-wi[d], ec[i] * qi[d], c.state + d * Dv, ui, oi, Dv);
  }
  // The chunk's own tokens.
  for (int64_t i = 0; i < L; ++i) {
    float* oi = c.out + i * Dv;
    for (int64_t j = 0; j <= i; ++j) V::axpy(attn[i * L + j], u + j * Dv, oi, Dv);
  }
  // S = exp(cum_last) S + sum_i (exp(cum_last - cum_i) k_i)^T v_new_i
  const float el = ec[L - 1];
  for (int64_t d = 0; d < Dk; ++d) {
    float* sd = c.state + d * Dv;
    V::scale(el, sd, Dv);
    for (int64_t i = 0; i < L; ++i) V::axpy(c.k[i * Dk + d] * kd[i], u + i * Dv, sd, Dv);
  }
}

template <class V>
void step_body(const GdnChunk& c) {
  const int64_t Dk = c.Dk, Dv = c.Dv;
  const float eg = std::exp(c.g[0]);
  float* delta = c.work;
  for (int64_t e = 0; e < Dv; ++e) delta[e] = 0.0f;
  for (int64_t d = 0; d < Dk; ++d) V::axpy(c.k[d], c.state + d * Dv, delta, Dv);  // S^T k (before decay)
  for (int64_t e = 0; e < Dv; ++e) delta[e] = c.beta[0] * (c.v[e] - eg * delta[e]);
  for (int64_t e = 0; e < Dv; ++e) c.out[e] = 0.0f;
  for (int64_t d = 0; d < Dk; ++d) V::axpby_acc(eg, c.state + d * Dv, c.k[d], delta, c.q[d], c.out, Dv);
}

template <class V>
void conv_row_body(const float* const* rows, const float* wt, float* out, int64_t K, int64_t C) {
  for (int64_t ch = 0; ch < C; ++ch) out[ch] = 0.0f;
  for (int64_t k = 0; k < K; ++k) V::muladd(wt + k * C, rows[k], out, C);
}

}  // namespace
}  // namespace pagewire::cpu
