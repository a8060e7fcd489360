// The AMX tile intrinsics used by csrc/cpu/linear_amx.cpp, in portable C++, for the emulated
// kernel builds (tests/kernels/emu_build.py; included by x86_emu.h). Each thread has its own tile
// state, as on the hardware: eight tiles of up to 16 rows x 64 bytes plus the palette that
// _tile_loadconfig set. Every instruction touches only the rows and bytes its tile's config gives
// it and zeroes the rest of the tile, as Intel's pseudo-code (SDM vol. 2, "TILELOADD",
// "TDPBF16PS", "TDPBSSD") does, so a kernel whose tail handling relies on stale tile contents, or on
// bytes outside its configured shape, gets different numbers here and fails its test.
//
// Faults: where the hardware raises #GP or #UD (a bad config, a tile used before configuration,
// operand shapes that do not fit), this aborts with a message; a silent wrong answer would hide
// the kernel bug the check is there to catch.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace pagewire_amx_emu {

constexpr int kTiles = 8, kMaxRows = 16, kMaxColsb = 64;

struct Tile {
  int rows = 0, colsb = 0;  // the configured shape; 0 x 0 = not configured
  alignas(64) uint8_t data[kMaxRows][kMaxColsb] = {};
};

struct State {
  bool configured = false;
  Tile t[kTiles];
};

inline State& state() {
  static thread_local State s;  // AMX state is per thread (XSAVE'd with the thread's context)
  return s;
}

[[noreturn]] inline void fault(const char* what) {
  std::fprintf(stderr, "amx_emu: %s (the hardware would fault)\n", what);
  std::abort();
}

inline void zero_all() {
  for (Tile& t : state().t) std::memset(t.data, 0, sizeof t.data);
}

inline void release() {  // TILERELEASE: back to the init state (no config, all tiles zero)
  State& s = state();
  s.configured = false;
  for (Tile& t : s.t) t.rows = t.colsb = 0;
  zero_all();
}

// LDTILECFG from the 64-byte layout: byte 0 palette_id, byte 1 start_row, bytes 2..15 reserved
// (zero), uint16 colsb[16] at byte 16, uint8 rows[16] at byte 48. Palette 0 is the init state;
// palette 1 has 8 tiles of at most 16 rows x 64 bytes. Loading a config zeroes every tile.
inline void loadconfig(const void* cfg) {
  const uint8_t* c = static_cast<const uint8_t*>(cfg);
  if (c[0] == 0) {
    release();
    return;
  }
  if (c[0] != 1) fault("ldtilecfg: palette_id other than 0 or 1");
  if (c[1] != 0) fault("ldtilecfg: start_row != 0 (only an interrupted tileloadd sets it)");
  for (int i = 2; i < 16; ++i) {
    if (c[i] != 0) fault("ldtilecfg: reserved bytes 2..15 not zero");
  }
  State& s = state();
  for (int i = 0; i < 16; ++i) {
    const int colsb = c[16 + 2 * i] | (c[17 + 2 * i] << 8), rows = c[48 + i];
    if (i >= kTiles) {
      if (colsb != 0 || rows != 0) fault("ldtilecfg: tiles 8..15 must be 0 x 0 in palette 1");
      continue;
    }
    if (rows > kMaxRows || colsb > kMaxColsb) fault("ldtilecfg: tile larger than 16 rows x 64 bytes");
    if ((rows == 0) != (colsb == 0)) fault("ldtilecfg: a tile with rows but no columns, or the reverse");
    s.t[i].rows = rows;
    s.t[i].colsb = colsb;
  }
  s.configured = true;
  zero_all();
}

inline Tile& tile(int i, const char* op) {
  State& s = state();
  if (!s.configured) fault(op);
  if (i < 0 || i >= kTiles || s.t[i].rows == 0) fault(op);
  return s.t[i];
}

// Writes row m's first colsb bytes from tmp and zeroes the rest of the row (write_row_and_zero),
// and after the last configured row, every remaining row (zero_upper_rows).
inline void zero_outside_shape(Tile& t) {
  for (int r = 0; r < kMaxRows; ++r) {
    const int keep = r < t.rows ? t.colsb : 0;
    std::memset(t.data[r] + keep, 0, kMaxColsb - keep);
  }
}

inline void loadd(int dst, const void* base, long stride) {  // TILELOADD (and TILELOADDT1)
  Tile& t = tile(dst, "tileloadd: tile not configured");
  for (int r = 0; r < t.rows; ++r) std::memcpy(t.data[r], static_cast<const uint8_t*>(base) + r * stride, t.colsb);
  zero_outside_shape(t);
}

inline void stored(int src, void* base, long stride) {  // TILESTORED: rows x colsb bytes only
  Tile& t = tile(src, "tilestored: tile not configured");
  for (int r = 0; r < t.rows; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, t.data[r], t.colsb);
}

inline void zero(int dst) {  // TILEZERO: the whole tile
  std::memset(tile(dst, "tilezero: tile not configured").data, 0, sizeof(Tile::data));
}

