"""GGUF block types that pagewire's kernels read in another block format, and their exact rewrite.

It owns, for each such type, which pagewire qtype its blocks become (TRANSCODED), the rewrite of a
tensor's bytes (`transcode`) and their size after it (`held_nbytes`). The values never change: each
rewritten block dequantises to the same float32 values, bit for bit, as the `gguf` package's
dequantiser of the original block (tests/models/test_gguf_transcode.py). The grids are the `gguf`
package's; the bit layouts are read here with integer numpy ops (the package's float dequantiser
ran at 2-5 M values a second, minutes for a 1 B model).

* IQ3_XXS, IQ3_S, IQ2_XXS, IQ1_S (llama.cpp's lattice types; IQ2_XS and IQ2_S below) store per 8 or 4 values an index
  into a grid of magnitudes, with separate sign bits. No kernel here gathers from those grids;
  but within a 32-value sub-block every value is the sub-block's scale times one of at most sixteen
  signed levels, so each becomes IQ4_XS's layout with the type's own level table
  (csrc/cpu/quant4_kernel.h, q_levels): the block's fp16 d, the sub-block multiplier 2 l + 1
  (1..31) as IQ4_XS's 6-bit `ls - 32`, and a 4-bit code per value. The type's power-of-two level
  scale (IQ3_XXS 1/4, IQ2_XXS and IQ1_S 1/8, IQ3_S 1) is the kernels' (q_level_scale). 136 bytes
  per 256 values against the file's 98 / 110 / 66 / 50: more bytes than the file, a twelfth of the
  float32 copy and an eighth of the bf16 one that these types were dequantised to before, and
  the IQ4_XS kernels (x8_q5nl_body.h) run them.
* TQ2_0 and TQ1_0 (ternary: d * (q - 1), q in 0..2) become Q2_K blocks with every sub-block's scale
  and min 1 and d = dmin = the block's d: d * 1 * q - d * 1 is d * (q - 1), exactly. TQ2_0's code
  bytes are Q2_K's (the same bit positions); TQ1_0's base-3 codes are unpacked into them.

* IQ2_XS and IQ2_S (a 4-bit scale per 16 values, IQ2_XXS's magnitudes) become the "x16" layout: IQ4_XS's
  with the sixteen scales as the file's own nibbles (138 bytes per 256 against 74 and 82), which
  the x16 kernels (x8_q5nl_body.h group_x16) run with two chains per sub-block.

  IQ1_M (IQ1_S's grid with a delta per 8 values, a 3-bit l per 16, d's fp16 bits spread over the
  scale words' top nibbles) becomes the x16 layout with IQ1_S's levels (138 bytes against 56).

Every type GGUF has is now kept in blocks some kernel reads.
"""
from __future__ import annotations

import functools

import numpy as np

from server.kernels.quant import QTYPES, Qtype

__all__ = ["TRANSCODED", "transcode", "held_nbytes"]

# GGUF type name -> the qtype its rewritten blocks are held as.
TRANSCODED: dict[str, Qtype] = {"IQ3_XXS": Qtype.IQ3_XXS, "IQ3_S": Qtype.IQ3_S, "IQ2_XXS": Qtype.IQ2_XXS,
                                "IQ1_S": Qtype.IQ1_S, "IQ2_XS": Qtype.IQ2_XS, "IQ2_S": Qtype.IQ2_S, "IQ1_M": Qtype.IQ1_M,
                                "TQ2_0": Qtype.Q2_K, "TQ1_0": Qtype.Q2_K}

_VALUES = 256  # per block, every transcoded type
_SOURCE_BYTES = {"IQ3_XXS": 98, "IQ3_S": 110, "IQ2_XXS": 66, "IQ1_S": 50, "IQ2_XS": 74, "IQ2_S": 82, "IQ1_M": 56, "TQ2_0": 66,
                 "TQ1_0": 54}
