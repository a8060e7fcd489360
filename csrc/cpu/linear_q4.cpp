// The 4-bit, 5-bit and K-quant weight CPU ops (GGUF's Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q2_K,
// Q3_K, Q4_K, Q5_K, Q6_K and MXFP4 layouts, see quant4_kernel.h):
// quantize_q4_0 (float weights at load, GGUF's rounding), dequantize_q4 (tests, prefill), and
// linear_q4: x @ dequant(w)^T (+ bias) with x quantised per row to Q8 blocks on the fly, through
// the AVX-512 VNNI kernel (linear_q4_avx512.cpp) when the CPU has it, the AVX2 one
// (linear_q4_avx2.cpp) when it has that, and the portable one otherwise. Batches above
// kQ4KernelMaxRows (prefill) dequantise the weight a chunk of rows at a time and run ATen's GEMM
// on each chunk: compute-bound there, and the chunk keeps the dequantised copy small.
// interleave_q4 rearranges every type but MXFP4 into the x8 layout (quant4_kernel.h; the moves
// are x8_layouts.cpp's), which every op here also takes (qtype "q4_0x8", "q5_1x8", ...): linear_q4
// runs it through linear_x8_avx2.cpp (linear_x8k_avx2.cpp for the K-quants) or its VNNI build.
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
#include "chunked_gemm.h"
#include "dispatch_mode.h"
#include "float_rows.h"
#include "maybe_parallel.h"
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

