// The torch-free interface of the batched LoRA kernel's bodies (lora_avx2.cpp, and the portable
// one in lora.cpp): for one fused projection, every row's own adapter term in one call,
//
//   out[t, part.row + j] += round(round(scale[a] * round(sum_c B_p[a][j, c] * u[t, c])))
//   u[t, c] = round(sum_k A[a][c, k] * x[t, k])                           a = adapter[t] >= 0
//
// with the rounding of PEFT in the model's dtype (round: to the storage type; identity for fp32):
// lora_A's output, lora_B's, the scaling and the sum each materialise a tensor there. The adapters
// are stacked ragged: A [R, in] holds, per part (a PEFT module of the fused matrix: q, k, v of qkv),
// every adapter's rows that target it, and the part's Bᵀ [C_p, rows_p] the same columns against its
// own output rows; spans[a][p] = (first row of A, rank) of adapter a in part p (rank 0: it does not
// target that module). One shrink runs over all of a row's parts (q, k and v read one x row).
//
// Every output value is one fixed-order sum whichever other rows share the call, and the bodies of
// every ISA share one template (lora_body.h) whose 8-lane arithmetic the portable body copies with
// scalar fma, so a row's result depends neither on its batch nor on the CPU's family.
#pragma once

#include <cstdint>

namespace pagewire::cpu {

enum class LoraDtype : int { kF32 = 0, kBf16 = 1, kF16 = 2 };

// Rows of one adapter shrunk and expanded together (each A and Bᵀ line loaded once for all).
constexpr int kLoraGroupRows = 4;
// The output columns of one expand task (its fp32 sums, kLoraGroupRows x kLoraBlock, stay in L1).
constexpr int64_t kLoraBlock = 512;

struct LoraGroup {
  int32_t adapter, n;
  int32_t rows[kLoraGroupRows];
};

struct LoraPart {
  int64_t row, rows, c0;  // first output column, output columns, first row of A it covers
  const void* bt;         // [C_p, rows] contiguous, of the storage type
};

struct LoraProblem {
  LoraDtype dtype;
  const void* x;
  int64_t ldx;  // [T, in]
  void* out;
  int64_t ldo;  // [T, N], updated in place
  const void* a;
  int64_t in;  // [R, in] contiguous
  const LoraPart* parts;
  int64_t P;
  const int32_t* spans;  // [n, P, 2]: (first row of A, rank)
  const int32_t* off;    // [n, P]: the part's first column in u's row
  const float* scales;   // [n]
  const LoraGroup* groups;
  float* u;  // [T, ldu] scratch: the shrink's output, already rounded to the storage type
  int64_t ldu;
};

// Shrink task: group g's rows against its adapter's local columns col and col + 1 (when below
// its total); expand task: part p's output columns [j0, j1) (j1 - j0 <= kLoraBlock) for every
// group. Every shrink task must finish before any expand task starts.
void lora_shrink_avx2(const LoraProblem& pb, int64_t g, int64_t col);
void lora_expand_avx2(const LoraProblem& pb, int64_t p, int64_t j0, int64_t j1, int64_t ngroups);
void lora_shrink_portable(const LoraProblem& pb, int64_t g, int64_t col);
void lora_expand_portable(const LoraProblem& pb, int64_t p, int64_t j0, int64_t j1, int64_t ngroups);

}  // namespace pagewire::cpu
