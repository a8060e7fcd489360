// Small AVX2 helpers shared by the AVX2 kernel files (linear_avx2.cpp, linear_q8_avx2.cpp,
// linear_q4_avx2.cpp, linear_q5nl_avx2.cpp, linear_q2k_avx2.cpp, ...). Include it after the file's target switch to "avx2,fma,f16c".
#pragma once

#include "x86_target.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pagewire::cpu::avx2 {

// The fp16 at p (a block's scale in GGUF's bytes) as a float (F16C).
inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The row-layout kernels' tiles of activation rows: tile(std::integral_constant<int, MB>{}, m0) over
// [0, M) in tiles of four rows, then one tile of the 1-3 rows left. (A row's floats never depend on
// its tile: batch invariance, docs/determinism.md.)
template <class Tile>
inline void row_tiles(int64_t M, const Tile& tile) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile(std::integral_constant<int, 4>{}, m);
  switch (M - m) {
    case 3:
      tile(std::integral_constant<int, 3>{}, m);
      break;
    case 2:
      tile(std::integral_constant<int, 2>{}, m);
      break;
    case 1:
      tile(std::integral_constant<int, 1>{}, m);
      break;
    default:
      break;
  }
}

// The sum of v's eight lanes, in one fixed order: deterministic mode (docs/determinism.md) relies
// on every kernel reducing an output the same way for every row count.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The fp16 numbers at p, p + Stride, ..., p + 7 * Stride as eight fp32 lanes: the scales of eight
// consecutive quantised blocks of one row. The 16-bit loads and shifts run on the scalar ALUs,
// which the integer dot products leave idle (a vector gather is slower on Zen 3); one vector
// conversion replaces eight scalar ones.
template <int Stride>
inline __m256 fp16_strided8(const uint8_t* p) {
  uint16_t h[8];
  for (int j = 0; j < 8; ++j) std::memcpy(&h[j], p + j * Stride, 2);
  const uint64_t lo = h[0] | uint64_t{h[1]} << 16 | uint64_t{h[2]} << 32 | uint64_t{h[3]} << 48;
  const uint64_t hi = h[4] | uint64_t{h[5]} << 16 | uint64_t{h[6]} << 32 | uint64_t{h[7]} << 48;
  return _mm256_cvtph_ps(_mm_set_epi64x(static_cast<int64_t>(hi), static_cast<int64_t>(lo)));
}

// How far ahead the quantised kernels prefetch: kPrefetchRows weight rows, at the offset they are
// reading. They stream NR rows side by side, which the hardware prefetcher follows poorly; one
// prefetch per row and block (or pair of blocks), spread through the loop rather than bunched,
// keeps a steady number of lines in flight.
constexpr int kPrefetchRows = 8;

inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

}  // namespace pagewire::cpu::avx2
