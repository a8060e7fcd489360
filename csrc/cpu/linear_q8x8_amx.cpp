// Q8_0's x8 layout (quant_kernel.h) on Intel AMX tiles (Isa::kAmx): linear_q8_0x8_amx, bit for bit
// the x8 kernels' floats (linear_x8_avx2.cpp, linear_x8_vnni.cpp). The row-layout AMX kernels are
// linear_amx.cpp's; the tile plumbing both use is amx_tiles.h.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

// Headers first: inline functions they define must keep the baseline ISA.
#include "amx_tiles.h"
#include "quant_kernel.h"
#include "x86_target.h"

PAGEWIRE_TARGET_PUSH("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx2,fma,f16c")

namespace pagewire::cpu {
namespace {

using amx::compiler_barrier;
using amx::kGroups;
using amx::kRows;
using amx::my_slice;
using amx::TileConfig;

// Q8_0 in the x8 layout (quant_kernel.h), the layout every x86 family keeps Q8_0 weights in. Here
// the roles swap: the activations are the A tile (src1: up to 16 rows of xq, one block's 32 bytes
// each, loaded straight from xq with the row stride K, no transpose), and the weight is the B tile
// (src2): a group's block is eight 32-byte chunks, chunk c holding bytes 4c..4c+3 of each of its
// eight rows, which is AMX's B layout for eight columns (K/4 = 8 rows of 32 bytes), loaded with
// stride 32. TDPBSSD into a zeroed C [mc][8] gives each row's exact dot with the block, the same
// integer the x8 kernels' maddubs / vpdpbusd sums give; the fp32 step is theirs too, acc = fma(wd,
// float(dot) * xd, acc) per block in K order, then + bias: so the floats are linear_q8_0x8_vnni's
// (and _avx2's) bit for bit, whatever M, and batch-invariant mode may use it as well.
// Tiles: C 0..3 (four groups of eight weight rows), A 4, B 5 and 6 alternating.

struct Q8x8Call {
  const uint8_t* w;
  const float* bias;
  float* out;
  int64_t ldo, K, nb, group_bytes;
  const int8_t* xq;
  const float* xd;
};

constexpr int kX8Rows = 8;                    // weight rows per x8 group (quant_kernel.h kQ8Interleave)
constexpr int kX8BlockBytes = 16 + 8 * 32;    // a group's block: eight fp16 d, then eight chunks

// The tile shapes for mc activation rows; loaded once per thread and shape.
class X8Tiles {
 public:
  ~X8Tiles() {
    if (loaded_) _tile_release();
  }
  void shape(int mc) {
    if (loaded_ && mc == mc_) return;
    TileConfig cfg;
    for (int t = 0; t < kGroups; ++t) {
      cfg.rows[t] = static_cast<uint8_t>(mc);
      cfg.colsb[t] = static_cast<uint16_t>(kX8Rows * 4);
    }
    cfg.rows[4] = static_cast<uint8_t>(mc);
    cfg.colsb[4] = static_cast<uint16_t>(kQ8Block);
    for (int t = 5; t <= 6; ++t) {
      cfg.rows[t] = static_cast<uint8_t>(kQ8Block / 4);
      cfg.colsb[t] = static_cast<uint16_t>(kX8Rows * 4);
    }
    compiler_barrier();
    _tile_loadconfig(&cfg);
    loaded_ = true;
    mc_ = mc;
  }