// Sub-block sb (32 values) of a row: integer codes q[32] and (a[0], a[1], c) with value
// j = a[j / 16] * q[j] + c. a[0] == a[1] except for Q6_K, Q3_K and Q2_K, whose 16-value halves
// have scales of their own (Q6_K's q is then the signed code - 32, Q3_K's the code - 4, and c is 0; Q2_K's halves have mins
// of their own too: c2, value j = a[j / 16] * q[j] + c2[j / 16]). Each a and c is computed as the
// `gguf` package computes it (d * sc, dmin * mn in fp32), so dequantising gives its floats.
inline void decode_sub(Q4Type t, const uint8_t* row, int64_t sb, int16_t* q, float* a, float* c,
                       float* c2 = nullptr) {
  if (t == Q4Type::kQ2_K) {
    const uint8_t* blk = row + (sb / 8) * kQ2_KBlockBytes;
    const int bb = static_cast<int>(sb % 8), n = bb / 4, j = bb % 4;
    const float d = load_fp16(blk + 80), dmin = load_fp16(blk + 82);
    for (int h = 0; h < 2; ++h) {
      const uint8_t sc = blk[2 * bb + h];
      a[h] = d * static_cast<float>(sc & 15);
      c2[h] = -(dmin * static_cast<float>(sc >> 4));
    }
    *c = c2[0];
    for (int l = 0; l < 32; ++l) q[l] = static_cast<int16_t>((blk[16 + 32 * n + l] >> (2 * j)) & 3);
    return;
  }
  if (t == Q4Type::kQ3_K) {
    const uint8_t* blk = row + (sb / 8) * kQ3_KBlockBytes;
    const int bb = static_cast<int>(sb % 8), n = bb / 4, j = bb % 4;
    const float d = load_fp16(blk + 108);
    for (int h = 0; h < 2; ++h) a[h] = d * static_cast<float>(q3_k_scale(blk + 96, 2 * bb + h));
    *c = 0.f;
    for (int l = 0; l < 32; ++l) {
      const int q2 = (blk[32 + 32 * n + l] >> (2 * j)) & 3, h = (blk[l] >> (4 * n + j)) & 1;
      q[l] = static_cast<int16_t>(q2 + 4 * h - 4);
    }
    return;
  }
  if (t == Q4Type::kQ6_K) {
    const uint8_t* blk = row + (sb / 8) * kQ6_KBlockBytes;
    const int j = static_cast<int>(sb % 8), h = j / 4, u = j % 4;
    const uint8_t* ql = blk + 64 * h + 32 * (u % 2);
    const uint8_t* qh = blk + 128 + 32 * h;
    const int shift = u < 2 ? 0 : 4;
    const float d = load_fp16(blk + 208);
    a[0] = d * static_cast<float>(static_cast<int8_t>(blk[192 + 2 * j]));
    a[1] = d * static_cast<float>(static_cast<int8_t>(blk[192 + 2 * j + 1]));
    *c = 0.f;
    for (int l = 0; l < 32; ++l) q[l] = static_cast<int16_t>((((ql[l] >> shift) & 0xF) | (((qh[l] >> (2 * u)) & 3) << 4)) - 32);
    return;
  }
  if (t == Q4Type::kQ4_K || t == Q4Type::kQ5_K) {
    const bool five = t == Q4Type::kQ5_K;
    const uint8_t* blk = row + (sb / 8) * q4_block_bytes(t);
    const int s = static_cast<int>(sb % 8);
    uint8_t sc, mn;
    q4_k_scale_min(s, blk + 4, &sc, &mn);
    a[0] = a[1] = load_fp16(blk) * sc;
    *c = -(load_fp16(blk + 2) * mn);
    const uint8_t* qs = blk + (five ? 48 : 16) + (s / 2) * 32;
    const int shift = (s % 2) * 4;
    for (int j = 0; j < 32; ++j) {
      q[j] = static_cast<int16_t>(((qs[j] >> shift) & 0xF) | (five ? ((blk[16 + j] >> s) & 1) << 4 : 0));
    }
    return;
  }
  if (t == Q4Type::kMXFP4) {
    const uint8_t* blk = row + sb * kMxfp4BlockBytes;
    a[0] = a[1] = mxfp4_scale(blk[0]);
    *c = -kMxfp4Offset * a[0];
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<int16_t>(kMxfp4Values[blk[1 + j] & 0xF] + kMxfp4Offset);
      q[j + 16] = static_cast<int16_t>(kMxfp4Values[blk[1 + j] >> 4] + kMxfp4Offset);
    }
    return;
  }
  if (q_is_x16(t)) {  // signed levels under a scale per 16 values, no offset term
    const uint8_t* blk = row + (sb / 8) * kIq4x16BlockBytes;
    const int s = static_cast<int>(sb % 8);
    for (int h = 0; h < 2; ++h) a[h] = load_fp16(blk) * static_cast<float>(iq_x16_scale(blk, 2 * s + h)) * q_level_scale(t);
    *c = 0.f;
    const uint8_t* qs = blk + 10 + 16 * s;
    const int8_t* levels = q_levels(t);
    for (int j = 0; j < 16; ++j) {
      q[j] = levels[qs[j] & 0xF];
      q[j + 16] = levels[qs[j] >> 4];
    }
    return;
  }
  if (t == Q4Type::kIQ4_NL || q_is_xs(t)) {  // signed levels, no offset term
    const bool xs = q_is_xs(t);
    const uint8_t* blk = xs ? row + (sb / 8) * kIq4xsBlockBytes : row + sb * kIq4nlBlockBytes;
    // IQ4_XS layout: d * (ls - 32) * f in fp32 (exact: an 11-bit significand times a 6-bit integer
    // times a power of two), as the `gguf` package computes each type's sub-block scale.
    a[0] = a[1] = xs ? load_fp16(blk) * static_cast<float>(iq4_xs_scale(blk, static_cast<int>(sb % 8))) *
                           q_level_scale(t)
                     : load_fp16(blk);
    *c = 0.f;
    const uint8_t* qs = xs ? blk + 8 + 16 * (sb % 8) : blk + 2;
    const int8_t* levels = q_levels(t);
    for (int j = 0; j < 16; ++j) {
      q[j] = levels[qs[j] & 0xF];
      q[j + 16] = levels[qs[j] >> 4];
    }
    return;
  }
  const uint8_t* blk = row + sb * q4_block_bytes(t);
  const float d = load_fp16(blk);
  a[0] = a[1] = d;
  const bool mins = t == Q4Type::kQ4_1 || t == Q4Type::kQ5_1;
  *c = t == Q4Type::kQ4_0 ? -8.f * d : t == Q4Type::kQ5_0 ? -16.f * d : load_fp16(blk + 2);
  const uint8_t* qs = blk + (mins ? 4 : 2) + (q_is_5(t) ? 4 : 0);
  uint32_t qh = 0;
  if (q_is_5(t)) std::memcpy(&qh, blk + (mins ? 4 : 2), 4);
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int16_t>((qs[j] & 0xF) | ((qh >> j) & 1) << 4);
    q[j + 16] = static_cast<int16_t>((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
  }
}

}  // namespace

