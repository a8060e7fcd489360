// The batched LoRA kernel's shrink and expand tasks (lora_kernel.h), written once over an 8-lane
// vector type V: lora_avx2.cpp instantiates them with AVX2 registers, lora.cpp with a portable
// 8-float struct that does the same lane arithmetic with scalar fma, so both give the same bits.
// Everything here is a template on V, so the two translation units (compiled for different ISAs)
// never share an instantiation.
//
// V provides: Reg, zero(), set1(f), load(const E*) for E in float, Bf16, Fp16 (to fp32 lanes),
// store(E*, Reg) (rounded to E), round(Reg, const E*) (to E's precision, kept as fp32), fma(a, b, c)
// = a * b + c with one rounding, mul, add, and hsum(Reg) summing the lanes in avx2::hsum's order:
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "elem.h"
#include "lora_kernel.h"

namespace pagewire::cpu::lora_detail {

// How many rows of A or Bᵀ ahead the loops prefetch (one prefetch per vector: cheap, and a
// line is requested a little early rather than late).
constexpr int64_t kPrefetchRows = 8;

// f rounded to E's precision (identity for fp32), as a tensor of E would hold it.
template <class V, class E>
inline float rnd(float f) {
  E e;
  store_float(f, &e);
  return to_float(e);
}

// res[g * NC + c] = x row g . A row c for G rows and NC A rows: one fma chain per 8 lanes, the
// lanes summed in hsum's order, the tail (in % 8) added after them in index order.
template <class V, class E, int G, int NC>
inline void dots(const E* const* xr, const E* const* ar, int64_t in, float* res) {
  using Reg = typename V::Reg;
  Reg acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = V::zero();
  int64_t k = 0;
  for (; k + 8 <= in; k += 8) {
    Reg av[NC];
    for (int c = 0; c < NC; ++c) {
      // The rows two tasks on (the next pairs of this adapter's rows, mostly): streamed from
      // memory, where the hardware prefetcher alone keeps too few lines in flight.
      __builtin_prefetch(ar[c] + kPrefetchRows * in + k);
      av[c] = V::load(ar[c] + k);
    }
    for (int g = 0; g < G; ++g) {
      const Reg xv = V::load(xr[g] + k);
      for (int c = 0; c < NC; ++c) acc[g][c] = V::fma(xv, av[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) {
      float s = V::hsum(acc[g][c]);
      for (int64_t kk = k; kk < in; ++kk) s = std::fma(to_float(xr[g][kk]), to_float(ar[c][kk]), s);
      res[g * NC + c] = s;
    }
}

template <class V, class E, int NC>
inline void dots_n(int n, const E* const* xr, const E* const* ar, int64_t in, float* res) {
  switch (n) {
    case 1: dots<V, E, 1, NC>(xr, ar, in, res); break;
    case 2: dots<V, E, 2, NC>(xr, ar, in, res); break;
    case 3: dots<V, E, 3, NC>(xr, ar, in, res); break;
    default: dots<V, E, 4, NC>(xr, ar, in, res); break;
  }
}

// u[row, col + c] for group g's rows and its adapter's local columns col, col + 1.
template <class V, class E>
void shrink(const LoraProblem& pb, int64_t g, int64_t col) {
  const LoraGroup& gr = pb.groups[g];
  const int32_t* sp = pb.spans + static_cast<int64_t>(gr.adapter) * pb.P * 2;
  const int32_t* of = pb.off + static_cast<int64_t>(gr.adapter) * pb.P;
  const E* a = static_cast<const E*>(pb.a);
  const E* ar[2];
  int nc = 0;
  for (int64_t c = col; c < col + 2; ++c) {
    for (int64_t p = 0; p < pb.P; ++p) {
      if (c >= of[p] && c < of[p] + sp[2 * p + 1]) {
        ar[nc++] = a + (sp[2 * p] + (c - of[p])) * pb.in;
        break;
      }
    }
  }
  if (nc == 0) return;
  const E* x = static_cast<const E*>(pb.x);
  const E* xr[kLoraGroupRows];
  for (int i = 0; i < gr.n; ++i) xr[i] = x + gr.rows[i] * pb.ldx;
  float res[kLoraGroupRows * 2];
  if (nc == 2) dots_n<V, E, 2>(gr.n, xr, ar, pb.in, res);
  else dots_n<V, E, 1>(gr.n, xr, ar, pb.in, res);
  for (int i = 0; i < gr.n; ++i)
    for (int c = 0; c < nc; ++c) pb.u[gr.rows[i] * pb.ldu + col + c] = rnd<V, E>(res[i * nc + c]);
}

// Part p's output columns [j0, j1) (at most kLoraBlock) for every group whose adapter targets the part: the
// group's sums kept in fp32 in `acc` (L1) while its Bᵀ rows stream by, each read once, front to
// back; each output value is one fma chain over the adapter's columns in order, in a lane or (the
// last w % 8 columns) a scalar, the same sum either way.
template <class V, class E>
void expand(const LoraProblem& pb, int64_t p, int64_t j0, int64_t j1, int64_t ngroups) {
  using Reg = typename V::Reg;
  const LoraPart& pt = pb.parts[p];
  const int64_t w = std::min(kLoraBlock, j1 - j0), wv = w / 8 * 8;
  const E* bt = static_cast<const E*>(pt.bt);
  E* out = static_cast<E*>(pb.out);
  alignas(32) float acc[kLoraGroupRows][kLoraBlock];
  for (int64_t g = 0; g < ngroups; ++g) {
    const LoraGroup& gr = pb.groups[g];
    const int64_t ap = static_cast<int64_t>(gr.adapter) * pb.P + p;
    const int64_t cnt = pb.spans[2 * ap + 1];
    if (cnt == 0) continue;
    const E* b = bt + (pb.spans[2 * ap] - pt.c0) * pt.rows + j0;
    const int n = gr.n;
    const float* u[kLoraGroupRows];
    for (int i = 0; i < n; ++i) {
      u[i] = pb.u + gr.rows[i] * pb.ldu + pb.off[ap];
      std::fill(acc[i], acc[i] + w, 0.0f);
    }
    for (int64_t c = 0; c < cnt; ++c, b += pt.rows) {
      float t[kLoraGroupRows];
      Reg tv[kLoraGroupRows];
      for (int i = 0; i < n; ++i) {
        t[i] = u[i][c];
        tv[i] = V::set1(t[i]);
      }
      for (int64_t j = 0; j < wv; j += 8) {
        __builtin_prefetch(b + kPrefetchRows * pt.rows + j);  // (its rows are strided: see dots)
        const Reg bv = V::load(b + j);
        for (int i = 0; i < n; ++i) V::store(acc[i] + j, V::fma(tv[i], bv, V::load(acc[i] + j)));
      }
      for (int64_t j = wv; j < w; ++j) {
        const float bj = to_float(b[j]);
        for (int i = 0; i < n; ++i) acc[i][j] = std::fma(t[i], bj, acc[i][j]);
      }
    }
    const float scale = pb.scales[gr.adapter];
    const Reg s = V::set1(scale);
    for (int i = 0; i < n; ++i) {
      E* o = out + gr.rows[i] * pb.ldo + pt.row + j0;
      for (int64_t j = 0; j < wv; j += 8) {
        const Reg v = V::round(V::mul(V::round(V::load(acc[i] + j), o), s), o);
        V::store(o + j, V::add(V::load(o + j), v));
      }
      for (int64_t j = wv; j < w; ++j) {
        const float v = rnd<V, E>(rnd<V, E>(acc[i][j]) * scale);
        store_float(to_float(o[j]) + v, &o[j]);
      }
    }
  }
}

template <class V>
void shrink_any(const LoraProblem& pb, int64_t g, int64_t col) {
  switch (pb.dtype) {
    case LoraDtype::kF32: shrink<V, float>(pb, g, col); break;
    case LoraDtype::kBf16: shrink<V, Bf16>(pb, g, col); break;
    case LoraDtype::kF16: shrink<V, Fp16>(pb, g, col); break;
  }
}

template <class V>
void expand_any(const LoraProblem& pb, int64_t p, int64_t j0, int64_t j1, int64_t ngroups) {
  switch (pb.dtype) {
    case LoraDtype::kF32: expand<V, float>(pb, p, j0, j1, ngroups); break;
    case LoraDtype::kBf16: expand<V, Bf16>(pb, p, j0, j1, ngroups); break;
    case LoraDtype::kF16: expand<V, Fp16>(pb, p, j0, j1, ngroups); break;
  }
}

}  // namespace pagewire::cpu::lora_detail