# The lattice types' levels by code (csrc/cpu/quant4_kernel.h's tables, whose unused codes are 0): a
# value is d * (2 l + 1) * f * level, f = 1/4 (IQ3_XXS), 1 (IQ3_S), 1/8 (IQ2_XXS; IQ1_S, whose levels
# are eight times grid + delta) -- f is the kernels' q_level_scale. The signed-magnitude types list
# their magnitudes negated, largest first, then as they are.
_LEVELS = {
    "IQ3_XXS": (-62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62),
    "IQ3_S": (-15, -13, -11, -9, -7, -5, -3, -1, 1, 3, 5, 7, 9, 11, 13, 15),
    "IQ2_XXS": (-43, -25, -8, 8, 25, 43),
    "IQ2_XS": (-43, -25, -8, 8, 25, 43),  # (and a scale per 16 values: the x16 layout)
    "IQ2_S": (-43, -25, -8, 8, 25, 43),
    "IQ1_S": (-9, -7, -1, 1, 7, 9),  # code 2 g + 1 for delta = +1/8, 2 g for -1/8 (g: -1, 0, 1 as 0, 1, 2)
    "IQ1_M": (-9, -7, -1, 1, 7, 9),  # (IQ1_S's grid and levels, a delta per 8 values)
}
# Where a ternary type's fp16 d sits in its block (the lattice types': byte 0).
_D_AT = {"TQ2_0": 64, "TQ1_0": 52}
# Blocks rewritten per pass: bounds the temporaries (a few bytes per value) to tens of MiB.
_CHUNK = 1 << 15


def held_nbytes(type_name: str, nbytes: int) -> int:
    """The bytes a tensor of `type_name` taking `nbytes` in the file takes once transcoded."""
    return nbytes // _SOURCE_BYTES[type_name] * QTYPES[TRANSCODED[type_name]].nbytes


def transcode(type_name: str, raw: np.ndarray) -> np.ndarray:
    """`raw` (uint8 [..., row bytes] of `type_name` blocks, rows whole blocks) rewritten into the
    blocks of TRANSCODED[type_name]: uint8 [..., held row bytes], the same values."""
    src = _SOURCE_BYTES[type_name]
    if raw.dtype != np.uint8 or raw.shape[-1] % src:
        raise ValueError(f"data: {type_name} rows must be whole {src}-byte blocks, got {raw.dtype} {list(raw.shape)}")
    blocks = np.ascontiguousarray(raw).reshape(-1, src)
    out = np.empty((blocks.shape[0], QTYPES[TRANSCODED[type_name]].nbytes), dtype=np.uint8)
    rewrite = (_ternary_block if type_name in ("TQ2_0", "TQ1_0")
               else _x16_blocks if type_name in ("IQ2_XS", "IQ2_S", "IQ1_M") else _lattice_blocks)
    for i in range(0, blocks.shape[0], _CHUNK):
        out[i : i + _CHUNK] = rewrite(type_name, blocks[i : i + _CHUNK])
    return out.reshape(*raw.shape[:-1], -1)


@functools.cache
def _code_table(type_name: str) -> np.ndarray:
    """uint8 [grid entries, sign patterns, values per entry]: the codes (into the type's _LEVELS) of
    each grid entry under each pattern of its signs -- the eight sign bits of a ksigns index (IQ2_XXS,
    IQ2_XS: 128 of them), eight sign bits as they are (IQ2_S: 256), four sign bits (IQ3_XXS, IQ3_S: 16),
    or delta's sign (IQ1_S, whose table IQ1_M shares: 2). The grids are the `gguf` package's, so its
    reading of llama.cpp's tables, not a second copy here."""
    from gguf import quants

    cls = getattr(quants, type_name)
    cls.init_grid()
    grid = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    mag = np.searchsorted(np.asarray(cls.grid_map, dtype=np.float32), grid).astype(np.int16)[:, None, :]
    per = grid.shape[1]
    if type_name == "IQ1_S":  # mag: -1, 0, 1 as 0, 1, 2; pattern 1: delta +1/8
        return (2 * mag + np.arange(2, dtype=np.int16)[None, :, None]).astype(np.uint8)
    if type_name in ("IQ2_XXS", "IQ2_XS"):  # pattern: a ksigns index (7 bits and their parity)
        signs = np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)
    elif type_name == "IQ2_S":  # pattern: the eight sign bits themselves
        signs = np.arange(256, dtype=np.uint8)
    else:
        signs = np.arange(16, dtype=np.uint8)
    neg = ((signs[:, None] >> np.arange(per, dtype=np.uint8)) & 1).astype(bool)[None]
    half = len(_LEVELS[type_name]) // 2  # levels: the magnitudes negated, largest first, then as they are
    return np.where(neg, half - 1 - mag, half + mag).astype(np.uint8)