void dequantize_q4_row(Q4Type t, const uint8_t* w, float* out, int64_t K) {
  int16_t q[32];
  float a[2], c, c2[2];
  for (int64_t sb = 0; sb < K / 32; ++sb) {
    decode_sub(t, w, sb, q, a, &c, c2);
    float* o = out + sb * 32;
    if (t == Q4Type::kQ4_0 || t == Q4Type::kQ5_0) {  // GGUF: d * (q - 8), d * (q5 - 16)
      const int zero = t == Q4Type::kQ4_0 ? 8 : 16;
      for (int j = 0; j < 32; ++j) o[j] = a[0] * static_cast<float>(static_cast<int>(q[j]) - zero);
    } else if (t == Q4Type::kQ6_K || t == Q4Type::kQ3_K || t == Q4Type::kIQ4_NL || q_is_xs(t) || q_is_x16(t)) {
      // GGUF: (d * sc) * (q - 32) (Q6_K), (d * (sc - 32)) * (q - 4) (Q3_K), d * level (IQ4, signed)
      for (int j = 0; j < 32; ++j) o[j] = a[j / 16] * static_cast<float>(q[j]);
    } else if (t == Q4Type::kQ2_K) {  // GGUF: (d * sc) * q - dmin * mn, per 16-value half
      for (int j = 0; j < 32; ++j) o[j] = a[j / 16] * static_cast<float>(q[j]) + c2[j / 16];
    } else if (t == Q4Type::kMXFP4) {  // exact: a small integer times a power of two
      for (int j = 0; j < 32; ++j) o[j] = a[0] * static_cast<float>(static_cast<int>(q[j]) - kMxfp4Offset);
    } else {
      for (int j = 0; j < 32; ++j) o[j] = a[0] * static_cast<float>(q[j]) + c;
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
    int16_t q[32];
    float a[2], c, c2[2];
    for (int64_t b = 0; b < nb; ++b) {
      decode_sub(t, wr, b, q, a, &c, c2);
      for (int64_t m = 0; m < x.M; ++m) {
        const int8_t* xq = x.q + m * x.K + b * 32;
        int32_t dot[2] = {0, 0};
        for (int j = 0; j < 32; ++j) dot[j / 16] += static_cast<int32_t>(q[j]) * static_cast<int32_t>(xq[j]);
        const float xd = x.d[m * nb + b];
        if (t == Q4Type::kQ2_K) {  // two scales and two mins per block: the halves' code sums
          int32_t sum[2] = {0, 0};
          for (int j = 0; j < 32; ++j) sum[j / 16] += xq[j];
          acc[m] += static_cast<float>(dot[0]) * (a[0] * xd) + static_cast<float>(dot[1]) * (a[1] * xd) +
                    c2[0] * (xd * static_cast<float>(sum[0])) + c2[1] * (xd * static_cast<float>(sum[1]));
        } else if (t == Q4Type::kQ6_K || t == Q4Type::kQ3_K || q_is_x16(t)) {  // two scales per block; signed codes, no offset term
          acc[m] += static_cast<float>(dot[0]) * (a[0] * xd) + static_cast<float>(dot[1]) * (a[1] * xd);
        } else {
          acc[m] += static_cast<float>(dot[0] + dot[1]) * (a[0] * xd) + c * x.s[m * nb + b];
        }
      }
    }
    for (int64_t m = 0; m < x.M; ++m) out[m * ldo + n] = acc[m] + (bias != nullptr ? bias[n] : 0.f);
  }
}

}  // namespace cpu