 private:
  int mc_ = 0;
  bool loaded_ = false;
};

// G consecutive x8 groups from group g0 against activation rows [m0, m0 + mc).
template <int G>
void q8x8_step(const Q8x8Call& c, X8Tiles& tiles, int64_t g0, int64_t m0, int mc) {
  tiles.shape(mc);
  const uint8_t* w = c.w + g0 * c.group_bytes;
  const int8_t* xq = c.xq + m0 * c.K;
  const float* xd = c.xd + m0 * c.nb;
  __m256 acc[G][kRows];
  for (int g = 0; g < G; ++g) {
    for (int m = 0; m < kRows; ++m) acc[g][m] = _mm256_setzero_ps();
  }
  alignas(64) int32_t dots[G][kRows][kX8Rows];
  std::memset(dots, 0, sizeof dots);
  compiler_barrier();
  for (int64_t b = 0; b < c.nb; ++b) {
    const int64_t off = b * kX8BlockBytes;
    _tile_loadd(4, xq + b * kQ8Block, c.K);
#define PW_Q8X8_GROUP(g, t)                                                                  \
  if constexpr (G > g) {                                                                     \
    const uint8_t* wb = w + g * c.group_bytes + off;                                         \
    _mm_prefetch(reinterpret_cast<const char*>(wb + 4 * kX8BlockBytes), _MM_HINT_T0);        \
    _mm_prefetch(reinterpret_cast<const char*>(wb + 4 * kX8BlockBytes + 64), _MM_HINT_T0);   \
    _mm_prefetch(reinterpret_cast<const char*>(wb + 4 * kX8BlockBytes + 128), _MM_HINT_T0);  \
    _mm_prefetch(reinterpret_cast<const char*>(wb + 4 * kX8BlockBytes + 192), _MM_HINT_T0);  \
    _mm_prefetch(reinterpret_cast<const char*>(wb + 4 * kX8BlockBytes + 256), _MM_HINT_T0);  \
    _tile_zero(g);                                                                           \
    _tile_loadd(t, wb + 16, kX8Rows * 4);                                                    \
    _tile_dpbssd(g, 4, t);                                                                   \
  }
    PW_Q8X8_GROUP(0, 5)
    PW_Q8X8_GROUP(1, 6)
    PW_Q8X8_GROUP(2, 5)
    PW_Q8X8_GROUP(3, 6)
#undef PW_Q8X8_GROUP
    if constexpr (G > 0) _tile_stored(0, dots[0], kX8Rows * 4);
    if constexpr (G > 1) _tile_stored(1, dots[1], kX8Rows * 4);
    if constexpr (G > 2) _tile_stored(2, dots[2], kX8Rows * 4);
    if constexpr (G > 3) _tile_stored(3, dots[3], kX8Rows * 4);
    compiler_barrier();
    __m256 wd[G];
    for (int g = 0; g < G; ++g) {
      wd[g] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * c.group_bytes + off)));
    }
    for (int m = 0; m < mc; ++m) {
      const __m256 xdm = _mm256_set1_ps(xd[m * c.nb + b]);
      for (int g = 0; g < G; ++g) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dots[g][m])));
        acc[g][m] = _mm256_fmadd_ps(wd[g], _mm256_mul_ps(dot, xdm), acc[g][m]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m256 bv = c.bias != nullptr ? _mm256_loadu_ps(c.bias + (g0 + g) * kX8Rows) : _mm256_setzero_ps();
    for (int m = 0; m < mc; ++m) {
      _mm256_storeu_ps(c.out + (m0 + m) * c.ldo + (g0 + g) * kX8Rows, _mm256_add_ps(acc[g][m], bv));
    }
  }
}

}  // namespace

void linear_q8_0x8_amx(const Q8Activations& x, const uint8_t* w, const float* bias, float* out, int64_t ldo,
                       int64_t N) {
  const int64_t M = x.M, K = x.K, groups = N / kX8Rows;
  if (M <= 0 || groups <= 0) return;
  const int64_t nb = K / kQ8Block;
  const Q8x8Call call{w, bias, out, ldo, K, nb, kX8Rows * nb * kQ8BlockBytes, x.q, x.d};
  // Static split over the groups (each thread streams one contiguous slice of the weight), each
  // step four groups against every chunk of 16 activation rows.
#pragma omp parallel if (N * K * M >= 65536)
  {
    X8Tiles tiles;
    int64_t g0, g1;
    my_slice(groups, &g0, &g1);
    for (int64_t g = g0; g < g1; g += kGroups) {
      const int count = static_cast<int>(std::min<int64_t>(kGroups, g1 - g));
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int mc = static_cast<int>(std::min<int64_t>(kRows, M - m0));
        switch (count) {
          case 4: q8x8_step<4>(call, tiles, g, m0, mc); break;
          case 3: q8x8_step<3>(call, tiles, g, m0, mc); break;
          case 2: q8x8_step<2>(call, tiles, g, m0, mc); break;
          default: q8x8_step<1>(call, tiles, g, m0, mc); break;
        }
      }
    }
  }
}

}  // namespace pagewire::cpu

PAGEWIRE_TARGET_POP
