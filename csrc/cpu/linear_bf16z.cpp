// The packed bf16 ops (cpu/bf16z_layout.h: the x8 layout at 12.5 bits a value, lossless):
// pack_bf16z (bf16 [N, K] -> the packed buffer, at load), unpack_bf16z (back to bf16 [N, K]),
// linear_bf16z (x @ w^T + bias: linear_bf16z_avx512 on AVX512-BF16 CPUs up to 256 rows, above it
// ATen's GEMM on unpacked chunks of rows; linear_bf16z_avx2 on AVX2 at every M; each bitwise the
// family's pagewire::linear result), and embedding_bf16z (rows gathered from a packed tied table).
// The code here is baseline C++, so that any CPU reads a packed buffer (below AVX2, fp32
// activations: unpacked, ATen).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "../ops.h"
#include "bf16z_layout.h"
#include "chunked_gemm.h"
#include "cpu_features.h"
#include "dispatch_mode.h"
#include "float_rows.h"

namespace pagewire {

namespace {

using namespace cpu::bf16z;

// Rows up to which the kernel runs (linear_bf16x8.cpp's kKernelMaxRowsAvx512: above one pair of
// rows it unpacks each group's span into L1 and runs that kernel's tiles); above it, ATen's GEMM.
constexpr int64_t kBf16zKernelMaxRows = 256;

// A row's table: its 16 most frequent high bytes, most frequent first (ties: the smaller byte), and
// each high byte's code (-1: not in the table). A row with fewer distinct bytes repeats its first.
struct RowTable {
  std::array<uint8_t, kCodes> hi{};
  std::array<int8_t, 256> code{};

