// The K-quant kernels of the interleaved x8 layouts (quant4_kernel.h) x Q8 activations: Q4_K's
// (run_q4k), Q5_K's (run_q5k: Q4_K's body with each chunk's fifth bits ORed in), Q6_K's (run_q6k),
// Q2_K's (run_q2k, x8k_q2_body.h) and Q3_K's (run_q3k, x8k_q3_body.h), compiled twice:
// linear_x8k_avx2.cpp (PAGEWIRE_X8_VNNI 0: maddubs pair sums in 16 bits, widened by a madd with the
// sub-block's scale) and linear_x8k_vnni.cpp
// (PAGEWIRE_X8_VNNI 1: AVX-512 VNNI's 256-bit vpdpbusd adds four products straight into 32 bits,
// and one vpmulld applies the scale). Both builds add the same integer products exactly (no
// saturation on either side, bounds below), so every output is the same float, bit for bit
// (tests/kernels/test_emulated_x8_vnni.py, test_interleaved.py natively). The VNNI build spends
// about a third fewer vector operations per row and sub-block, which is what limits these kernels:
// at M = 1 they run below the read bandwidth on an AMX Xeon (Llama-1B Q4_K_M at 49 % MBU).
//
// Q4_K, as in the Q4_0 / Q4_1 x8 kernels (x8_body.h), each 32-bit lane carries one of a group's
// eight weight rows, so nothing needs a horizontal sum or a scale shuffle:
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
//
// Q6_K, the same lane per row:
//  * per 32-byte ql chunk and its qh chunk (four values of each row) the 6-bit codes are built by
//    shifts and masks as in the row kernel, and kept unsigned (0..63): maddubs of the codes and the
//    activations' matching four bytes (broadcast by the load) gives every row's pair sums in 16
//    bits; two chunks add up in 16 bits (at most 2 * 2 * 63 * 127 = 32,004: no saturation);
//  * one madd by the 16-value half's int8 scale (sign-extended into both 16-bit halves of each
//    lane; the eight rows' sixteen scales are four 32-byte loads per super-block) gives scale * dot
//    in 32 bits, and the codes' offset of 32 is taken off in integers: scale * 32 * (sum of the
//    half's sixteen activation codes), those sums computed once per call;
//  * one int32 -> fp32 and one FMA by the activation block's scale per sub-block, the rows' d
//    once per super-block.
//
// Batch invariance (docs/determinism.md): output (m, n) is one lane of one accumulator, updated
// in K order with the same instructions whatever M is; M only decides which rows share a chunk.
#ifndef PAGEWIRE_X8_VNNI
#error "define PAGEWIRE_X8_VNNI (0 or 1) before including x8k_body.h"
#endif

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_features.h"  // (the including file includes it first, before its target switch)
#include "quant4_kernel.h"
#include "team_kernel.h"

