// embedding_gguf: token embedding rows gathered from a table kept in a GGUF file's blocks
// (--quantization gguf, server/kernels/quant_embedding.py), in one call per step: each id's row of
// blocks copied out (from its group of eight, de-interleaved, when the table is in the x8 layout:
// a tied table that is also the lm_head's weight), then dequantised by dequantize_q8_0 /
// dequantize_q4 (GGUF's float32 values, bit for bit the `gguf` package's) and rounded to `dtype`:
// exactly the rows of the float table the loader would otherwise have built.
//
// A few ids (a decode step's) take a path of their own: each row dequantised into a small buffer
// and rounded straight into the output, one allocation in all. The general path's ops (the rows'
// tensor, dequantize_q4's float table, ATen's `.to`) took 61 us a step on SmolLM2 Q4_0 right after
// a decode step's weights had gone through the caches, against 6 us hot (bench/RESULTS.md,
// session 34); the values are the same, each rounded to nearest-even as `.to` rounds them.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <string>
#include <vector>

#include "../ops.h"
#include "quant4_kernel.h"
#include "quant_kernel.h"

namespace pagewire {

namespace {

// Ids up to which the rows are gathered on the calling thread without intermediate tensors (a
// decode batch's; a prompt's take the general path, whose dequantisation splits over the team).
constexpr int64_t kFewRows = 64;

}  // namespace

at::Tensor embedding_gguf_cpu(const at::Tensor& ids, const at::Tensor& weight, c10::string_view qtype_view,
                              at::ScalarType dtype) {
  std::string qtype(qtype_view);
  const bool x8 = qtype.size() > 2 && qtype.compare(qtype.size() - 2, 2, "x8") == 0;
  const std::string rows_kind = x8 ? qtype.substr(0, qtype.size() - 2) : qtype;
  const bool q8 = rows_kind == "q8_0";
  cpu::Q4Type t = cpu::Q4Type::kQ4_0;
  bool row_x8 = false;
  TORCH_CHECK(q8 || (cpu::parse_q4_name(rows_kind, &t, &row_x8) && !row_x8), "qtype must be 'q8_0', ", cpu::q4_names(),
              " (with 'x8' when interleaved), got '", qtype, "'");
  TORCH_CHECK(!x8 || q8 || cpu::q4_interleavable(t), "qtype '", qtype, "' has no x8 layout");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                  weight.is_contiguous(),
              "weight must be a contiguous CPU uint8 [N, row bytes] tensor, got ", weight.scalar_type(), " ",
              weight.sizes());
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong, "ids must be a CPU int64 tensor, got ",
              ids.scalar_type(), " on ", ids.device());
  const int64_t N = weight.size(0), rb = weight.size(1), G = 8, full = x8 ? N / G * G : 0;
  const int64_t K = q8 ? rb / cpu::kQ8BlockBytes * cpu::kQ8Block : rb / cpu::q4_block_bytes(t) * cpu::q4_block_values(t);
  const at::Tensor ic = ids.contiguous();
  const int64_t n = ic.numel();
  const int64_t* id = ic.data_ptr<int64_t>();
  const uint8_t* w = weight.data_ptr<uint8_t>();
  std::vector<int64_t> shape(ic.sizes().begin(), ic.sizes().end());
  shape.push_back(K);
  if (n <= kFewRows && (dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat)) {
    at::Tensor out = at::empty(shape, weight.options().dtype(dtype));
    // Per calling thread, reused: an x8 group put back in row layout, and one row's float values.
    thread_local std::vector<uint8_t> group;
    thread_local std::vector<float> values;
    if (x8 && static_cast<int64_t>(group.size()) < G * rb) group.resize(G * rb);
    if (static_cast<int64_t>(values.size()) < K) values.resize(K);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = id[i];
      TORCH_CHECK_INDEX(row >= 0 && row < N, "index ", row, " is out of range for an embedding table of ", N, " rows");
      const uint8_t* src = w + row * rb;
      if (row < full) {
        const uint8_t* g = w + row / G * G * rb;
        if (q8) cpu::deinterleave_q8_0_group(g, group.data(), rb, K);
        else cpu::deinterleave_q4_group(t, g, group.data(), rb, K);
        src = group.data() + row % G * rb;
      }
      float* v = values.data();
      if (q8) {
        cpu::dequantize_q8_0_row(src, v, K);
      } else {
        cpu::dequantize_q4_row(t, src, v, K);
      }
      if (dtype == at::kBFloat16) {
        auto* o = out.data_ptr<at::BFloat16>() + i * K;
        for (int64_t j = 0; j < K; ++j) o[j] = c10::BFloat16(v[j]);
      } else if (dtype == at::kHalf) {
        auto* o = out.data_ptr<at::Half>() + i * K;
        for (int64_t j = 0; j < K; ++j) o[j] = c10::Half(v[j]);
      } else {
        std::memcpy(out.data_ptr<float>() + i * K, v, static_cast<size_t>(K) * sizeof(float));
      }
    }
    return out;
  }
  at::Tensor rows = at::empty({n, rb}, weight.options());
  uint8_t* r = rows.data_ptr<uint8_t>();
  std::vector<uint8_t> group(x8 ? G * rb : 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = id[i];
    TORCH_CHECK_INDEX(row >= 0 && row < N, "index ", row, " is out of range for an embedding table of ", N, " rows");
    if (row >= full) {  // row layout (a row-layout table, or an x8 table's last N % 8 rows)
      std::memcpy(r + i * rb, w + row * rb, rb);
      continue;
    }
    const uint8_t* src = w + row / G * G * rb;
    if (q8) cpu::deinterleave_q8_0_group(src, group.data(), rb, K);
    else cpu::deinterleave_q4_group(t, src, group.data(), rb, K);
    std::memcpy(r + i * rb, group.data() + row % G * rb, rb);
  }
  const at::Tensor values = q8 ? dequantize_q8_0_cpu(rows, false) : dequantize_q4_cpu(rows, rows_kind);
  return values.to(dtype).view(shape);
}

}  // namespace pagewire