namespace {

struct Q4Format {
  cpu::Q4Type type;
  bool interleaved;  // the x8 layout (quant4_kernel.h)
};

Q4Format parse_q4_type(const std::string& qtype) {
  Q4Format f{};
  TORCH_CHECK(cpu::parse_q4_name(qtype, &f.type, &f.interleaved), "qtype must be ", cpu::q4_names(), ", got '", qtype,
              "'");
  return f;
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

// float32 [rows, K] from rows [n0, n0 + rows) of a contiguous weight. Interleaved weights: n0 a
// multiple of 8; each group is put back in row layout in a small buffer, then dequantised.
at::Tensor dequantize_rows(const at::Tensor& wc, Q4Format f, int64_t K, int64_t n0, int64_t rows) {
  const int64_t rb = wc.size(1);
  at::Tensor out = at::empty({rows, K}, wc.options().dtype(at::kFloat));
  const uint8_t* src = wc.data_ptr<uint8_t>() + n0 * rb;
  float* dst = out.data_ptr<float>();
  constexpr int64_t G = cpu::kQ4Interleave;
  // Rows [0, grouped) of the range are whole interleaved groups; the rest are in row layout.
  const int64_t grouped = f.interleaved ? std::max<int64_t>(0, std::min(rows, wc.size(0) / G * G - n0)) : 0;
  TORCH_CHECK(!f.interleaved || n0 % G == 0, "dequantize_rows: n0 = ", n0, " must be a multiple of ", G);
  // (maybe_parallel.h: a GGUF embedding row a decode step builds no team of one.)
  cpu::maybe_parallel_for(grouped / G, rows * K >= (1 << 16), [&](int64_t g) {
    std::vector<uint8_t> rows8(G * rb);
    cpu::deinterleave_q4_group(f.type, src + g * G * rb, rows8.data(), rb, K);
    for (int64_t r = 0; r < G; ++r) cpu::dequantize_q4_row(f.type, rows8.data() + r * rb, dst + (g * G + r) * K, K);
  });
  cpu::maybe_parallel_for(rows - grouped, (rows - grouped) * K >= (1 << 16), [&](int64_t i) {
    const int64_t n = grouped + i;
    cpu::dequantize_q4_row(f.type, src + n * rb, dst + n * K, K);
  });
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
  const Q4Format f = parse_q4_type(qtype);
  const cpu::Q4Type t = f.type;
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) % cpu::q4_block_bytes(t) == 0, "weight must be [N, row bytes] ",
              qtype, " blocks, got shape ", weight.sizes());
  const int64_t K = weight.size(1) / cpu::q4_block_bytes(t) * cpu::q4_block_values(t);
  check_q4_weight(weight, t, qtype, K);
  return dequantize_rows(weight.contiguous(), f, K, 0, weight.size(0));
}

