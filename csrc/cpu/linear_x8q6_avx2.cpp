// The AVX2 kernel of Q6_K's interleaved x8 layout (quant4_kernel.h) x Q8 activations. As in the
// Q4_K x8 kernel (linear_x8k_avx2.cpp), each 32-bit lane carries one of a group's eight weight
// rows, so nothing needs a horizontal sum or a per-row scale shuffle:
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
// Against the row kernel this saves, per 32 values and row, the sign/abs pair, the scale's lane
// permute and shuffle, and the final horizontal sums.
// Batch invariance (docs/determinism.md): output (m, n) is one lane of one accumulator, updated
// in K order with the same instructions whatever M is; integer parts are exact.
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

// Headers first: inline functions they define must keep the baseline ISA.
#include "quant4_kernel.h"
#include "x86_target.h"

PAGEWIRE_TARGET_PUSH("avx2,fma,f16c")

namespace pagewire::cpu {
namespace {

constexpr int kGroupBytes = kQ4Interleave * kQ6_KBlockBytes;  // one super-block of eight rows
constexpr int kScales = 16, kQl = 16 + 128, kQh = kQl + 1024;   // where the group's parts start

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// pshufb control: byte k of each 32-bit lane into the high byte of both of its 16-bit halves (the
// low bytes zeroed), so that an arithmetic shift right by 8 sign-extends it into each half.
inline __m256i high_bytes(int k) {
  const uint32_t p = 0x80u | static_cast<uint32_t>(k) << 8 | 0x80u << 16 | static_cast<uint32_t>(k) << 24;
  return _mm256_add_epi8(_mm256_set1_epi32(static_cast<int32_t>(p)),
                         _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808, 0x0C0C0C0C));
}

// Activation rows [m0, m0 + MB) times one group of eight Q6_K weight rows -> out[m][0..8).
// x16: per activation row, 16 * the sum of each 16 activation codes in both 16-bit halves (K / 16 of them).
template <int MB>
void group_q6(const Q8SumActivations& x, const int32_t* x16, int64_t m0, const uint8_t* w, const float* bias,
              float* out, int64_t ldo) {
  const int64_t nb = x.K / 32, nsb = x.K / kQ4_KBlock, n16 = x.K / 16;
  const __m256i mask = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const int8_t* xq[MB];
  const float* xd[MB];
  const int32_t* xs[MB];
  for (int m = 0; m < MB; ++m) {
    xq[m] = x.q + (m0 + m) * x.K;
    xd[m] = x.d + (m0 + m) * nb;
    xs[m] = x16 + (m0 + m) * n16;
  }
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s, w += kGroupBytes) {
    for (int off = 0; off < kGroupBytes; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kGroupBytes + off), _MM_HINT_T0);  // the next super-block
    }
    __m256 sa[MB];
    for (int m = 0; m < MB; ++m) sa[m] = _mm256_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      for (int t = 0; t < 4; ++t) {
        const int j = 4 * h + t;  // the sub-block (32 values)
        __m256i i32[MB];
        for (int m = 0; m < MB; ++m) i32[m] = _mm256_setzero_si256();
        for (int hh = 0; hh < 2; ++hh) {
          // Scale 2j + hh of each row, sign-extended into both 16-bit halves of its lane: a shuffle
          // puts the byte in each half's high byte, an arithmetic shift brings it down.
          const int idx = 2 * j + hh;
          const __m256i sc = _mm256_srai_epi16(
              _mm256_shuffle_epi8(load256(w + kScales + 32 * (idx / 4)), high_bytes(idx % 4)), 8);
          for (int pair = 0; pair < 2; ++pair) {
            __m256i p16[MB];
            for (int m = 0; m < MB; ++m) p16[m] = _mm256_setzero_si256();
            for (int u = 0; u < 2; ++u) {
              const int c = 4 * hh + 2 * pair + u;  // values 4c..4c+3 of the sub-block
              const __m256i ql = load256(w + kQl + 32 * (16 * h + 8 * (t % 2) + c));
              const __m256i qh = load256(w + kQh + 32 * (8 * h + c));
              const __m256i lo = t < 2 ? _mm256_and_si256(ql, mask) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), mask);
              const __m256i hi = t == 0   ? _mm256_slli_epi16(qh, 4)
                                 : t == 1 ? _mm256_slli_epi16(qh, 2)
                                 : t == 2 ? qh
                                          : _mm256_srli_epi16(qh, 2);
              const __m256i codes = _mm256_or_si256(lo, _mm256_and_si256(hi, top));
              for (int m = 0; m < MB; ++m) {
                p16[m] = _mm256_add_epi16(p16[m], _mm256_maddubs_epi16(codes, broadcast4(xq[m] + j * 32 + s * 256 + 4 * c)));
              }
            }
            for (int m = 0; m < MB; ++m) i32[m] = _mm256_add_epi32(i32[m], _mm256_madd_epi16(p16[m], sc));
          }
          // The codes' offset: - scale * 32 * (sum of the half's activation codes), as one madd of
          // the scale by 16 * sum in both 16-bit halves (|16 * sum| <= 32,768: prepared per call).
          for (int m = 0; m < MB; ++m) {
            i32[m] = _mm256_sub_epi32(i32[m], _mm256_madd_epi16(sc, _mm256_set1_epi32(xs[m][s * 16 + idx])));
          }
        }
        for (int m = 0; m < MB; ++m) {
          sa[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[m]), _mm256_set1_ps(xd[m][s * 8 + j]), sa[m]);
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_fmadd_ps(d, sa[m], acc[m]);
  }
  const __m256 bv = bias != nullptr ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out + (m0 + m) * ldo, _mm256_add_ps(acc[m], bv));
}

}  // namespace

void linear_q6kx8_avx2(const Q8SumActivations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N) {
  const int64_t groups = N / kQ4Interleave, group_bytes = kQ4Interleave * (x.K / kQ4_KBlock) * kQ6_KBlockBytes;
  const int64_t n16 = x.K / 16;
  // Per calling thread, reused across calls: each 16 activation codes' sum (the offset term's).
  thread_local std::vector<int32_t> x16;
  if (static_cast<int64_t>(x16.size()) < x.M * n16) x16.resize(x.M * n16);
  for (int64_t i = 0; i < x.M * n16; ++i) {
    int32_t sum = 0;
    for (int k = 0; k < 16; ++k) sum += x.q[i * 16 + k];
    // 16 * sum in both 16-bit halves: madd by a scale in both halves gives scale * 32 * sum.
    const uint32_t half = static_cast<uint16_t>(static_cast<int16_t>(16 * sum));
    x16[i] = static_cast<int32_t>(half | half << 16);
  }
  const int32_t* xs = x16.data();
  // Static schedule: each thread streams one contiguous slice of the weight.
#pragma omp parallel for schedule(static) if (N * x.K * x.M >= 65536)
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * group_bytes;
    const float* bg = bias != nullptr ? bias + g * kQ4Interleave : nullptr;
    float* og = out + g * kQ4Interleave;
    int64_t m = 0;
    for (; m + 2 <= x.M; m += 2) group_q6<2>(x, xs, m, wg, bg, og, ldo);
    if (m < x.M) group_q6<1>(x, xs, m, wg, bg, og, ldo);
  }
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
