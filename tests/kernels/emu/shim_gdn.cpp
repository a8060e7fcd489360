// C entry points for tests/kernels/test_emulated_gdn.py: the AVX-512 Gated DeltaNet bodies of
// gdn_avx512.cpp (one chunk or one token of one head, one conv row), built by emu_build.py with
// emulated intrinsics.
#include <cstdint>

#include "gdn_kernel.h"

extern "C" void pw_gdn_chunk_avx512(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                    float* state, float* out, float* work, int64_t L, int64_t Dk, int64_t Dv) {
  const pagewire::cpu::GdnChunk c{q, k, v, g, beta, state, out, work, L, Dk, Dv};
  if (L == 1) {
    pagewire::cpu::gdn_step_avx512(c);
  } else {
    pagewire::cpu::gdn_chunk_avx512(c);
  }
}

extern "C" int64_t pw_gdn_work_floats(int64_t L, int64_t Dk, int64_t Dv) {
  return pagewire::cpu::gdn_chunk_work_floats(L, Dk, Dv);
}

extern "C" void pw_gdn_conv_row_avx512(const float* const* rows, const float* wt, float* out, int64_t K, int64_t C) {
  pagewire::cpu::gdn_conv_row_avx512(rows, wt, out, K, C);
}
