"""What the model classes build their weights from: an uninitialised parameter (`param`) and where
one checkpoint tensor lands (`WeightTarget`). A module of its own, below decoder.py, decoder_layer.py
and moe.py, so that they use them without importing each other."""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import nn


class WeightTarget(NamedTuple):
    """Where one checkpoint tensor goes: `dest` (a view into a parameter), the shape it must have,
    and `offset`, added after copying (Gemma checkpoints store norm weights as w - 1).

    `convert` maps the checkpoint tensor to dest's layout before the copy (gpt-oss's stacked experts:
    transposed, gate/up columns interleaved); `after` runs once the copy is done (gpt-oss's MXFP4
    blocks and scales: the pair is decoded when both are in, server.models.moe)."""

    dest: torch.Tensor
    shape: tuple[int, ...]
    offset: float = 0.0
    convert: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    after: Optional[Callable[[], None]] = None


def param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised parameter on purpose: the loader fills every parameter or fails naming the
    missing tensor."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