namespace pagewire::cpu {
namespace {

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);  // a vpbroadcastd from memory: a load, no ALU operation
}

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The group's super-block Ahead blocks on, one line at a time, into the cache level Hint names.
//  * Q6_K, and Q4_K in the AVX2 build (tuned on a Zen 3): the next super-block, into L1.
//  * Q4_K in the VNNI build: two super-blocks on (2,304 bytes, as x8_body.h's VNNI distance),
//    into L2. Measured on an AMX Xeon with weights streamed from DRAM, one activation row: 55.5
//    -> 47.5 us at 1536 x 1024 and 90.8 -> 77 us at 1024 x 2816 (the row-layout kernel's speed; at
//    one super-block ahead the kernel took as long for one row as for four: waiting on memory).
//    Q6_K there lost 5-10 % at two ahead, so it keeps one (bench/RESULTS.md, session 22).
template <int Ahead, int Hint>
inline void prefetch_ahead(const uint8_t* w, int group_bytes) {
  for (int off = 0; off < group_bytes; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w + Ahead * group_bytes + off), static_cast<_mm_hint>(Hint));
  }
}
inline void prefetch_next(const uint8_t* w, int group_bytes) {
  for (int off = 0; off < group_bytes; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w + group_bytes + off), _MM_HINT_T0);
  }
}
#if PAGEWIRE_X8_VNNI
inline void prefetch_q4k(const uint8_t* w, int group_bytes) { prefetch_ahead<2, _MM_HINT_T1>(w, group_bytes); }
#else
inline void prefetch_q4k(const uint8_t* w, int group_bytes) { prefetch_next(w, group_bytes); }
#endif
// Single groups (one sequential stream through a thread's groups) on AMD, VNNI build (a Zen 5,
// session 25): Q4_K eight super-blocks on (9,216 bytes, into L2) and Q6_K four (6,720, into L1).
// Batch-1 steps of Llama-1B Q4_K_M alternating in one process: 10.30 ms against 11.49 with the
// Xeon's distances above (9,216 / 1,680: 10.47; 4,608 / 3,360: 10.83).
inline bool far_streams() { return PAGEWIRE_X8_VNNI && is_amd(); }
// Pairs of groups (group_k2, group_q62: two streams a group apart) on AMD take the same distances,
// and past a group's end the next pair's group rather than the other stream's (x8_body.h's
// pair_ahead rule). Q4_K / Q6_K x8 against the row layout at 8 rows: 0.38-0.44x / 0.41-0.44x
// against 0.48-0.69x / 0.43-0.60x with the Xeon's distances; at 4 rows 0.54-0.65x / 0.45-0.55x
// against 0.71-1.05x / 0.61-0.90x (bench/RESULTS.md, session 26).
inline bool far_pairs() { return far_streams(); }
// Q6_K's single groups on an AMD Zen 4, VNNI build: six super-blocks on (10,080 bytes) into L2. The
// Zen 5's four into L1 made the kernel's speed erratic there (one thread, 32000 x 1024 streamed
// from DRAM: 7.8-17 GB/s between runs against 21-26 GB/s), and a Llama-1B Q4_K_M batch-1 step
// took 21.3-25.9 ms against 20.3-21.1 (bench/RESULTS.md, session 31).
inline bool far_q6_into_l2() { return PAGEWIRE_X8_VNNI && is_amd_zen4(); }
// Both streams of a pair at super-block s of nsb (the other group gb bytes on): with `far`, Ahead
// super-blocks on into Hint's cache level, past the group's end the next pair's group (skipping the
// other stream's); otherwise each stream's own single-group rule, Near.
template <int Ahead, int Hint, void (*Near)(const uint8_t*, int)>
__attribute__((always_inline)) inline void prefetch_pair(const uint8_t* w, int group_bytes, int64_t s, int64_t nsb,
                                                         int64_t gb, bool far) {
  if (far) {
    const int64_t at = Ahead * group_bytes + (s + Ahead >= nsb ? gb : 0);
    for (int off = 0; off < group_bytes; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + at + off), static_cast<_mm_hint>(Hint));
      _mm_prefetch(reinterpret_cast<const char*>(w + gb + at + off), static_cast<_mm_hint>(Hint));
    }
  } else {
    Near(w, group_bytes);
    Near(w + gb, group_bytes);
  }
}

namespace q4k {

constexpr int kGroupBytes = kQ4Interleave * kQ4_KBlockBytes;  // one super-block of eight rows
constexpr int kCodes = 128;                                    // where the group's codes start



// pshufb controls over a vector holding one byte per sub-block in each row's 32-bit lane: byte k
// of every lane zero-extended into both 16-bit halves (a madd multiplier of two pair sums), or
// into the whole lane (an int32). One shuffle does what a shift, a mask, a shift and an or did.
inline __m256i lane_bytes(uint32_t pattern) {
  return _mm256_add_epi8(_mm256_set1_epi32(static_cast<int32_t>(pattern)),
                         _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808, 0x0C0C0C0C));
}
inline __m256i halves_of_byte(uint32_t k) { return lane_bytes(k | 0x80u << 8 | k << 16 | 0x80u << 24); }
inline __m256i word_of_byte(uint32_t k) { return lane_bytes(k | 0x80u << 8 | 0x80u << 16 | 0x80u << 24); }