  explicit RowTable(const uint16_t* row, int64_t K) {
    std::array<int64_t, 256> count{};
    for (int64_t k = 0; k < K; ++k) ++count[row[k] >> 8];
    std::array<int, 256> order;
    for (int i = 0; i < 256; ++i) order[i] = i;
    std::partial_sort(order.begin(), order.begin() + kCodes, order.end(),
                      [&](int a, int b) { return count[a] != count[b] ? count[a] > count[b] : a < b; });
    code.fill(-1);
    for (int i = 0; i < kCodes; ++i) {
      const bool used = count[order[i]] > 0 || i == 0;
      hi[i] = static_cast<uint8_t>(used ? order[i] : order[0]);
      if (used) code[order[i]] = static_cast<int8_t>(i);
    }
  }
};

// Value j (< 16) of chunk c of a group's row (rows: the group's first row).
inline uint16_t at(const uint16_t* w, int64_t K, int64_t row, int64_t c, int64_t j) { return w[row * K + c * 16 + j]; }

// One group's parts as pack_bf16z lays them: the row tables and which steps stay raw.
struct GroupPlan {
  std::vector<RowTable> rows;
  std::vector<uint64_t> raw;
  int64_t raws = 0;
};

GroupPlan plan_group(const uint16_t* w, int64_t K, int64_t g) {
  GroupPlan plan;
  for (int64_t r = 0; r < kRows; ++r) plan.rows.emplace_back(w + (g * kRows + r) * K, K);
  const int64_t S = steps(K);
  plan.raw.assign((S + 63) / 64, 0);
  for (int64_t s = 0; s < S; ++s) {
    bool raw = false;
    for (int64_t r = 0; r < kRows && !raw; ++r) {
      const uint16_t* row = w + (g * kRows + r) * K + s * 32;
      for (int64_t j = 0; j < 32; ++j) raw |= plan.rows[r].code[row[j] >> 8] < 0;
    }
    if (raw) {
      plan.raw[s >> 6] |= uint64_t{1} << (s & 63);
      ++plan.raws;
    }
  }
  return plan;
}

int64_t group_bytes(int64_t K, int64_t raws) {
  const int64_t S = steps(K);
  return align64(group_head_bytes(K) + (S - raws) * kPackedStepBytes + raws * kRawStepBytes + (K / 16 % 2) * 256);
}

void write_group(const uint16_t* w, int64_t K, int64_t g, const GroupPlan& plan, uint8_t* dst) {
  const uint16_t* rows = w + g * kRows * K;
  for (int r = 0; r < kRows; ++r) std::memcpy(dst + r * kCodes, plan.rows[r].hi.data(), kCodes);
  std::memcpy(dst + kTableBytes, plan.raw.data(), plan.raw.size() * 8);
  uint8_t* p = dst + group_head_bytes(K);
  const int64_t S = steps(K);
  auto put_chunk = [&](int64_t c) {  // the x8 layout's chunk c: rows 0..7, 16 values each
    for (int64_t r = 0; r < kRows; ++r) {
      std::memcpy(p, rows + r * K + c * 16, 32);
      p += 32;
    }
  };
  for (int64_t s = 0; s < S; ++s) {
    if ((plan.raw[s >> 6] >> (s & 63)) & 1) {
      put_chunk(2 * s);
      put_chunk(2 * s + 1);
      continue;
    }
    for (int q = 0; q < 4; ++q) {
      uint8_t* lo = p + q * 64;
      uint8_t codes[64];
      for (int L = 0; L < 4; ++L) {
        const int64_t row = 2 * q + L / 2;
        for (int j = 0; j < 8; ++j) {
          const int64_t v = (L % 2) * 8 + j;  // the row's value within the chunk
          const uint16_t a = at(rows, K, row, 2 * s, v), b = at(rows, K, row, 2 * s + 1, v);
          lo[L * 16 + j] = static_cast<uint8_t>(a);
          lo[L * 16 + 8 + j] = static_cast<uint8_t>(b);
          codes[L * 16 + j] = static_cast<uint8_t>(plan.rows[row].code[a >> 8]);
          codes[L * 16 + 8 + j] = static_cast<uint8_t>(plan.rows[row].code[b >> 8]);
        }
      }
      for (int b = 0; b < 32; ++b) p[kCodesAt + q * 32 + b] = static_cast<uint8_t>(codes[b] | codes[b + 32] << 4);
    }
    p += kPackedStepBytes;
  }
  if (K / 16 % 2) put_chunk(K / 16 - 1);
}

// Row r (< 8) of a packed group, portably.
void unpack_row(const Group& G, int64_t K, int64_t r, uint16_t* dst) {
  const uint8_t* p = G.steps;
  const int q = static_cast<int>(r / 2);
  const uint8_t* table = G.tables + r * kCodes;
  for (int64_t s = 0; s < steps(K); ++s) {
    if (G.is_raw(s)) {
      for (int e = 0; e < 2; ++e) std::memcpy(dst + (2 * s + e) * 16, p + e * 256 + r * 32, 32);
      p += kRawStepBytes;
      continue;
    }
    const uint8_t* lo = p + q * 64;
    const uint8_t* codes = p + kCodesAt + q * 32;
    for (int v = 0; v < 16; ++v) {
      const int L = static_cast<int>(r % 2) * 2 + v / 8, j = v % 8;
      for (int e = 0; e < 2; ++e) {
        const int pos = L * 16 + e * 8 + j;
        const int code = pos < 32 ? codes[pos] & 15 : codes[pos - 32] >> 4;
        dst[(2 * s + e) * 16 + v] = static_cast<uint16_t>(table[code] << 8 | lo[pos]);
      }
    }
    p += kPackedStepBytes;
  }
  if (K / 16 % 2) std::memcpy(dst + (K / 16 - 1) * 16, p + r * 32, 32);
}

const uint8_t* check_packed(const at::Tensor& w, int64_t k) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "weight must be a contiguous CPU uint8 tensor (a packed bf16z buffer), got ", w.scalar_type(), " ",
              w.sizes());
  const uint8_t* buf = w.data_ptr<uint8_t>();
  TORCH_CHECK(w.numel() >= 64 && header(buf).magic == kMagic, "weight: not a packed bf16z buffer (pack_bf16z makes one)");
  const Header& h = header(buf);
  TORCH_CHECK(h.n == w.size(0) && h.total <= w.numel() && h.groups == h.n / kRows,
              "weight: a packed bf16z buffer of ", h.n, " rows, ", h.total, " bytes, held in ", w.sizes());
  TORCH_CHECK(k < 0 || h.k == k, "k = ", k, " does not match the packed weight's K = ", h.k);
  return buf;
}