// The shape checks both dot-product instructions share (#UD otherwise): C is m x n dwords, A is
// m x k dwords, B is k x n dwords.
inline void check_dp(const Tile& c, const Tile& a, const Tile& b) {
  if (a.colsb / 4 != b.rows) fault("tdp*: a.colsb / 4 != b.rows");
  if (c.colsb != b.colsb) fault("tdp*: c.colsb != b.colsb");
  if (c.rows != a.rows) fault("tdp*: c.rows != a.rows");
  // Stricter than the SDM (which would drop the odd bytes): no kernel here means to do that.
  if (c.colsb % 4 != 0 || a.colsb % 4 != 0) fault("tdp*: colsb not a multiple of 4");
}

inline float f32_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16 -> fp32 with DAZ: a denormal input (exponent bits zero) counts as a zero of its sign.
inline float bf16_daz(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  return f32_bits((u & 0x7f800000u) == 0 ? (u & 0x80000000u) : u);
}

// FTZ: a denormal fp32 result becomes a zero of its sign (the accumulator is read the same way).
inline float ftz(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0x7f800000u) == 0 ? f32_bits(u & 0x80000000u) : f;
}

// TDPBF16PS, after the SDM's pseudo-code: for each row m of C, for k over A's bf16 pairs, for
// each fp32 column n: tmp[n] += a[m][2k] * b[k][2n]; tmp[n] += a[m][2k+1] * b[k][2n+1]. Each
// step is one fp32 fused multiply-add, round to nearest even, with DAZ inputs and an FTZ result
// whatever MXCSR says. (A product of two bf16 values is exact in fp32 unless it underflows, so
// fused or not only matters there.)
inline void dpbf16ps(int dst, int src1, int src2) {
  Tile &c = tile(dst, "tdpbf16ps: dst not configured"), &a = tile(src1, "tdpbf16ps: src1 not configured"),
       &b = tile(src2, "tdpbf16ps: src2 not configured");
  check_dp(c, a, b);
  for (int m = 0; m < c.rows; ++m) {
    float tmp[16];
    std::memcpy(tmp, c.data[m], 64);
    for (int k = 0; k < a.colsb / 4; ++k) {
      uint16_t ak[2];
      std::memcpy(ak, a.data[m] + 4 * k, 4);
      for (int n = 0; n < c.colsb / 4; ++n) {
        uint16_t bn[2];
        std::memcpy(bn, b.data[k] + 4 * n, 4);
        for (int j = 0; j < 2; ++j) tmp[n] = ftz(std::fma(bf16_daz(ak[j]), bf16_daz(bn[j]), ftz(tmp[n])));
      }
    }
    std::memcpy(c.data[m], tmp, 64);
  }
  zero_outside_shape(c);
}

// TDPBSSD: signed bytes times signed bytes, four products per dword summed (exact in int32) and
// added to the int32 accumulator with wrap-around.
inline void dpbssd(int dst, int src1, int src2) {
  Tile &c = tile(dst, "tdpbssd: dst not configured"), &a = tile(src1, "tdpbssd: src1 not configured"),
       &b = tile(src2, "tdpbssd: src2 not configured");
  check_dp(c, a, b);
  for (int m = 0; m < c.rows; ++m) {
    uint32_t tmp[16];
    std::memcpy(tmp, c.data[m], 64);
    for (int k = 0; k < a.colsb / 4; ++k) {
      const int8_t* ak = reinterpret_cast<const int8_t*>(a.data[m] + 4 * k);
      for (int n = 0; n < c.colsb / 4; ++n) {
        const int8_t* bn = reinterpret_cast<const int8_t*>(b.data[k] + 4 * n);
        int32_t dot = 0;
        for (int j = 0; j < 4; ++j) dot += static_cast<int32_t>(ak[j]) * static_cast<int32_t>(bn[j]);
        tmp[n] += static_cast<uint32_t>(dot);  // unsigned: the wrap-around is defined
      }
    }
    std::memcpy(c.data[m], tmp, 64);
  }
  zero_outside_shape(c);
}

}  // namespace pagewire_amx_emu

// The intrinsics' names. Tile numbers are plain ints here; GCC's own macros need literals, so the
// kernels pass literals and both builds accept them.
#define _tile_loadconfig(cfg) pagewire_amx_emu::loadconfig(cfg)
#define _tile_release() pagewire_amx_emu::release()
#define _tile_loadd(dst, base, stride) pagewire_amx_emu::loadd(dst, base, stride)
#define _tile_stream_loadd(dst, base, stride) pagewire_amx_emu::loadd(dst, base, stride)
#define _tile_stored(src, base, stride) pagewire_amx_emu::stored(src, base, stride)
#define _tile_zero(dst) pagewire_amx_emu::zero(dst)
#define _tile_dpbf16ps(dst, src1, src2) pagewire_amx_emu::dpbf16ps(dst, src1, src2)
#define _tile_dpbssd(dst, src1, src2) pagewire_amx_emu::dpbssd(dst, src1, src2)