def _lookup(type_name: str, entry: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """_code_table[entry, pattern] as one flat gather of whole rows (each row's 4 or 8 codes one
    uint32 / uint64: three times as fast as numpy's two-axis indexing), uint8 [..., values per entry]."""
    table = _code_table(type_name)
    patterns, per = table.shape[1], table.shape[2]
    rows = table.reshape(-1, per).view(np.uint32 if per == 4 else np.uint64).reshape(-1)
    flat = rows[entry.astype(np.intp) * patterns + pattern]
    return flat[..., None].view(np.uint8).reshape(*flat.shape, per)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """uint8 [..., k] -> [..., 2 k]: each byte's low then high nibble."""
    return np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)


def _lattice_codes(type_name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [n, 8, 32] into the type's _LEVELS, multipliers 2 l + 1 int [n, 8]) of its blocks."""
    n = blocks.shape[0]
    if type_name == "IQ1_S":  # d, 32 index bytes, then per sub-block a 16-bit word: 3 more index bits per
        qs = blocks[:, 2:34].astype(np.uint16).reshape(n, 8, 4)  # group of 8, l in bits 12-14, delta's sign bit 15
        qh = blocks[:, 34:50].copy().view("<u2")
        idx = qs | ((qh[..., None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7) << 8
        codes = _lookup(type_name, idx, ((qh & 0x8000) == 0)[..., None].astype(np.intp))
        ls = (qh >> 12) & 7
    elif type_name == "IQ2_XXS":  # d, then per sub-block two words: four grid indices; four 7-bit sign
        words = blocks[:, 2:66].copy().view("<u4").reshape(n, 8, 2)  # indices, l in the top 4 bits
        sidx = (words[..., 1:2] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 0x7F
        codes = _lookup(type_name, words[..., 0].copy().view(np.uint8).reshape(n, 8, 4), sidx.astype(np.intp))
        ls = words[..., 1] >> 28
    elif type_name == "IQ2_XS":  # d, per 8 values a 16-bit word: 9-bit grid index, 7-bit sign index
        words = blocks[:, 2:66].copy().view("<u2")
        codes = _lookup(type_name, words & 511, (words >> 9).astype(np.intp))
        ls = np.zeros((n, 8), dtype=np.int64)  # (its scales are per 16 values: _x16_blocks copies them)
    elif type_name == "IQ2_S":  # d, 32 index bytes, a sign byte per 8 values, 2 more index bits each, scales
        high = (blocks[:, 66:74, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3
        codes = _lookup(type_name, blocks[:, 2:34].astype(np.uint16) | high.reshape(n, 32).astype(np.uint16) << 8,
                        blocks[:, 34:66].astype(np.intp))
        ls = np.zeros((n, 8), dtype=np.int64)
    elif type_name == "IQ3_XXS":  # d, 64 grid indices (4 values each), then per sub-block a word as IQ2_XXS's
        from gguf import quants

        words = blocks[:, 66:98].copy().view("<u4")
        sidx = (words[..., None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 0x7F
        signs = _nibbles(np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)[sidx])  # [n, 8, 8]
        codes = _lookup(type_name, blocks[:, 2:66].reshape(n, 8, 8), signs)
        ls = words >> 28
    else:  # IQ3_S: d, 64 index bytes, 64 ninth index bits, a sign bit per value, eight 4-bit l
        high = ((blocks[:, 66:74, None] >> np.arange(8, dtype=np.uint8)) & 1).reshape(n, 64).astype(np.uint16)
        codes = _lookup(type_name, blocks[:, 2:66].astype(np.uint16) | high << 8, _nibbles(blocks[:, 74:106]))
        ls = _nibbles(blocks[:, 106:110])
    return codes.reshape(n, 8, 32), 2 * ls.astype(np.int64) + 1


def _lattice_blocks(type_name: str, blocks: np.ndarray) -> np.ndarray:
    """IQ3_XXS / IQ3_S / IQ2_XXS / IQ1_S blocks -> IQ4_XS-layout blocks with the type's levels."""
    n = blocks.shape[0]
    codes, mult = _lattice_codes(type_name, blocks)
    ls = mult + 32  # IQ4_XS's 6-bit scale, ls - 32 = 2 l + 1
    out = np.empty((n, 136), dtype=np.uint8)
    out[:, 0:2] = blocks[:, 0:2]  # d
    high = np.zeros(n, dtype=np.int64)
    for s in range(8):
        high |= (ls[:, s] >> 4) << (2 * s)
    out[:, 2] = high & 0xFF
    out[:, 3] = high >> 8
    out[:, 4:8] = (ls[:, 0::2] & 0xF) | (ls[:, 1::2] & 0xF) << 4
    out[:, 8:] = (codes[..., :16] | codes[..., 16:] << 4).reshape(n, 128)
    return out


def _x16_blocks(type_name: str, blocks: np.ndarray) -> np.ndarray:
    """IQ2_XS / IQ2_S blocks -> x16-layout blocks (csrc/cpu/quant4_kernel.h): d, the file's own eight
    bytes of sixteen 4-bit l (the scale of each 16 values is d (2 l + 1) / 8 in both), the codes."""
    n = blocks.shape[0]
    out = np.empty((n, 138), dtype=np.uint8)
    if type_name == "IQ1_M":
        codes, d, ls = _iq1_m(blocks)
        out[:, 0:2] = d.view(np.uint8).reshape(n, 2)
        out[:, 2:10] = ls[:, 0::2] | ls[:, 1::2] << 4
    else:
        codes, _ = _lattice_codes(type_name, blocks)
        out[:, 0:2] = blocks[:, 0:2]  # d
        out[:, 2:10] = blocks[:, -8:]  # the l of each 16 values, sub-block s's halves in byte s's nibbles
    out[:, 10:] = (codes[..., :16] | codes[..., 16:] << 4).reshape(n, 128)
    return out


def _iq1_m(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ1_M blocks (32 index bytes; 16 bytes of a nibble per 8 values: 3 more index bits and delta's
    sign bit; four 16-bit words of four 3-bit l each, d's fp16 bits in their top nibbles) -> (codes
    uint8 [n, 8, 32] into IQ1_S's levels, d uint16 [n], l uint8 [n, 16] per 16 values)."""
    n = blocks.shape[0]
    words = blocks[:, 48:56].copy().view("<u2")
    d = ((words[:, 0] >> 12) | ((words[:, 1] >> 8) & 0x00F0) | ((words[:, 2] >> 4) & 0x0F00)
         | (words[:, 3] & 0xF000)).astype("<u2")
    ls = ((words[..., None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7).reshape(n, 16).astype(np.uint8)
    nib = _nibbles(blocks[:, 32:48])  # entry 2 i: byte i's low nibble
    idx = blocks[:, 0:32].astype(np.uint16) | (nib & 7).astype(np.uint16) << 8
    codes = _lookup("IQ1_S", idx, ((nib & 8) == 0).astype(np.intp))  # pattern 1: delta +1/8
    return codes.reshape(n, 8, 32), d, ls


def _ternary_block(type_name: str, blocks: np.ndarray) -> np.ndarray:
    """TQ2_0 / TQ1_0 blocks -> Q2_K blocks: scales and mins 1, d = dmin = the block's d."""
    n = blocks.shape[0]
    out = np.empty((n, 84), dtype=np.uint8)
    out[:, 0:16] = 0x11  # each 16-value sub-block: scale 1 (low nibble), min 1 (high)
    at = _D_AT[type_name]
    out[:, 80:82] = blocks[:, at : at + 2]  # d
    out[:, 82:84] = blocks[:, at : at + 2]  # dmin
    if type_name == "TQ2_0":
        out[:, 16:80] = blocks[:, 0:64]  # value 128 h + 32 j + l at bits 2j of byte 32 h + l, as Q2_K's
        return out
    # TQ1_0: 48 bytes of five base-3 digits each (byte * 3^k, wrapping at 256, times 3 >> 8 is digit k),
    # then 4 bytes of four digits: values 0-159, 160-239, 240-255 in that order.
    powers = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
    packed = np.concatenate([(blocks[:, None, 0:32] * powers[:, None]).reshape(n, 160),
                             (blocks[:, None, 32:48] * powers[:, None]).reshape(n, 80),
                             (blocks[:, None, 48:52] * powers[:4, None]).reshape(n, 16)], axis=1)
    q = ((packed.astype(np.uint16) * 3) >> 8).astype(np.uint8).reshape(n, 2, 4, 32)  # codes 0..2
    out[:, 16:80] = (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(n, 64)
    return out