// Rows [8 g0, 8 g1) into row layout at dst: the family's vector unpack where the CPU has one.
void unpack_groups(const uint8_t* buf, int64_t g0, int64_t g1, uint16_t* dst) {
  const int64_t K = header(buf).k;
  if (cpu::active_isa() >= cpu::Isa::kAvx512Bf16) {
    cpu::bf16z::unpack_bf16z_avx512(buf, g0, g1, dst);
    return;
  }
  if (cpu::active_isa() >= cpu::Isa::kAvx2) {
    cpu::bf16z::unpack_bf16z_avx2(buf, g0, g1, dst);
    return;
  }
  for (int64_t g = g0; g < g1; ++g) {
    const Group G(buf, g, K);
    for (int64_t r = 0; r < kRows; ++r) unpack_row(G, K, r, dst + ((g - g0) * kRows + r) * K);
  }
}

}  // namespace

at::Tensor pack_bf16z_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "weight must be a CPU bf16 [N, K] tensor, got ", weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(weight.size(1) % 16 == 0 && weight.size(1) > 0 && weight.size(0) > 0, "weight: K = ", weight.size(1),
              " must be a positive multiple of 16 (and N > 0) for the packed bf16 layout");
  const at::Tensor wc = weight.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), groups = N / kRows;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  std::vector<GroupPlan> plans(groups);
#pragma omp parallel for schedule(dynamic, 4) if (groups > 1 && N * K >= 65536)
  for (int64_t g = 0; g < groups; ++g) plans[g] = plan_group(w, K, g);
  std::vector<int64_t> offsets(groups);
  int64_t at_byte = index_bytes(groups);
  for (int64_t g = 0; g < groups; ++g) {
    offsets[g] = at_byte;
    at_byte += group_bytes(K, plans[g].raws);
  }
  const int64_t tail_at = at_byte, total = tail_at + (N - groups * kRows) * K * 2;
  at::Tensor out = at::zeros({N, (total + N - 1) / N}, wc.options().dtype(at::kByte));
  uint8_t* buf = out.data_ptr<uint8_t>();
  Header h{kMagic, N, K, groups, tail_at, total, {0, 0}};
  std::memcpy(buf, &h, sizeof h);
  std::memcpy(buf + 64, offsets.data(), groups * 8);
#pragma omp parallel for schedule(dynamic, 4) if (groups > 1 && N * K >= 65536)
  for (int64_t g = 0; g < groups; ++g) write_group(w, K, g, plans[g], buf + offsets[g]);
  std::memcpy(buf + tail_at, w + groups * kRows * K, (N - groups * kRows) * K * 2);
  return out;
}

at::Tensor unpack_bf16z_cpu(const at::Tensor& weight, int64_t k) {
  const uint8_t* buf = check_packed(weight, k);
  const Header& h = header(buf);
  at::Tensor out = at::empty({h.n, h.k}, weight.options().dtype(at::kBFloat16));
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
#pragma omp parallel for schedule(static) if (h.groups > 1 && h.n * h.k >= 65536)
  for (int64_t g = 0; g < h.groups; ++g) unpack_groups(buf, g, g + 1, o + g * kRows * h.k);
  std::memcpy(o + h.groups * kRows * h.k, buf + h.tail_at, (h.n - h.groups * kRows) * h.k * 2);
  return out;
}

