// The AVX2 kernel of Q4_K's interleaved x8 layout (quant4_kernel.h) x Q8 activations. As in the
// Q4_0 / Q4_1 x8 kernels (linear_x8_avx2.cpp), each 32-bit lane carries one of a group's eight
// weight rows, so nothing needs a horizontal sum or a scale shuffle:
//  * per 32-byte chunk (four code bytes of each row: values 4j..4j+3 of sub-blocks 2c and 2c + 1)
//    the activations' matching four bytes are broadcast by the load itself, and maddubs of the
//    low / high nibbles gives every row's pair sums in 16 bits; a sub-block's eight chunks add up
//    in 16 bits (at most 8 chunks * 2 pairs * 15 * 128 = 30,720: no saturation);
//  * the eight rows' packed 6-bit scales and mins are three 32-byte loads per super-block (word w
//    of every row), decoded for all rows at once by 32-bit shifts and masks; each sub-block's byte
//    is picked out by one shuffle (pshufb), and one madd by the sub-block's scale (in both 16-bit
//    halves of each lane) gives scale * dot in 32 bits;
//  * one int32 -> fp32 and one FMA by the activation block's scale per sub-block, the mins' term
//    against the activation blocks' d * sum, then the rows' d and dmin once per super-block.
// Batch invariance (docs/determinism.md): output (m, n) is one lane of one accumulator, updated
// in K order with the same instructions whatever M is; M only decides which rows share a chunk.
#include <omp.h>

#include <cstdint>
#include <cstring>

// Headers first: inline functions they define must keep the baseline ISA.
#include "quant4_kernel.h"
#include "x86_target.h"

PAGEWIRE_TARGET_PUSH("avx2,fma,f16c")

namespace pagewire::cpu {
namespace {

constexpr int kGroupBytes = kQ4Interleave * kQ4_KBlockBytes;  // one super-block of eight rows
constexpr int kCodes = 128;                                    // where the group's codes start

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);  // a vpbroadcastd from memory: a load, no ALU operation
}

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// pshufb controls over a vector holding one byte per sub-block in each row's 32-bit lane: byte k
// of every lane zero-extended into both 16-bit halves (a madd multiplier of two pair sums), or
// into the whole lane (an int32). One shuffle does what a shift, a mask, a shift and an or did.
inline __m256i lane_bytes(uint32_t pattern) {
  return _mm256_add_epi8(_mm256_set1_epi32(static_cast<int32_t>(pattern)),
                         _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808, 0x0C0C0C0C));
}
inline __m256i halves_of_byte(uint32_t k) { return lane_bytes(k | 0x80u << 8 | k << 16 | 0x80u << 24); }
inline __m256i word_of_byte(uint32_t k) { return lane_bytes(k | 0x80u << 8 | 0x80u << 16 | 0x80u << 24); }

// Activation rows [m0, m0 + MB) times one group of eight Q4_K weight rows -> out[m][0..8).
template <int MB>
void group_k(const Q8SumActivations& x, int64_t m0, const uint8_t* w, const float* bias, float* out, int64_t ldo) {
  const int64_t nb = x.K / 32, nsb = x.K / kQ4_KBlock;
  const __m256i mask = _mm256_set1_epi8(0x0F), six = _mm256_set1_epi8(0x3F), top = _mm256_set1_epi8(0x30);
  const int8_t* xq[MB];
  const float* xd[MB];
  const float* xs[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xs[m] = x.s + (m0 + m) * nb;
  }
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s, w += kGroupBytes) {
    for (int off = 0; off < kGroupBytes; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kGroupBytes + off), _MM_HINT_T0);  // the next super-block
    }
    // Scales 0-3 / 4-7 and mins 0-3 / 4-7 of every row, one byte each (q4_k_scale_min's rule).
    const __m256i a = load256(w + 32), b = load256(w + 64), c = load256(w + 96);
    const __m256i sc_lo = _mm256_and_si256(a, six);
    const __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(c, mask), _mm256_and_si256(_mm256_srli_epi32(a, 2), top));
    const __m256i mn_lo = _mm256_and_si256(b, six);
    const __m256i mn_hi =
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(c, 4), mask), _mm256_and_si256(_mm256_srli_epi32(b, 2), top));
    __m256 sa[MB];
    for (int m = 0; m < MB; ++m) sa[m] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int cc = 0; cc < 4; ++cc) {
      __m256i lo16[MB], hi16[MB];
      for (int m = 0; m < MB; ++m) lo16[m] = hi16[m] = _mm256_setzero_si256();
      const uint8_t* wc = w + kCodes + 32 * 8 * cc;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i v = load256(wc + 32 * j);
        const __m256i lo = _mm256_and_si256(v, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        for (int m = 0; m < MB; ++m) {
          const int8_t* xb = xq[m] + (s * 8 + 2 * cc) * 32 + 4 * j;
          lo16[m] = _mm256_add_epi16(lo16[m], _mm256_maddubs_epi16(lo, broadcast4(xb)));
          hi16[m] = _mm256_add_epi16(hi16[m], _mm256_maddubs_epi16(hi, broadcast4(xb + 32)));
        }
      }
      // Sub-blocks 2cc and 2cc + 1's scales, in both 16-bit halves of each row's lane.
      const __m256i src = cc < 2 ? sc_lo : sc_hi;
      const __m256i sc0 = _mm256_shuffle_epi8(src, halves_of_byte((2 * cc) % 4));
      const __m256i sc1 = _mm256_shuffle_epi8(src, halves_of_byte((2 * cc + 1) % 4));
      for (int m = 0; m < MB; ++m) {
        const int64_t blk = s * 8 + 2 * cc;
        sa[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(lo16[m], sc0)), _mm256_set1_ps(xd[m][blk]),
                                sa[m]);
        sa[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(hi16[m], sc1)), _mm256_set1_ps(xd[m][blk + 1]),
                                sa[m]);
      }
    }
    // The mins' term: sum over sub-blocks of mn * (activation block's d * sum).
    __m256 ma[MB];
    for (int m = 0; m < MB; ++m) ma[m] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(j < 4 ? mn_lo : mn_hi, word_of_byte(j % 4)));
      for (int m = 0; m < MB; ++m) ma[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[m][s * 8 + j]), ma[m]);
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm256_fmadd_ps(d, sa[m], acc[m]);
      acc[m] = _mm256_fnmadd_ps(dmin, ma[m], acc[m]);
    }
  }
  const __m256 bv = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + (m0 + m) * ldo, _mm256_add_ps(acc[m], bv));
}

}  // namespace

void linear_q4kx8_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N) {
  const int64_t groups = N / kQ4Interleave, group_bytes = kQ4Interleave * (x.K / kQ4_KBlock) * kQ4_KBlockBytes;
  // Static schedule: each thread streams one contiguous slice of the weight.
#pragma omp parallel for schedule(static) if (N * x.K * x.M >= 65536)
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * group_bytes;
    const float* bg = bias != nullptr ? bias + g * kQ4Interleave : nullptr;
    float* og = out + g * kQ4Interleave;
    int64_t m = 0;
    for (; m + 4 <= x.M; m += 4) group_k<4>(x, m, wg, bg, og, ldo);
    if (m + 2 <= x.M) {
      group_k<2>(x, m, wg, bg, og, ldo);
      m += 2;
    }
    if (m < x.M) group_k<1>(x, m, wg, bg, og, ldo);
  }
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
