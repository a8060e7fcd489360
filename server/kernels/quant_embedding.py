"""Token embeddings gathered from a table kept in a GGUF file's blocks (`--quantization gguf`).

A quantised table is a fraction of its float copy (a Q4_K 32000 x 1024 table is 18 MB in the file,
65 MB in bf16), and a step reads only its tokens' rows. `gather_rows` picks those rows' blocks and
dequantises them (pagewire::dequantize_q8_0 / dequantize_q4, which compute GGUF's float32 values
bit for bit as the `gguf` package's numpy dequantisers do), then rounds to the model's dtype: the
rows the loader's dequantised table held, exactly. The table may be in GGUF's row layout (an
untied embedding) or in the x8 layout (a tied model's table, which is also its lm_head's weight,
QuantizedWeight.for_kernels): there each row's group of eight rows is dequantised and the row
picked, and the last N % 8 rows, which the x8 layout leaves in row layout, are read as rows.
"""
from __future__ import annotations

import torch

from server.kernels.quant import Qtype, QuantizedWeight

__all__ = ["EMBEDDABLE", "gather_rows"]

# The block formats an embedding table can stay in: each has an exact C++ dequantiser.
EMBEDDABLE: tuple[Qtype, ...] = (Qtype.Q8_0, Qtype.Q4_0, Qtype.Q4_1, Qtype.Q4_K, Qtype.Q5_K, Qtype.Q6_K)
_GROUP = 8  # rows per group of the x8 layout (csrc/cpu/quant_kernel.h, quant4_kernel.h)


def gather_rows(table: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """table's rows `ids` (any shape of token ids) dequantised to `dtype`: [*ids.shape, K]."""
    if table.qtype not in EMBEDDABLE:
        raise ValueError(f"table: an embedding table kept in blocks is one of {', '.join(EMBEDDABLE)}, "
                         f"not {table.qtype}")
    n, k = table.shape
    flat = ids.reshape(-1).to(torch.long)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"ids: token ids must lie in [0, {n}), got {int(flat.min())}..{int(flat.max())}")
    if not table.interleaved:
        values = _rows(table, flat)
    else:
        values = torch.empty((flat.numel(), k), dtype=torch.float32)
        full = n // _GROUP * _GROUP  # rows in whole groups; the rest stay in row layout
        grouped = flat < full
        at = grouped.nonzero().view(-1)
        if at.numel():
            rb = table.data.shape[1]
            which = flat[at]
            blocks = table.data[:full].reshape(full // _GROUP, _GROUP * rb).index_select(0, which // _GROUP)
            groups = QuantizedWeight(table.qtype, blocks.reshape(-1, rb), (at.numel() * _GROUP, k), interleaved=True)
            values[at] = groups.dequantize(torch.float32).view(-1, _GROUP, k)[torch.arange(at.numel()), which % _GROUP]
        tail = (~grouped).nonzero().view(-1)
        if tail.numel():
            values[tail] = _rows(table, flat[tail])
    return values.to(dtype).view(*ids.shape, k)


def _rows(table: QuantizedWeight, rows: torch.Tensor) -> torch.Tensor:
    """float32 [len(rows), K] of rows stored in row layout (every row of a row-layout table, or
    the trailing N % 8 rows of an x8 one)."""
    if rows.numel() == 0:
        return torch.empty((0, table.shape[1]), dtype=torch.float32)
    picked = table.data.index_select(0, rows)
    return QuantizedWeight(table.qtype, picked, (rows.numel(), table.shape[1])).dequantize(torch.float32)
