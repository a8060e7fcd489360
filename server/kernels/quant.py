"""Quantised linear weights kept quantised in memory: the QuantizedWeight container and its formats.

Format "q8_0" is GGUF's Q8_0, byte for byte: a weight [N, K] is N rows of K / 32 blocks of 34 bytes,
each block an fp16 scale d (little-endian) followed by 32 int8 values q, representing d * q. The
container holds those bytes as a uint8 tensor [N, K / 32 * 34], so a Q8_0 tensor read from a GGUF
file (ggml shape [K, N], i.e. N rows of K) is wrapped without conversion by `from_q8_0_bytes`.
bf16/fp16/fp32 weights are quantised at load with `quantize` (GGUF's rounding rule, in C++).
`server.kernels.ops.linear` runs a QuantizedWeight through pagewire::linear_q8_0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import server._C  # noqa: F401  (loads the op registrations)

__all__ = ["QuantizedWeight", "QUANTIZATIONS", "Q8_0_BLOCK", "Q8_0_BLOCK_BYTES"]

Q8_0_BLOCK = 32  # values per block
Q8_0_BLOCK_BYTES = 34  # fp16 scale + 32 int8

# --quantization values and the weight format each one stores.
QUANTIZATIONS: dict[str, str] = {"int8": "q8_0"}


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's weight [N, K] (nn.Linear layout) kept in a block-quantised format.

    Attributes:
        qtype: "q8_0".
        data: uint8 [N, K / 32 * 34] on CPU, the blocks row by row (GGUF's layout).
        shape: the logical (N, K).
    """

    qtype: str
    data: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if self.qtype != "q8_0":
            raise ValueError(f"qtype: only 'q8_0' is supported, got {self.qtype!r}")
        n, k = self.shape
        if k % Q8_0_BLOCK != 0:
            raise ValueError(f"shape: K = {k} must be a multiple of {Q8_0_BLOCK} for q8_0")
        want = (n, k // Q8_0_BLOCK * Q8_0_BLOCK_BYTES)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"data: expected uint8 {list(want)} for q8_0 {list(self.shape)}, "
                             f"got {self.data.dtype} {list(self.data.shape)}")

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: str = "q8_0") -> "QuantizedWeight":
        """Quantise a float weight [N, K] (K a multiple of 32) with GGUF's rounding."""
        if qtype != "q8_0":
            raise ValueError(f"qtype: only 'q8_0' is supported, got {qtype!r}")
        data = torch.ops.pagewire.quantize_q8_0(weight.detach().cpu())
        return cls(qtype, data, (int(weight.shape[0]), int(weight.shape[1])))

    @classmethod
    def from_q8_0_bytes(cls, raw: torch.Tensor, n: int, k: int) -> "QuantizedWeight":
        """Wrap GGUF Q8_0 tensor data (any uint8 tensor of N * K / 32 * 34 bytes, e.g. a view of
        the mapped file) for a weight of N rows of K values; no copy when raw is contiguous."""
        return cls("q8_0", raw.reshape(n, k // Q8_0_BLOCK * Q8_0_BLOCK_BYTES), (n, k))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented weight [N, K] in `dtype` (exact in float32: d * q)."""
        return torch.ops.pagewire.dequantize_q8_0(self.data).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel()