// A sub-block's dot times its scale, both per 32-bit lane, as int32: the AVX2 build's dot is two
// 16-bit pair sums and its scale sits in both halves (one madd); the VNNI build's dot is one 32-bit
// sum and its scale the whole lane (one vpmulld). |scale * dot| <= 63 * 61,440: exact either way.
inline __m256i scaled(__m256i dot, __m256i scale) {
#if PAGEWIRE_X8_VNNI
  return _mm256_mullo_epi32(dot, scale);
#else
  return _mm256_madd_epi16(dot, scale);
#endif
}

// Q5_K's group: Q4_K's bytes, then the eight rows' fifth bits (quant4_kernel.h).
constexpr int kGroupBytes5 = kQ4Interleave * kQ5_KBlockBytes;
constexpr int kHigh = kGroupBytes;  // where a Q5_K group's qh chunks start

// Bit b of each byte of v moved to bit 4 (16-bit shifts; the caller masks what crossed from the
// neighbouring byte). b is a constant once the sub-block loop is unrolled.
inline __m256i bit_to_4(__m256i v, int b) {
  return b < 4 ? _mm256_slli_epi16(v, 4 - b) : b > 4 ? _mm256_srli_epi16(v, b - 4) : v;
}

// Activation rows [m0, m0 + MB) times one group of eight Q4_K (Five: Q5_K) weight rows -> out[m][0..8).
// Q5_K's codes reach 31: a pair sum 2 * 31 * 128, so the AVX2 build widens a sub-block's 16-bit
// sums after four chunks (at most 31,744) and after eight, adding the two scaled halves in 32 bits
// (the VNNI build's sums are 32-bit already); the same integer, scale * dot, either way.
template <int MB, bool Five = false>
void group_k(const Q8SumActivations& x, int64_t m0, const uint8_t* w, const float* bias, float* out, int64_t ldo) {
  constexpr int group_bytes = Five ? kGroupBytes5 : kGroupBytes;
  const int64_t nb = x.K / 32, nsb = x.K / kQ4_KBlock;
  const __m256i mask = _mm256_set1_epi8(0x0F), six = _mm256_set1_epi8(0x3F), top = _mm256_set1_epi8(0x30);
  [[maybe_unused]] const __m256i five = _mm256_set1_epi8(0x10);
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
  const bool far = far_streams();
  for (int64_t s = 0; s < nsb; ++s, w += group_bytes) {
    if (far) {
      prefetch_ahead<8, _MM_HINT_T1>(w, group_bytes);
    } else {
      prefetch_q4k(w, group_bytes);
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
      const __m256i src = cc < 2 ? sc_lo : sc_hi;
#if PAGEWIRE_X8_VNNI
      // Sub-blocks 2cc and 2cc + 1's scales as whole 32-bit lanes: scale * dot by one vpmulld, the
      // same integer the AVX2 build's madd of the two pair sums gives.
      const __m256i sc0 = _mm256_shuffle_epi8(src, word_of_byte((2 * cc) % 4));
      const __m256i sc1 = _mm256_shuffle_epi8(src, word_of_byte((2 * cc + 1) % 4));
#else
      // Sub-blocks 2cc and 2cc + 1's scales, in both 16-bit halves of each row's lane.
      const __m256i sc0 = _mm256_shuffle_epi8(src, halves_of_byte((2 * cc) % 4));
      const __m256i sc1 = _mm256_shuffle_epi8(src, halves_of_byte((2 * cc + 1) % 4));
#endif
      // Per row, the sub-block's dot: 16-bit pair sums (AVX2) or 32-bit sums of four (VNNI).
      __m256i lo16[MB], hi16[MB];
      [[maybe_unused]] __m256i lo32[MB], hi32[MB];  // (Q5_K, AVX2: the first four chunks, scaled)
      for (int m = 0; m < MB; ++m) lo16[m] = hi16[m] = _mm256_setzero_si256();
      const uint8_t* wc = w + kCodes + 32 * 8 * cc;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i v = load256(wc + 32 * j);
        __m256i lo = _mm256_and_si256(v, mask);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        if constexpr (Five) {  // bits 2cc and 2cc + 1 of each qh byte: the two sub-blocks' fifth bits
          const __m256i h = load256(w + kHigh + 32 * j);
          lo = _mm256_or_si256(lo, _mm256_and_si256(bit_to_4(h, 2 * cc), five));
          hi = _mm256_or_si256(hi, _mm256_and_si256(bit_to_4(h, 2 * cc + 1), five));
        }
        for (int m = 0; m < MB; ++m) {
          const int8_t* xb = xq[m] + (s * 8 + 2 * cc) * 32 + 4 * j;
#if PAGEWIRE_X8_VNNI
          lo16[m] = _mm256_dpbusd_epi32(lo16[m], lo, broadcast4(xb));
          hi16[m] = _mm256_dpbusd_epi32(hi16[m], hi, broadcast4(xb + 32));
#else
          lo16[m] = _mm256_add_epi16(lo16[m], _mm256_maddubs_epi16(lo, broadcast4(xb)));
          hi16[m] = _mm256_add_epi16(hi16[m], _mm256_maddubs_epi16(hi, broadcast4(xb + 32)));
          if constexpr (Five) {
            if (j == 3) {  // widen the first four chunks' sums before a fifth could pass 32,767
              lo32[m] = scaled(lo16[m], sc0);
              hi32[m] = scaled(hi16[m], sc1);
              lo16[m] = hi16[m] = _mm256_setzero_si256();
            }
          }
#endif
        }
      }
      for (int m = 0; m < MB; ++m) {
        const int64_t blk = s * 8 + 2 * cc;
        __m256i dlo = scaled(lo16[m], sc0), dhi = scaled(hi16[m], sc1);
#if !PAGEWIRE_X8_VNNI
        if constexpr (Five) {
          dlo = _mm256_add_epi32(dlo, lo32[m]);
          dhi = _mm256_add_epi32(dhi, hi32[m]);
        }
#endif
        sa[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dlo), _mm256_set1_ps(xd[m][blk]), sa[m]);
        sa[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dhi), _mm256_set1_ps(xd[m][blk + 1]), sa[m]);
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



}  // namespace q4k

