// The packed ("bf16z") layout of a bf16 matrix: the x8 layout's bytes (linear_kernel.h) at 12 bits
// a value, losslessly. A bf16 value is a low byte (the exponent's last bit and the 7 mantissa
// bits) and a high byte (the sign and the exponent's upper 7 bits). A trained or random-normal
// weight row uses few high bytes: every value of a row within ~15 binades of its largest. Each row
// keeps a table of its 16 most frequent high bytes, and a value is stored as its low byte plus a
// 4-bit code into the table. Where a value's high byte is not in its row's table, the 256 values
// of that step (two 16-value chunks of the group's eight rows) stay as the x8 layout's plain 512
// bytes: a "raw" step, flagged in the group's bitmap. Decoding is a byte shuffle of the codes
// through the table and a byte interleave with the low bytes, each step in the order the x8
// kernel's vdpbf16ps pairs read, so the packed kernel adds exactly the products the x8 kernel
// adds, in its order: the same bits as the row-layout kernel at every M
// (linear_bf16x8_avx512.cpp). Read bandwidth bounds single-stream decode; 12.5 bits instead of 16
// is that many fewer bytes a token.
//
// The buffer (64-byte aligned throughout):
//   Header (64 bytes), then int64 group_at[groups], padded to 64 bytes;
//   per group of eight rows, at group_at[g]:
//     tables: each row's 16 high bytes (128 bytes; the kernel makes vpshufb's per-lane tables of
//             them: rows 2q and 2q + 1 in one register, two 128-bit lanes each);
//     bitmap: one bit per step (1 = raw), in uint64 words; tables and bitmap padded to 64 bytes;
//     steps:  step s (chunks 2s and 2s + 1) is 384 bytes packed or 512 raw, in order;
//     when K / 16 is odd, the last chunk in the x8 layout (256 bytes).
//   at tail_at: the last N % 8 rows in row layout (bf16).
// A packed step holds per row pair q (rows 2q, 2q + 1) 64 low bytes at q * 64 and 32 code bytes at
// 256 + q * 32 (every load within one cache line). With wa = the x8 pair (q, chunk 2s) and
// wb = (q, chunk 2s + 1), 32 words each: low byte L * 16 + j is wa's word L * 8 + j's, and
// L * 16 + 8 + j wb's (j < 8, lane L < 4: vpunpck{l,h}bw's order); code byte b holds the code of
// byte position b in its low nibble and of b + 32 in its high one.
#pragma once

#include <cstdint>
#include <vector>

namespace pagewire::cpu::bf16z {

constexpr uint64_t kMagic = 0x31316632'315A5750ULL;  // "PWZ12f11" (a packed bf16z buffer, version 1)
constexpr int64_t kRows = 8;                         // rows per group (the x8 layout's)
constexpr int64_t kChunk = 16;                       // values per row per chunk
constexpr int64_t kStepValues = 2 * kChunk * kRows;  // 256
constexpr int64_t kPackedStepBytes = 384;
constexpr int64_t kRawStepBytes = 512;
constexpr int64_t kCodesAt = 256;    // where a packed step's code bytes start
constexpr int64_t kTableBytes = 128;
constexpr int64_t kCodes = 16;       // high bytes a row's table holds

struct Header {
  uint64_t magic;
  int64_t n, k, groups;
  int64_t tail_at;  // byte offset of the last N % 8 rows
  int64_t total;    // bytes used (the tensor may be padded past it)
  int64_t pad[2];
};
static_assert(sizeof(Header) == 64, "the header is one cache line");

inline int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }
inline int64_t steps(int64_t K) { return K / (2 * kChunk); }
inline int64_t bitmap_bytes(int64_t K) { return (steps(K) + 63) / 64 * 8; }
inline int64_t group_head_bytes(int64_t K) { return align64(kTableBytes + bitmap_bytes(K)); }
inline int64_t index_bytes(int64_t groups) { return align64(64 + groups * 8); }

inline const Header& header(const uint8_t* buf) { return *reinterpret_cast<const Header*>(buf); }
inline const int64_t* group_at(const uint8_t* buf) { return reinterpret_cast<const int64_t*>(buf + 64); }

// One group's parts.
struct Group {
  const uint8_t* tables;
  const uint64_t* raw;  // the steps' bitmap
  const uint8_t* steps;

  Group(const uint8_t* buf, int64_t g, int64_t K)
      : tables(buf + group_at(buf)[g]),
        raw(reinterpret_cast<const uint64_t*>(tables + kTableBytes)),
        steps(tables + group_head_bytes(K)) {}
  bool is_raw(int64_t s) const { return (raw[s >> 6] >> (s & 63)) & 1; }
  int64_t step_bytes(int64_t s) const { return is_raw(s) ? kRawStepBytes : kPackedStepBytes; }
};

// A thread's copy of one unpacked group (kRows * K values), 64-byte aligned like a tensor's data
// (a vector's 16-byte alignment split every other 32-byte load across two lines: 5-12 % slower
// tiles). Reused across calls by its thread.
inline uint16_t* group_scratch(int64_t K) {
  thread_local std::vector<uint16_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < kRows * K + 32) buffer.resize(kRows * K + 32);
  const auto at = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<uint16_t*>((at + 63) / 64 * 64);
}

// The AVX512-BF16 kernels (linear_bf16x8_avx512.cpp). out = x @ w^T + bias as linear_bf16_avx512,
// bit for bit, from the packed buffer (any M).
void linear_bf16z_avx512(const uint16_t* x, int64_t ldx, const uint8_t* packed, const uint16_t* bias, uint16_t* out,
                         int64_t ldo, int64_t M);
// The same on AVX2 + FMA (linear_bf16x8_avx2.cpp): linear_bf16_avx2's result, bit for bit (any M).
void linear_bf16z_avx2(const uint16_t* x, int64_t ldx, const uint8_t* packed, const uint16_t* bias, uint16_t* out,
                       int64_t ldo, int64_t M);
// Groups [g0, g1) back into row layout: rows 8 * g0 .. 8 * g1 - 1 at dst (row r at (r - 8 g0) * K).
void unpack_bf16z_avx512(const uint8_t* packed, int64_t g0, int64_t g1, uint16_t* dst);
void unpack_bf16z_avx2(const uint8_t* packed, int64_t g0, int64_t g1, uint16_t* dst);

}  // namespace pagewire::cpu::bf16z
