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
    """table's rows `ids` (any shape of token ids) dequantised to `dtype`: [*ids.shape, K].
    An id outside the table raises IndexError (index_select's)."""
    if table.qtype not in EMBEDDABLE:
        raise ValueError(f"table: an embedding table kept in blocks is one of {', '.join(EMBEDDABLE)}, "
                         f"not {table.qtype}")
    n, k = table.shape
    flat = ids.reshape(-1)
    if flat.dtype != torch.long:
        flat = flat.to(torch.long)
    full = n // _GROUP * _GROUP  # an x8 table's rows in whole groups; the last N % 8 stay rows
    if not table.interleaved:
        values = _dequantize(table.qtype, table.data.index_select(0, flat), False)
    elif full == n or not bool((flat >= full).any()):  # every row in a group: no masks (decode's case)
        values = _from_groups(table, flat, full)
    else:
        values = torch.empty((flat.numel(), k), dtype=torch.float32)
        grouped = flat < full
        at, tail = grouped.nonzero().view(-1), (~grouped).nonzero().view(-1)
        values[at] = _from_groups(table, flat[at], full)
        values[tail] = _dequantize(table.qtype, table.data.index_select(0, flat[tail]), False)
    return values.to(dtype).view(*ids.shape, k)


def _from_groups(table: QuantizedWeight, rows: torch.Tensor, full: int) -> torch.Tensor:
    """float32 [len(rows), K] of an x8 table's rows below `full`: each row's group of eight rows
    dequantised, the row picked from it."""
    rb = table.data.shape[1]
    groups = table.data[:full].view(full // _GROUP, _GROUP * rb).index_select(0, rows // _GROUP)
    values = _dequantize(table.qtype, groups.view(-1, rb), True)
    if rows.numel() == 1:  # a single sequence's decode step: a view, not two more ops
        return values.narrow(0, int(rows) % _GROUP, 1)
    picks = torch.arange(0, rows.numel() * _GROUP, _GROUP) + rows % _GROUP
    return values.index_select(0, picks)


def _dequantize(qtype: Qtype, blocks: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """float32 [rows, K] of `blocks` (QuantizedWeight.dequantize's ops, without building one per step)."""
    if qtype is Qtype.Q8_0:
        return torch.ops.pagewire.dequantize_q8_0(blocks, interleaved)
    return torch.ops.pagewire.dequantize_q4(blocks, qtype.value + "x8" if interleaved else qtype.value)