#include "x8k_q6_body.h"  // q6k::group_q6 and its helpers
#include "x8k_q2_body.h"  // q2k::group_q2
#include "x8k_q3_body.h"  // q3k::group_q3 (after q6k's shuffle controls, which it shares)

#if PAGEWIRE_X8_VNNI
#include "x8k_pairs.h"  // group_k2, group_q62
#endif

// Activation rows per pass over a group's weights. Q6_K's VNNI build, eight: at several rows these
// kernels are bound by compute, not memory, and Q6_K's per-row chains (four vpdpbusd into one
// accumulator, a vpmulld, the offset's madd) are latency-bound with two rows in flight (AVX-512VL
// gives the VNNI build 32 vector registers; some spill at eight rows and it still wins): 2048 x
// 8192 at 8 rows 3.47 -> 1.91 ms, 32768 x 2048 15.5 -> 8.8 (RESULTS, session 24). Q4_K took the
// same time at eight as at four. The AVX2 build (16 registers, tuned on a Zen 3) keeps two.
constexpr int kQ4KRows = 4;
constexpr int kQ6KRows = PAGEWIRE_X8_VNNI ? 8 : 2;
// Rows a pass of group_q62 (two groups per 512-bit vector, from two rows): eight. At four the
// pairs lost to single groups at eight rows a pass (2048 x 8192, M = 8: 1.065 against 0.990 ms);
// at eight they win (0.801; RESULTS, session 24).
constexpr int kQ6KPairRows = 8;

