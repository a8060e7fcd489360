"""Exact block transcodes: GGUF types with no kernel of their own, rewritten at load into a kept type
whose blocks say the same values, so `--quantization gguf` keeps them quantised instead of
dequantising them to the serving dtype.

Which and why (every value the new blocks dequantise to equals the old one, bit for bit):
  * Q3_K -> Q6_K: both are 256-value super-blocks of sixteen 16-value sub-blocks under one fp16 d;
    Q3_K's sub-scale (s6 - 32) is an int8 in [-32, 31] and its code (q2 - 4 * !hbit) is in [-4, 3],
    inside Q6_K's int8 scales and (q6 - 32) codes in [-32, 31].
The values being equal, so is every product d * s * q (each exact in fp32). The new blocks are
larger (Q6_K 210 bytes per 256 values against Q3_K's 110), still 2.4x fewer than bf16's 512.
(Q5_0 and IQ4_NL were rewritten into Q8_0 blocks here until they had kernels of their own,
csrc/cpu/x8_q5nl_body.h: their own 22 and 18 bytes per 32 values now stay as they are.)

Each function takes and gives uint8 arrays whose last axis is a row's (or block run's) bytes.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["TRANSCODES", "kept_type", "kept_nbytes", "transcode"]

# Source type -> the kept type its blocks are rewritten into.
TRANSCODES = {"Q3_K": "Q6_K"}

_CHUNK_VALUES = 1 << 24


def _block(type_name: str) -> tuple[int, int]:
    """(values, bytes) per block of a GGUF type, from the `gguf` package's table (imported here, not
    at module import: the loader's header path runs without the package). A source and its target
    have the same values per block, so a row keeps its block count."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]


def kept_type(type_name: str) -> str:
    """The block type a tensor of `type_name` is kept in (itself unless it is transcoded)."""
    return TRANSCODES.get(type_name, type_name)


def kept_nbytes(t: Any) -> int:
    """Bytes a GGUF tensor `t` (server.models.gguf_file.GGUFTensor) takes once kept: its own size,
    or its transcoded blocks'."""
    n = int(t.data.nbytes)
    target = TRANSCODES.get(t.type_name)
    if target is None:
        return n
    return n // _block(t.type_name)[1] * _block(target)[1]


def transcode(type_name: str, raw: np.ndarray) -> np.ndarray:
    """`raw`'s blocks of `type_name` as blocks of kept_type(type_name): a new uint8 array with the
    same leading axes and the last one rescaled (a whole number of blocks per row)."""
    target = TRANSCODES[type_name]
    values, nbytes = _block(type_name)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.shape[-1] % nbytes:
        raise ValueError(f"{type_name} rows of {raw.shape[-1]} bytes are not whole {nbytes}-byte blocks")
    blocks = raw.reshape(-1, nbytes)
    step = _CHUNK_VALUES // values  # blocks per pass: bounds the uint8 temporaries (16 MB each)
    run = {"Q3_K": _q3_k_to_q6_k}[type_name]
    target_bytes = _block(target)[1]
    out = np.empty((blocks.shape[0], target_bytes), dtype=np.uint8)
    for i in range(0, blocks.shape[0], step):
        out[i:i + step] = run(blocks[i:i + step])
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // nbytes * target_bytes)


def _q3_k_to_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    # Q3_K: hmask [32] | qs [64] | scales [12] | d (fp16)
    hmask, qs, sc, d = b[:, :32], b[:, 32:96], b[:, 96:108], b[:, 108:110]
    # Sixteen 6-bit sub-scales: sub-block i's low four bits are byte i's low nibble (i < 8) or byte
    # i - 8's high nibble, its top two bits are byte 8 + i % 4's bits 2 * (i // 4) and up.
    low = np.concatenate([sc[:, :8] & np.uint8(0x0F), sc[:, :8] >> np.uint8(4)], axis=1)
    top = (sc[:, None, 8:12] >> _SHIFTS4[:, None]).reshape(n, 16) & np.uint8(3)
    scales = ((low | (top << np.uint8(4))) - np.uint8(32)).view(np.int8)  # [n, 16] in [-32, 31]
    # Value e = 128h + 32j + l (half h, two-bit field j, byte l of the half's 32 qs bytes); its high
    # bit is bit 4h + j of hmask[l], and a clear one subtracts 4: q6 = q2 - 4 (1 - hbit) + 32.
    q2 = (qs.reshape(n, 2, 1, 32) >> _SHIFTS4[:, None]) & np.uint8(3)  # [n, h, j, l]
    hbit = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)  # [n, 4h + j, l]
    q6 = q2.reshape(n, 256) + (hbit.reshape(n, 256) << np.uint8(2)) + np.uint8(28)  # [n, 256] in [28, 35]
    return _q6_k(n, q6, scales, d)


_SHIFTS4 = np.array([0, 2, 4, 6], dtype=np.uint8)


def _q6_k(n: int, q6: np.ndarray, scales: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q6_K blocks from unsigned codes q6 [n, 256] in [0, 63] (value = d * scale * (q6 - 32)), int8
    scales [n, 16] (value e's is e // 16) and the fp16 d's bytes [n, 2].

    Layout: ql [128] | qh [64] | scales [16] | d. Per 128-value half h and l < 32: ql[64h + l] holds
    values 128h + l (low nibble) and 128h + 64 + l (high); ql[64h + 32 + l] values 128h + 32 + l and
    128h + 96 + l; qh[32h + l] their top two bits, in that order (+0, +32, +64, +96) from bit 0."""
    q = q6.reshape(n, 2, 4, 32)  # [block, half, quarter, l]
    lo, hi = q & np.uint8(0x0F), q >> np.uint8(4)
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << np.uint8(4)), lo[:, :, 1] | (lo[:, :, 3] << np.uint8(4))],
                        axis=2)  # [block, half, 64]
    qh = hi[:, :, 0] | (hi[:, :, 1] << np.uint8(2)) | (hi[:, :, 2] << np.uint8(4)) | (hi[:, :, 3] << np.uint8(6))
    out = np.empty((n, 210), dtype=np.uint8)
    out[:, :128] = ql.reshape(n, 128)
    out[:, 128:192] = qh.reshape(n, 64)
    out[:, 192:208] = scales.view(np.uint8)
    out[:, 208:210] = d
    return out
