"""MXFP4 (OCP microscaling FP4) as gpt-oss's Hugging Face checkpoints ship their experts: decoding
`*_blocks` / `*_scales` tensor pairs to float at load.

A block is 32 values: 16 bytes of FP4 E2M1 codes (two per byte, the low nibble first) and one
E8M0 scale byte s in the `_scales` tensor, the block's values being code_value * 2 ** (s - 127).
The checkpoint's `gate_up_proj_blocks` are [E, 2I, H / 32, 16] with `gate_up_proj_scales`
[E, 2I, H / 32] (rows are output features, gpt-oss's interleaved gate/up columns), and
`down_proj_blocks` [E, H, I / 32, 16]. GGUF files carry the same format as GGML type MXFP4 (one
block = the scale byte then 16 code bytes, low nibbles the first 16 values); the `gguf` package
decodes those (server.models.gguf_loader).
"""
from __future__ import annotations

import torch

# E2M1 code -> value (sign bit 3, then exponent and mantissa): OCP MX spec, table 4.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., G * 32] from uint8 blocks [..., G, 16] and uint8 scales [..., G].

    Exact: every E2M1 value times a power of two in float32's range is a float32 (scales 0..254
    give 2 ** -127 .. 2 ** 127; ldexp keeps subnormals); 255 is the spec's NaN scale."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"blocks [..., G, 16] and scales [..., G] disagree: {list(blocks.shape)} vs {list(scales.shape)}")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].reshape(*blocks.shape[:-1], BLOCK)  # [..., G, 32]
    exponent = scales.to(torch.int32).sub(127).unsqueeze(-1)
    out = torch.ldexp(values, exponent.to(torch.float32))
    out = torch.where(scales.unsqueeze(-1) == 255, torch.full_like(out, float("nan")), out)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)