// pass(std::integral_constant<int, MB>{}, m) over activation rows [0, M), each pass one read of a
// group's weights for MB rows: passes of Big rows, one of 4 (when Big > 4), then the 1-3 rows left
// in one pass (3 rows had taken a pass of 2 and one of 1: Q6_K 5632 x 1024 at 3 rows cost 1.2x
// its 4; RESULTS, session 24). Which rows share a pass never changes a row's floats.
template <int Big, class Pass>
void row_passes(int64_t M, const Pass& pass) {
  int64_t m = 0;
  for (; m + Big <= M; m += Big) pass(std::integral_constant<int, Big>{}, m);
  if constexpr (Big > 4) {
    if (m + 4 <= M) {
      pass(std::integral_constant<int, 4>{}, m);
      m += 4;
    }
  }
  const int64_t left = M - m;
  if constexpr (Big > 3) {
    if (left == 3) return pass(std::integral_constant<int, 3>{}, m);
  }
  if constexpr (Big > 2) {
    if (left == 2) return pass(std::integral_constant<int, 2>{}, m);
  }
  if (left == 1) pass(std::integral_constant<int, 1>{}, m);
}

// Runs fn(wg, bg, og, left) over the weight's groups of eight rows, Per groups a unit of the
// team's split: wg / bg / og are the unit's first group's weights, bias (or null) and output
// columns, and left the groups from there to the end (a unit of pairs gets left == 1 at an odd
// end). One place for the pointer arithmetic every run_* below shares.
template <int Per, class Fn>
void team_groups(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t N,
                 int64_t group_bytes, const Fn& fn) {
  const int64_t groups = N / kQ4Interleave;
  team_for((groups + Per - 1) / Per, N * x.K * x.M >= 65536, [&](int64_t u) {
    const int64_t g = Per * u;
    fn(w + g * group_bytes, bias != nullptr ? bias + g * kQ4Interleave : nullptr, out + g * kQ4Interleave,
       groups - g);
  });
}

