"""The float64 reference of LFM2's gated short convolution (transformers' Lfm2ShortConv from a
conv state), shared by the native and emulated kernel tests."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def reference(bcx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor]:
    """One sequence in float64: transformers' Lfm2ShortConv from its conv state. bcx [T, 3C],
    weight [C, K], state [K - 1, C]. Returns (out [T, C], new state [K - 1, C])."""
    C, K = weight.shape
    b, c, x = bcx.double().chunk(3, dim=-1)
    bx = torch.cat([state.double(), b * x])  # [K - 1 + T, C]
    y = F.conv1d(bx.t().unsqueeze(0), weight.double().unsqueeze(1), bias.double() if bias is not None else None,
                 groups=C)[0].t()  # [T, C]
    return c * y, bx[-(K - 1):]
