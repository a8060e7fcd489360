"""A matrix whose row ranges are kept in different block formats: QuantizedParts.

llama.cpp's K-quant mixes (Q4_K_M, the most downloaded) give a layer's attn_v (and some
ffn_down / ffn_up) a larger type than attn_q and attn_k, so the fused qkv (or gate_up) that
pagewire runs as one matrix is made of GGUF tensors of different types. QuantizedParts keeps each
part in its own format: a row concatenation of QuantizedWeights, each possibly interleaved x8 by
`for_kernels` like any other, whose bytes lie one after another in one flat uint8 buffer (`data`;
each part's `data` is a view of its range). Nothing is dequantised.

`server.kernels.ops.linear` runs each part through its own format's path (linear_route's rules and
autotune plans of that part's shape) into its columns of the result; pagewire::decode_layer and
the other fused layers get the flat buffer and the kind `op_qtype` = "parts:KIND*ROWS+KIND*ROWS..."
(csrc/cpu/decode_layer.cpp run_parts), which runs the same kernels on views of the same bytes, so
both give the same floats.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from server.kernels.quant import QuantizedWeight

__all__ = ["QuantizedParts", "PARTS_KIND"]

PARTS_KIND = "parts:"  # the prefix of a QuantizedParts' linear kind


@dataclass(frozen=True)
class QuantizedParts:
    """A linear layer's weight [N, K] kept as row ranges of different block formats.

    Attributes:
        parts: the row ranges in order, each a QuantizedWeight [N_i, K] (sum N_i = N).
        data: uint8 [total bytes], every part's block bytes one after another; each part's `data`
            is a view of its range (so the model holds the bytes once).
        shape: the logical (N, K).
    """

    parts: tuple[QuantizedWeight, ...]
    data: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("parts: a QuantizedParts needs at least one part")
        k = self.parts[0].shape[1]
        if any(p.shape[1] != k for p in self.parts):
            raise ValueError(f"parts: every part must have K = {k}, got {[p.shape for p in self.parts]}")
        if self.shape != (sum(p.shape[0] for p in self.parts), k):
            raise ValueError(f"shape: {self.shape} is not the parts' rows stacked")
        if self.data.dtype != torch.uint8 or self.data.dim() != 1 or not self.data.is_contiguous():
            raise ValueError("data: must be a contiguous uint8 [bytes] tensor")
        if self.data.numel() != sum(p.data.numel() for p in self.parts):
            raise ValueError(f"data: {self.data.numel()} bytes, the parts have {sum(p.nbytes for p in self.parts)}")

    @classmethod
    def join(cls, parts: Sequence[QuantizedWeight]) -> "QuantizedParts":
        """The parts' rows stacked: their bytes copied into one buffer, each part a view of it."""
        data = torch.empty(sum(p.data.numel() for p in parts), dtype=torch.uint8)
        views, offset = [], 0
        for p in parts:
            n = p.data.numel()
            view = data[offset : offset + n].view(p.data.shape)
            view.copy_(p.data)
            views.append(QuantizedWeight(p.qtype, view, p.shape, p.interleaved))
            offset += n
        return cls(tuple(views), data, (sum(p.shape[0] for p in parts), parts[0].shape[1]))

    def for_kernels(self) -> "QuantizedParts":
        """Each part in the layout this CPU's kernel reads fastest (QuantizedWeight.for_kernels)."""
        ready = [p.for_kernels() for p in self.parts]
        if all(r is p for r, p in zip(ready, self.parts)):
            return self
        return QuantizedParts.join(ready)

    @property
    def op_qtype(self) -> str:
        """The kind pagewire::decode_layer (run_linear_kind) takes for this weight, e.g.
        "parts:q4_kx8*768+q6_kx8*256"."""
        return self.kind_of([str(p.op_qtype) for p in self.parts])

    def kind_of(self, part_kinds: Sequence[str]) -> str:
        """The parts kind with each part's path given (linear_route.linear_kind's, part by part)."""
        return PARTS_KIND + "+".join(f"{k}*{p.shape[0]}" for k, p in zip(part_kinds, self.parts))

    @property
    def qtypes(self) -> tuple[str, ...]:
        return tuple(str(p.qtype) for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented weight [N, K] in `dtype` (exact in float32, as GGUF computes it)."""
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def map_rows(self, x: torch.Tensor, bias: Optional[torch.Tensor],
                 run: Callable[[torch.Tensor, QuantizedWeight, Optional[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        """run(x, part, its slice of bias) for each part, the results side by side in the last dim
        (what decode_layer's run_parts computes when `run` is ops.linear)."""
        outs, row = [], 0
        for p in self.parts:
            n = p.shape[0]
            outs.append(run(x, p, bias[row : row + n] if bias is not None else None))
            row += n
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [M, K] @ self^T (+ bias), each part by its format's kernel (QuantizedWeight.linear)."""
        return self.map_rows(x, bias, lambda x_, p, b: p.linear(x_, b))

    @property
    def nbytes(self) -> int:
        return self.data.numel()
