"""server.models.gguf_transcode: GGUF's lattice (IQ3_XXS, IQ3_S, IQ2_XXS, IQ1_S, IQ2_XS, IQ2_S, IQ1_M) and
ternary (TQ1_0,
TQ2_0) blocks rewritten into a kernel's format dequantise to the `gguf` package's values of the
original blocks, bit for bit, whatever the codes, signs and scales."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from server.kernels.quant import QTYPES, QuantizedWeight
from server.models.gguf_transcode import TRANSCODED, held_nbytes, transcode
from tests.gguf_files import random_k_blocks

LATTICE = ["IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ1_S", "IQ2_XS", "IQ2_S", "IQ1_M"]


def source_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, row bytes] of valid `type_name` blocks: random bytes under fp16 d in [0.002, 0.02]
    (every byte pattern of the lattice types is a valid block), or the `gguf` package's
    quantisation of random values (the ternary types, whose 2-bit or base-3 codes stop at 2)."""
    if type_name in LATTICE:
        return random_k_blocks(rows, cols, type_name, seed)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 1.0, size=(rows, 1)).astype(np.float32)
    return quants.quantize(w, GGMLQuantizationType[type_name])


def gguf_values(type_name: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(quants.dequantize(raw, GGMLQuantizationType[type_name]), dtype=np.float32))


@pytest.mark.parametrize("type_name", sorted(TRANSCODED))
def test_the_rewritten_blocks_hold_the_gguf_packages_values(type_name: str) -> None:
    rows, cols = 24, 768
    raw = source_blocks(type_name, rows, cols, seed=3)
    raw[5] = 0  # an all-zero row: d = 0, every code 0
    held = transcode(type_name, raw)
    qtype = TRANSCODED[type_name]
    assert held.shape == (rows, cols // 256 * QTYPES[qtype].nbytes)
    assert held_nbytes(type_name, raw.nbytes) == held.nbytes
    qw = QuantizedWeight.from_gguf_bytes(qtype, torch.from_numpy(held), rows, cols)
    want = gguf_values(type_name, raw)
    assert want.abs().max() > 0 and not want[5].any()
    assert torch.equal(qw.dequantize(), want)
    assert torch.equal(qw.interleave().dequantize(), want)  # the x8 layout's moves keep them


@pytest.mark.parametrize("type_name", LATTICE)
def test_every_scale_and_extreme_codes_survive(type_name: str) -> None:
    """Each block's sub-block scales set to one value 0..max (max: IQ1_S's 3 bits, the others' 4;
    IQ2_XS / IQ2_S: the two halves' l differ), over random codes and signs: the level tables and the
    scales held hold them all."""
    src = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
    raw = random_k_blocks(16, 256, type_name, seed=7).reshape(16, src)
    for i in range(16):
        blk = raw[i]
        if type_name == "IQ3_XXS":
            words = blk[66:98].copy().view("<u4")
            words = (words & 0x0FFFFFFF) | np.uint32(i << 28)
            blk[66:98] = words.view(np.uint8)
        elif type_name == "IQ2_XXS":
            words = blk[2:66].copy().view("<u4").reshape(8, 2)
            words[:, 1] = (words[:, 1] & 0x0FFFFFFF) | np.uint32(i << 28)
            blk[2:66] = words.reshape(-1).view(np.uint8)
        elif type_name == "IQ3_S":
            blk[106:110] = i | i << 4
        elif type_name in ("IQ2_XS", "IQ2_S"):  # a 4-bit l per 16 values, the block's last 8 bytes
            blk[-8:] = i | (15 - i) << 4
        elif type_name == "IQ1_M":  # four words of four 3-bit l under d's nibbles
            words = blk[48:56].copy().view("<u2")
            words = (words & 0xF000) | np.uint16((i % 8) | (7 - i % 8) << 3 | (i % 8) << 6 | (7 - i % 8) << 9)
            blk[48:56] = words.view(np.uint8)
        else:
            qh = blk[34:50].copy().view("<u2")
            qh = (qh & 0x8FFF) | np.uint16((i % 8) << 12)
            blk[34:50] = qh.view(np.uint8)
    held = transcode(type_name, raw)
    qw = QuantizedWeight.from_gguf_bytes(TRANSCODED[type_name], torch.from_numpy(held), 16, 256)
    assert torch.equal(qw.dequantize(), gguf_values(type_name, raw))


def test_stacked_experts_keep_their_leading_dimensions() -> None:
    raw = source_blocks("IQ3_XXS", 12, 512, seed=1).reshape(3, 4, -1)
    held = transcode("IQ3_XXS", raw)
    assert held.shape == (3, 4, 2 * 136)
    assert np.array_equal(held[1], transcode("IQ3_XXS", raw[1]))


def test_rows_that_are_not_whole_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match=r"data: IQ2_XXS rows must be whole 66-byte blocks"):
        transcode("IQ2_XXS", np.zeros((2, 100), dtype=np.uint8))

