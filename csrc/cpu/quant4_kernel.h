// The torch-free interface of the 4-bit quantised-weight linear kernels (linear_q4.cpp portable,
// linear_q4_avx2.cpp, linear_q4_avx512.cpp). Weight layouts are GGUF's, byte for byte, so tensors
// read from a GGUF file ([N rows][blocks of one row]) are used as they are:
//   Q4_0: 32 values in 18 bytes {fp16 d, 16 bytes q}: value = d * (q - 8)
//   Q4_1: 32 values in 20 bytes {fp16 d, fp16 m, 16 bytes q}: value = d * q + m
//     (Q4_0/Q4_1: byte j holds value j in its low nibble and value j + 16 in its high nibble)
//   Q4_K: 256 values in 144 bytes {fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs,
//     128 bytes q}: sub-block s (32 values) is d * sc[s] * q - dmin * mn[s]; bytes 32c..32c+31
//     hold sub-block 2c in their low nibbles and sub-block 2c + 1 in their high nibbles.
//   MXFP4: 32 values in 17 bytes {u8 E8M0 exponent e, 16 bytes q} (gpt-oss's experts, GGML type
//     MXFP4): value = E2M1(q) * 2^(e - 127) = kMxfp4Values[q] * 2^(e - 128), byte j holding value j
//     low and j + 16 high as in Q4_0. The kernels read each code as kMxfp4Values[q] + 12 (unsigned
//     0..24, a byte shuffle of the nibble) with the block's offset -12 * 2^(e - 128), so the same
//     unsigned x signed dot products and offset FMAs as Q4_0 compute it exactly. (e = 255, the
//     spec's NaN, is read as 2^127, as llama.cpp does.)
// Every kernel works on activations quantised per row to Q8 blocks of 32 (quant_kernel.h), so a
// 4-bit weight block times an activation block is one integer dot product of 32 pairs plus the
// block's offset term (q's offset or min) times the activation block's sum.
#pragma once

#include <cstdint>

namespace pagewire::cpu {

enum class Q4Type : int { kQ4_0 = 0, kQ4_1 = 1, kQ4_K = 2, kMXFP4 = 3 };

constexpr int kQ4_0BlockBytes = 18;   // per 32 values
constexpr int kQ4_1BlockBytes = 20;   // per 32 values
constexpr int kQ4_KBlock = 256;       // values per super-block
constexpr int kQ4_KBlockBytes = 144;  // per 256 values
constexpr int kMxfp4BlockBytes = 17;  // per 32 values

// Twice the E2M1 values (OCP MX table 4), integers; the kernels add kMxfp4Offset to make them unsigned.
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int kMxfp4Offset = 12;

// 2^(e - 128), the scale of kMxfp4Values for exponent byte e, built from its bits (exact; e < 2
// gives the subnormals 2^-128 and 2^-127).
inline float mxfp4_scale(uint8_t e) {
  const uint32_t bits = e >= 2 ? static_cast<uint32_t>(e - 1) << 23 : 0x00200000u << e;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// Values per block and bytes per block of a type.
inline int q4_block_values(Q4Type t) { return t == Q4Type::kQ4_K ? kQ4_KBlock : 32; }
inline int q4_block_bytes(Q4Type t) {
  return t == Q4Type::kQ4_0   ? kQ4_0BlockBytes
         : t == Q4Type::kQ4_1 ? kQ4_1BlockBytes
         : t == Q4Type::kQ4_K ? kQ4_KBlockBytes
                              : kMxfp4BlockBytes;
}

// Activations quantised per row in blocks of 32: x ~= d[b] * q[32 b + j]; s[b] = d[b] * sum_j q.
struct Q8SumActivations {
  const int8_t* q;  // [M, K]
  const float* d;   // [M, K / 32]
  const float* s;   // [M, K / 32]
  int64_t M, K;
};

// Q4_K's packed 6-bit scale and min of sub-block j (0..7), GGUF's get_scale_min_k4.
inline void q4_k_scale_min(int j, const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Dequantises one row of K values (K a multiple of the type's block) to fp32.
void dequantize_q4_row(Q4Type t, const uint8_t* w, float* out, int64_t K);

// The interleaved ("x8") layout of Q4_0 and Q4_1, which the AVX2 kernel reads fastest
// (linear_x8_avx2.cpp). Rows 8g..8g+7 are rearranged within their own bytes so that one 32-byte
// load holds four code bytes (eight values) of each of the eight rows, one row per 32-bit lane:
//   per block b of 32 values: the eight rows' fp16 d (16 bytes), for Q4_1 then their eight fp16 m
//   (16 bytes), then four 32-byte chunks; chunk c holds bytes 4c..4c+3 of each row's 16 code bytes,
//   row r at bytes 4r..4r+3 (so low nibbles are values 4c..4c+3, high nibbles 16+4c..16+4c+3).
// A group occupies exactly its eight rows' bytes (8 * row bytes); the last N % 8 rows of a weight
// stay in GGUF's row layout. Nothing is dequantised: the codes and scales are the same bytes.
constexpr int kQ4Interleave = 8;
inline bool q4_interleavable(Q4Type t) { return t == Q4Type::kQ4_0 || t == Q4Type::kQ4_1; }
// One group: eight GGUF rows (src, row stride row_bytes) -> the group's interleaved bytes, and back.
void interleave_q4_group(Q4Type t, const uint8_t* src, int64_t row_bytes, uint8_t* dst, int64_t K);
void deinterleave_q4_group(Q4Type t, const uint8_t* src, uint8_t* dst, int64_t row_bytes, int64_t K);
// out[m][n] for the first N / 8 * 8 rows of an interleaved weight (the caller runs the remaining
// N % 8 rows, in row layout, through linear_q4_avx2); same arguments as linear_q4_avx2.
void linear_q4x8_avx2(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                      int64_t ldo, int64_t N);  // Isa::kAvx2 or better

// out[m][n] = sum over blocks (+ bias[n]), fp32 out [M, N] with row stride ldo; bias fp32 [N] or
// nullptr; w: [N, K / block * block_bytes] bytes of type t.
void linear_q4_portable(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                        int64_t ldo, int64_t N);
void linear_q4_avx2(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                    int64_t ldo, int64_t N);  // Isa::kAvx2 or better
void linear_q4_avx512(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                      int64_t ldo, int64_t N);  // Isa::kAvx512 or better

}  // namespace pagewire::cpu
