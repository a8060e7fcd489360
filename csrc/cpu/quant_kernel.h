// The torch-free interface of the quantised-weight linear kernels (linear_q8.cpp portable,
// linear_q8_avx2.cpp, linear_q8_avx512.cpp). Weight layout is GGUF's Q8_0, byte for byte: each row of K values is K / 32
// blocks of 34 bytes, {fp16 scale d (little-endian), int8 q[32]}, value = d * q. A Q8_0 tensor
// read from a GGUF file ([N rows][K/32 blocks]) can therefore be used as it is.
#pragma once

#include <cstdint>

namespace pagewire::cpu {

constexpr int kQ8Block = 32;       // values per block
constexpr int kQ8BlockBytes = 34;  // 2-byte fp16 scale + 32 int8

// Activations quantised per row on the fly, in the same blocks: x ~= xd[b] * xq[32 b + j].
struct Q8Activations {
  const int8_t* q;   // [M, K]
  const float* d;    // [M, K / 32]
  int64_t M, K;
};

// Quantises x (fp32 [M, K], row stride ldx) into q/d with round-to-nearest (GGUF's rule); when s
// is not null it also gets each block's d * sum_j q (the 4-bit kernels' offset term). The AVX2
// version gives the same bytes and floats (Isa::kAvx2 or better).
void quantize_rows_q8(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* d, float* s);
void quantize_rows_q8_avx2(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* d, float* s);

// bf16 <-> fp32 for the kernels' activations and results (float_rows.h). Widening is exact;
// narrowing rounds to nearest even, ATen's rule, so the bits equal `t.to(kBFloat16)`'s for
// every finite value (a NaN stays a NaN). The AVX2 versions give the same bits (Isa::kAvx2).
void bf16_to_f32(const uint16_t* x, float* out, int64_t n);
void bf16_to_f32_avx2(const uint16_t* x, float* out, int64_t n);
void f32_to_bf16(const float* x, uint16_t* out, int64_t n);
void f32_to_bf16_avx2(const float* x, uint16_t* out, int64_t n);

// out[m][n] = sum_b xd[m][b] * wd[n][b] * sum_j xq * wq (+ bias[n]), fp32 out [M, N] with row
// stride ldo; bias fp32 [N] or nullptr. w: [N, K/32 * 34] Q8_0 bytes.
void linear_q8_0_portable(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                          int64_t N);
void linear_q8_0_avx2(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                      int64_t N);  // Isa::kAvx2 or better
void linear_q8_0_avx512(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                        int64_t N);  // Isa::kAvx512 or better (AVX-512 VNNI)
// AMX (linear_amx.cpp): TDPBSSD per block, then the portable kernel's fp32 arithmetic in the same
// order (separate multiply and add), so the same floats as linear_q8_0_portable.
void linear_q8_0_amx(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                     int64_t N);  // Isa::kAmx

// The interleaved ("x8") layout of Q8_0, which the AVX2 kernel reads fastest (linear_x8_avx2.cpp):
// rows 8g..8g+7 rearranged within their own bytes so that one 32-byte load holds four values of
// each of the eight rows, one row per 32-bit lane. Per block b of 32 values: the eight rows' fp16
// d (16 bytes), then eight 32-byte chunks; chunk c holds values 4c..4c+3 of each row, row r at
// bytes 4r..4r+3. A group occupies exactly its eight rows' bytes (8 * row bytes); the last N % 8
// rows of a weight stay in row layout. The values and scales are the same bytes.
constexpr int kQ8Interleave = 8;
// One group: eight row-layout rows (src, row stride row_bytes) -> the group's interleaved bytes, and back.
void interleave_q8_0_group(const uint8_t* src, int64_t row_bytes, uint8_t* dst, int64_t K);
void deinterleave_q8_0_group(const uint8_t* src, uint8_t* dst, int64_t row_bytes, int64_t K);
// out[m][n] for the first N / 8 * 8 rows of an interleaved weight (the caller runs the remaining
// N % 8 rows, in row layout, through a row kernel); same arguments as linear_q8_0_avx2.
void linear_q8_0x8_avx2(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                        int64_t N);  // Isa::kAvx2 or better
// The same with AVX-512 VNNI (linear_x8_vnni.cpp; Isa::kAvx512 or better): the same floats, bit for bit.
void linear_q8_0x8_vnni(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                        int64_t N);
// The same with AMX tiles (linear_x8_amx.cpp; Isa::kAmx): the x8 kernels' integers and fp32 steps, so
// the same floats again, bit for bit, at any M; used from kAmxMinRows rows where AMX is allowed.
void linear_q8_0x8_amx(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N);

// fp16 bits -> fp32, portable (the scale of a Q8_0 block).
inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// One row-layout Q8_0 row of K values (K / 32 blocks) as fp32: d * q per block, exactly as the
// float64 reference dequantises (the embedding rows and dequantize_q8_rows share it).
inline void dequantize_q8_0_row(const uint8_t* row, float* out, int64_t K) {
  for (int64_t b = 0; b < K / kQ8Block; ++b) {
    const uint8_t* blk = row + b * kQ8BlockBytes;
    const float d = fp16_to_float(static_cast<uint16_t>(blk[0] | (blk[1] << 8)));
    for (int j = 0; j < kQ8Block; ++j) out[b * kQ8Block + j] = d * static_cast<float>(static_cast<int8_t>(blk[2 + j]));
  }
}

}  // namespace pagewire::cpu