at::Tensor interleave_q4_cpu(const at::Tensor& weight, c10::string_view qtype_view) {
  const std::string qtype(qtype_view);
  const Q4Format f = parse_q4_type(qtype);
  TORCH_CHECK(!f.interleaved && cpu::q4_interleavable(f.type),
              "qtype must be a row-layout qtype with an x8 layout ('q4_0', 'q4_1', 'q4_k', 'q5_k', 'q6_k', 'q5_0', "
              "'q5_1', 'iq4_nl', 'iq4_xs', 'q2_k', 'q3_k', 'iq3_xxs', 'iq3_s', 'iq2_xxs', 'iq1_s', 'iq2_xs', 'iq2_s' or 'iq1_m'), got '",
              qtype,
              "'");
  const cpu::Q4Type t = f.type;
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) % cpu::q4_block_bytes(t) == 0, "weight must be [N, row bytes] ",
              qtype, " blocks, got shape ", weight.sizes());
  const int64_t K = weight.size(1) / cpu::q4_block_bytes(t) * cpu::q4_block_values(t);
  check_q4_weight(weight, t, qtype, K);
  const at::Tensor wc = weight.contiguous();
  at::Tensor out = at::empty(wc.sizes(), wc.options());
  const int64_t N = wc.size(0), rb = wc.size(1), G = cpu::kQ4Interleave, groups = N / G;
  const uint8_t* src = wc.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
  for (int64_t g = 0; g < groups; ++g) cpu::interleave_q4_group(t, src + g * G * rb, rb, dst + g * G * rb, K);
  std::memcpy(dst + groups * G * rb, src + groups * G * rb, (N - groups * G) * rb);  // the last N % 8 rows
  return out;
}