// Per calling thread, reused across calls (each thread of a fused_linear team prepares its own),
// and read through a plain pointer inside the parallel loop: a kernel's per-call activation sums.
template <class T>
T* call_scratch(int64_t n) {
  thread_local std::vector<T> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// Q5_K: one group a unit (the VNNI build's pairs, x8k_pairs.h, are Q4_K's alone), kQ5KRows rows a
// pass (the AVX2 build's 16 registers hold two rows' four sums beside the codes and fifth bits).
constexpr int kQ5KRows = PAGEWIRE_X8_VNNI ? 4 : 2;
void run_q5k(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t N) {
  const int64_t group_bytes = kQ4Interleave * (x.K / kQ4_KBlock) * kQ5_KBlockBytes;
  team_groups<1>(x, w, bias, out, N, group_bytes, [&](const uint8_t* wg, const float* bg, float* og, int64_t) {
    row_passes<kQ5KRows>(x.M, [&](auto mb, int64_t m) {
      q4k::group_k<decltype(mb)::value, true>(x, m, wg, bg, og, ldo);
    });
  });
}

// Q2_K: one group a unit, kQ2KRows rows a pass. AVX2 (16 registers), on a Zen 3, two builds
// alternating (bench.kernels quant --types q2_k, x8 column): two rows a pass took 0.72-0.78x one
// row's time at 4 rows of 1536 x 1024 and 0.6-0.9x at 16 (some spills, fewer weight passes).
constexpr int kQ2KRows = PAGEWIRE_X8_VNNI ? 4 : 2;
void run_q2k(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t N) {
  const int64_t group_bytes = kQ4Interleave * (x.K / kQ4_KBlock) * kQ2_KBlockBytes;
  float* s16 = call_scratch<float>(x.M * (x.K / 16));
  q2k::prepare_q2_sums(x, s16);
  team_groups<1>(x, w, bias, out, N, group_bytes, [&](const uint8_t* wg, const float* bg, float* og, int64_t) {
    row_passes<kQ2KRows>(x.M, [&](auto mb, int64_t m) {
      q2k::group_q2<decltype(mb)::value>(x, s16, m, wg, bg, og, ldo);
    });
  });
}

// Q3_K: one group a unit, kQ3KRows rows a pass, as Q2_K, whose register use it shares. The VNNI
// build's four against two, both types, on a Zen 4 (weights in cache, two threads, six alternating
// rounds of each build; RESULTS, session 44): at 4-16 rows four took 0.97-0.99x the best time for
// Q3_K and 0.94-0.95x for Q2_K. The AVX2 build's two was measured for Q2_K only.
constexpr int kQ3KRows = PAGEWIRE_X8_VNNI ? 4 : 2;
void run_q3k(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t N) {
  const int64_t group_bytes = kQ4Interleave * (x.K / kQ4_KBlock) * kQ3_KBlockBytes;
  const int64_t n16 = x.K / 16;
  int32_t* xs = call_scratch<int32_t>(x.M * n16);
  q3k::prepare_q3_sums(x.q, x.M * n16, xs);
  team_groups<1>(x, w, bias, out, N, group_bytes, [&](const uint8_t* wg, const float* bg, float* og, int64_t) {
    row_passes<kQ3KRows>(x.M, [&](auto mb, int64_t m) {
      q3k::group_q3<decltype(mb)::value>(x, xs, m, wg, bg, og, ldo);
    });
  });
}

// Several rows on the VNNI build: pairs of groups (x8k_pairs.h, a lone last group on its own),
// while there are pairs enough for every thread of the split. One row stays on single groups,
// bound by memory there, where one group per unit keeps each thread on one sequential stream.
inline bool use_pairs(const Q8SumActivations& x, int64_t N) {
  return PAGEWIRE_X8_VNNI && x.M >= 2 && N / kQ4Interleave >= 4 * team_threads();
}

void run_q4k(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t N) {
  const int64_t group_bytes = kQ4Interleave * (x.K / kQ4_KBlock) * kQ4_KBlockBytes;
#if PAGEWIRE_X8_VNNI
  if (use_pairs(x, N)) {
    team_groups<2>(x, w, bias, out, N, group_bytes, [&](const uint8_t* wg, const float* bg, float* og, int64_t left) {
      if (left >= 2) {
        row_passes<4>(x.M, [&](auto mb, int64_t m) {
          q4k::group_k2<decltype(mb)::value>(x, m, wg, group_bytes, bg, og, ldo);
        });
      } else {
        row_passes<kQ4KRows>(x.M, [&](auto mb, int64_t m) { q4k::group_k<decltype(mb)::value>(x, m, wg, bg, og, ldo); });
      }
    });
    return;
  }
#endif
  team_groups<1>(x, w, bias, out, N, group_bytes, [&](const uint8_t* wg, const float* bg, float* og, int64_t) {
    row_passes<kQ4KRows>(x.M, [&](auto mb, int64_t m) { q4k::group_k<decltype(mb)::value>(x, m, wg, bg, og, ldo); });
  });
}

void run_q6k(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo, int64_t N) {
  const int64_t group_bytes = kQ4Interleave * (x.K / kQ4_KBlock) * kQ6_KBlockBytes;
  const int64_t n16 = x.K / 16;
  // Each 16 activation codes' sum (the offset term's).
  int32_t* xs = call_scratch<int32_t>(x.M * n16);
  q6k::prepare_q6_sums(x.q, x.M * n16, xs);
  const auto single = [&](const uint8_t* wg, const float* bg, float* og) {
    row_passes<kQ6KRows>(x.M, [&](auto mb, int64_t m) { q6k::group_q6<decltype(mb)::value>(x, xs, m, wg, bg, og, ldo); });
  };
#if PAGEWIRE_X8_VNNI
  if (use_pairs(x, N)) {
    team_groups<2>(x, w, bias, out, N, group_bytes, [&](const uint8_t* wg, const float* bg, float* og, int64_t left) {
      if (left < 2) return single(wg, bg, og);
      row_passes<kQ6KPairRows>(x.M, [&](auto mb, int64_t m) {
        q6k::group_q62<decltype(mb)::value>(x, xs, m, wg, group_bytes, bg, og, ldo);
      });
    });
    return;
  }
#endif
  team_groups<1>(x, w, bias, out, N, group_bytes,
                 [&](const uint8_t* wg, const float* bg, float* og, int64_t) { single(wg, bg, og); });
}

}  // namespace

}  // namespace pagewire::cpu