at::Tensor embedding_bf16z_cpu(const at::Tensor& ids, const at::Tensor& weight, int64_t k) {
  const uint8_t* buf = check_packed(weight, k);
  const Header& h = header(buf);
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong, "ids must be a CPU int64 tensor, got ",
              ids.scalar_type(), " on ", ids.device());
  const at::Tensor ic = ids.contiguous();
  std::vector<int64_t> shape(ic.sizes().begin(), ic.sizes().end());
  shape.push_back(h.k);
  at::Tensor out = at::empty(shape, weight.options().dtype(at::kBFloat16));
  const int64_t* id = ic.data_ptr<int64_t>();
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t t = 0; t < ic.numel(); ++t) {
    const int64_t row = id[t];
    TORCH_CHECK_INDEX(row >= 0 && row < h.n, "index ", row, " is out of range for an embedding table of ", h.n, " rows");
    if (row >= h.groups * kRows) {
      std::memcpy(o + t * h.k, buf + h.tail_at + (row - h.groups * kRows) * h.k * 2, h.k * 2);
    } else {
      unpack_row(Group(buf, row / kRows, h.k), h.k, row % kRows, o + t * h.k);
    }
  }
  return out;
}

at::Tensor linear_bf16z_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const uint8_t* buf = check_packed(weight, -1);
  const Header& h = header(buf);
  const int64_t N = h.n, K = h.k;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K, "x must be a CPU [M, K] tensor with K = ", K,
              ", got ", x.sizes(), " on ", x.device());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be floating point, got ", x.scalar_type());
  const bool has_bias = cpu::check_bias(bias, N, x);
  const bool kernel = x.scalar_type() == at::kBFloat16 && cpu::active_isa() >= cpu::Isa::kAvx2 && !x.requires_grad();
  const bool avx512 = cpu::active_isa() >= cpu::Isa::kAvx512Bf16;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t M = xc.size(0);
  // AVX2 has no native bf16 GEMM and runs the kernel at every M (as linear_bf16x8_cpu).
  if (!kernel || (avx512 && M > kBf16zKernelMaxRows && !cpu::batch_invariant_mode)) {
    // Long prefill chunks (and CPUs without the kernel): ATen's GEMM on unpacked chunks of rows,
    // one buffer per calling thread reused across chunks and calls (linear_bf16x8_cpu's reasons).
    thread_local std::vector<uint16_t> buffer;
    return cpu::chunked_gemm(xc, N, bias, has_bias, [&](int64_t n0, int64_t rows) {
      if (static_cast<int64_t>(buffer.size()) < rows * K) buffer.resize(rows * K);
      // n0 is a multiple of 8 (chunked_gemm never splits a group); the chunk's rows past the last
      // group are the row-layout tail's.
      const int64_t done = h.groups * kRows, g0 = n0 / kRows, g1 = std::min(done, n0 + rows) / kRows;
      uint16_t* dst = buffer.data();  // (this thread's buffer: the team's threads each have their own)
#pragma omp parallel for schedule(static) if (g1 - g0 > 1)
      for (int64_t g = g0; g < g1; ++g) unpack_groups(buf, g, g + 1, dst + (g - g0) * kRows * K);
      const int64_t t0 = std::max(done, n0);
      if (n0 + rows > t0) {
        std::memcpy(buffer.data() + (t0 - n0) * K, buf + h.tail_at + (t0 - done) * K * 2, (n0 + rows - t0) * K * 2);
      }
      return at::from_blob(buffer.data(), {rows, K}, weight.options().dtype(at::kBFloat16));
    });
  }
  const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  (avx512 ? cpu::bf16z::linear_bf16z_avx512 : cpu::bf16z::linear_bf16z_avx2)(
      reinterpret_cast<const uint16_t*>(xc.data_ptr()), xc.stride(0), buf,
      has_bias ? reinterpret_cast<const uint16_t*>(bc.data_ptr()) : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr()),
      N, M);
  return out;
}

}  // namespace pagewire