namespace {

// linear_q4_cpu (every_m false: above kQ4KernelMaxRows, dequantise + GEMM) and linear_q4_rows_cpu
// (every_m true: the kernel in blocks of kQ4KernelMaxRows rows).
at::Tensor linear_q4_impl(const at::Tensor& x, const at::Tensor& weight, c10::string_view qtype_view,
                          const c10::optional<at::Tensor>& bias, bool every_m) {
  const std::string qtype(qtype_view);
  const Q4Format f = parse_q4_type(qtype);
  const cpu::Q4Type t = f.type;
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got shape ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be floating point, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  check_q4_weight(weight, t, qtype, K);
  const bool has_bias = cpu::check_bias(bias, N, x);
  const at::Tensor wc = weight.contiguous();
  if (M > kQ4KernelMaxRows && !every_m) {  // prefill: ATen's GEMM on dequantised chunks of rows (chunked_gemm.h)
    return cpu::chunked_gemm(x, N, bias, has_bias,
                             [&](int64_t n0, int64_t rows) { return dequantize_rows(wc, f, K, n0, rows); });
  }
  if (M == 0 || N == 0) return at::empty({M, N}, x.options());
  const cpu::Isa isa = cpu::active_isa();
  const bool portable = isa == cpu::Isa::kPortable;
  // bf16 rows in and out through per-thread fp32 buffers (float_rows.h), not ATen conversions.
  cpu::KernelRows io(x, bias, has_bias, N, !portable);
  const float *xf = io.xf, *b = io.b;
  // Per calling thread (the engine thread), reused across calls: no allocation per decode step.
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xs;
  const int64_t nb = K / 32;
  if (static_cast<int64_t>(xq.size()) < M * K) xq.resize(M * K);
  if (static_cast<int64_t>(xd.size()) < M * nb) {
    xd.resize(M * nb);
    xs.resize(M * nb);
  }
  const auto kernel = portable                      ? cpu::linear_q4_portable
                      : isa >= cpu::Isa::kAvx512 ? cpu::linear_q4_avx512
                                                 : cpu::linear_q4_avx2;
  const uint8_t* w = wc.data_ptr<uint8_t>();
  float* o = io.out.data();
  const auto x8_kernel = [&](int64_t rows) {
    // Q4_0 and Q4_1 on AMX tiles from kAmxMinRowsQ4x8 rows (the same floats as VNNI's x8 kernel).
    const bool amx = cpu::use_amx(isa, rows) && rows >= cpu::kAmxMinRowsQ4x8 &&
                     (t == cpu::Q4Type::kQ4_0 || t == cpu::Q4Type::kQ4_1);
    return amx ? cpu::linear_q4x8_amx : isa >= cpu::Isa::kAvx512 ? cpu::linear_q4x8_vnni : cpu::linear_q4x8_avx2;
  };
  // Rows [r0, r0 + rows) of the activations (quantised) and of the output; at most
  // kQ4KernelMaxRows rows a block, each block the call a batch of just those rows would make.
  // (Plain pointers: the team's threads run the fused kernel below, and a thread_local named there
  // would be each worker's own.)
  int8_t* const qp = xq.data();
  float* const dp = xd.data();
  float* const sp = xs.data();
  const auto block = [=](int64_t r0, int64_t rows) {
    return cpu::Q8SumActivations{qp + r0 * K, dp + r0 * nb, sp + r0 * nb, rows, K};
  };
  const auto blocks = [&](const auto& body) {
    for (int64_t r0 = 0; r0 < M; r0 += kQ4KernelMaxRows) body(r0, std::min(kQ4KernelMaxRows, M - r0));
  };
  if (f.interleaved && !portable && N % cpu::kQ4Interleave == 0 && cpu::fused_linear_applies(M, N, K, io.out)) {
    // Quantise, kernel and rounding in one parallel region (float_rows.h fused_linear); each block's
    // kernel splits its loop over the team.
    return cpu::fused_linear(true, xf, M, K, xq.data(), xd.data(), xs.data(), io.out, [&] {
      blocks([&](int64_t r0, int64_t rows) { x8_kernel(rows)(t, block(r0, rows), w, b, o + r0 * N, N, N); });
    });
  }
  cpu::quantize_activation_rows(!portable, xf, M, K, xq.data(), xd.data(), xs.data());
  if (!f.interleaved) {
    blocks([&](int64_t r0, int64_t rows) { kernel(t, block(r0, rows), w, b, o + r0 * N, N, N); });
  } else if (!portable) {
    // Whole groups through the family's x8 kernel (VNNI from AVX-512 up; Q4_0 and Q4_1 on AMX tiles
    // from kAmxMinRowsQ4x8 rows, the same floats), the last N % 8 rows, in row layout, through the
    // family's row kernel.
    const int64_t G = cpu::kQ4Interleave, done = N / G * G, rb = wc.size(1);
    blocks([&](int64_t r0, int64_t rows) {
      const cpu::Q8SumActivations a = block(r0, rows);
      x8_kernel(rows)(t, a, w, b, o + r0 * N, N, done);
      if (done < N) kernel(t, a, w + done * rb, b != nullptr ? b + done : nullptr, o + r0 * N + done, N, N - done);
    });
  } else {
    // No AVX2 (or PAGEWIRE_CPU_ISA=portable after the weight was interleaved): the portable kernel
    // on a row-layout copy. Slow, but only reached when the family is forced below the one the
    // weight was prepared for.
    const int64_t G = cpu::kQ4Interleave, rb = wc.size(1);
    std::vector<uint8_t> rows(N * rb);
    for (int64_t g = 0; g < N / G; ++g) cpu::deinterleave_q4_group(t, w + g * G * rb, rows.data() + g * G * rb, rb, K);
    std::memcpy(rows.data() + N / G * G * rb, w + N / G * G * rb, (N % G) * rb);
    blocks([&](int64_t r0, int64_t n) { kernel(t, block(r0, n), rows.data(), b, o + r0 * N, N, N); });
  }
  return io.out.finish();
}

}  // namespace

at::Tensor linear_q4_cpu(const at::Tensor& x, const at::Tensor& weight, c10::string_view qtype,
                         const c10::optional<at::Tensor>& bias) {
  return linear_q4_impl(x, weight, qtype, bias, false);
}

at::Tensor linear_q4_rows_cpu(const at::Tensor& x, const at::Tensor& weight, c10::string_view qtype,
                              const c10::optional<at::Tensor>& bias) {
  return linear_q4_impl(x, weight, qtype, bias, true);
}

}  // namespace pagewire
