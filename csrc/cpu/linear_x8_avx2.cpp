// The AVX2 kernels of the interleaved x8 layouts (Q8_0 in quant_kernel.h, Q4_0 / Q4_1 in
// quant4_kernel.h; Q5_0 / Q5_1 / IQ4_NL / IQ4_XS's groups in x8_q5nl_body.h), x Q8 activations. Each 32-bit lane carries one weight row, so a block needs no
// horizontal sum and no scale shuffle:
//  * per 32-byte chunk (four values of each of eight rows for Q8_0, eight for 4-bit) the
//    activation's matching four bytes are broadcast to every lane by the load itself, and maddubs
//    gives every row's pair sums in 16 bits: Q8_0 as |w| times x with w's sign moved onto it (|w|
//    taken once per chunk for all activation rows), 4-bit as the masked low / high nibbles times x;
//  * Q8_0 widens each chunk's pair sums to 32 bits and adds them up over the block's eight chunks;
//    4-bit adds a block's four chunks up in 16 bits (at most 4 chunks * 2 maddubs * 2 pairs * 15 *
//    128 = 30,720 < 32,767, so nothing saturates), then widens once;
//  * one int32 -> fp32 and two FMAs finish the block for all eight rows: acc += d * (dot * xd) for
//    Q8_0, acc += d * (dot * xd - 8 xs) for Q4_0, acc += d * (dot * xd) + m * xs for Q4_1 (xs: the
//    activation block's d * sum of codes); the eight rows' fp16 scales are contiguous, one conversion.
// Against the row-layout kernels (linear_q8_avx2.cpp, linear_q4_avx2.cpp) that is about a third
// fewer vector operations for Q8_0 and 40 % fewer for 4-bit, and each thread reads one sequential
// stream instead of four row streams, which the prefetchers follow. Measured at M = 1: Q8_0 1.7x
// from L2, 1.3-1.7x from DRAM (at the read bandwidth); 4-bit 2.2x and 1.6-1.8x (bench/RESULTS.md).
//
// With several activation rows (M >= 2) the kernels are bound by the vector pipes, not memory: a
// tile of up to four rows times two weight groups shares each activation broadcast between the two
// groups, and the block sums are pinned in registers (see pin). Issue 31, one thread, 1024 x 1024
// from cache: Q4_1 M = 16 280 -> 208 us, Q4_0 270 -> 198 us, Q8_0 341 -> 299 us (bench/RESULTS.md).
//
// Batch invariance (docs/determinism.md): output (m, n) is one lane of one accumulator, updated
// block by block in K order with the same instructions whatever M is; M only decides which
// activation rows share a loaded chunk.
// Headers first (x8_body.h's own includes then add nothing): inline functions they define must keep
// the baseline ISA.
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_features.h"
#include "quant4_kernel.h"
#include "quant_kernel.h"
#include "x86_target.h"

PAGEWIRE_TARGET_PUSH("avx2,fma,f16c")

#define PAGEWIRE_X8_VNNI 0
#include "x8_body.h"

namespace pagewire::cpu {

void linear_q8_0x8_avx2(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                        int64_t N) {
  run8(x, w, bias, out, ldo, N);
}

void linear_q4x8_avx2(Q4Type t, const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out,
                      int64_t ldo, int64_t N) {
  if (t == Q4Type::kQ4_K) {
    linear_q4kx8_avx2(x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ2_K) {
    linear_q2kx8_avx2(x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ3_K) {
    linear_q3kx8_avx2(x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ5_K) {
    linear_q5kx8_avx2(x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ6_K) {
    linear_q6kx8_avx2(x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ4_0) {
    run4<Q4Type::kQ4_0>(x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ4_1) {
    run4<Q4Type::kQ4_1>(x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ5_0) {
    run4<Q4Type::kQ5_0>(x, w, bias, out, ldo, N);
  } else if (t == Q4Type::kQ5_1) {
    run4<Q4Type::kQ5_1>(x, w, bias, out, ldo, N);
  } else if (q_is_xs(t) || q_is_x16(t)) {  // IQ4_XS's layout (and the types held in it) or its x16 form
    run_iq4xs(t, x, w, bias, out, ldo, N);
  } else {
    run4<Q4Type::kIQ4_NL>(x, w, bias, out, ldo, N);
  }
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
