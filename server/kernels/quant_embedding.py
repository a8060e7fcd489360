"""Token embeddings gathered from a table kept in a GGUF file's blocks (`--quantization gguf`).

A quantised table is a fraction of its float copy (a Q4_K 32000 x 1024 table is 18 MB in the file,
65 MB in bf16), and a step reads only its tokens' rows. `gather_rows` picks those rows' blocks and
dequantises them (pagewire::dequantize_q8_0 / dequantize_q4, which compute GGUF's float32 values
bit for bit as the `gguf` package's numpy dequantisers do), then rounds to the model's dtype: the
rows the loader's dequantised table held, exactly. The table may be in GGUF's row layout (an
untied embedding) or in the x8 layout (a tied model's table, which is also its lm_head's weight,
QuantizedWeight.for_kernels): there each row is copied out of its de-interleaved group of eight,
and the last N % 8 rows, which the x8 layout leaves in row layout, are read as rows. One op per
step (csrc/cpu/embedding_gguf.cpp): a decode step's gather costs about what F.embedding does.
"""
from __future__ import annotations

import torch

from server._C import fast as _fast  # the op's CPU code as a plain call (csrc/fast_calls.cpp)
from server.kernels.quant import Qtype, QuantizedWeight

__all__ = ["EMBEDDABLE", "gather_rows"]

# The block formats an embedding table can stay in: each has an exact C++ dequantiser.
EMBEDDABLE: tuple[Qtype, ...] = (Qtype.Q8_0, Qtype.Q4_0, Qtype.Q4_1, Qtype.Q4_K, Qtype.Q5_K, Qtype.Q6_K, Qtype.Q5_0,
                                 Qtype.Q5_1, Qtype.IQ4_NL, Qtype.IQ4_XS, Qtype.Q2_K,
                                 Qtype.Q3_K, Qtype.IQ3_XXS, Qtype.IQ3_S, Qtype.IQ2_XXS, Qtype.IQ1_S,
                                 Qtype.IQ2_XS, Qtype.IQ2_S, Qtype.IQ1_M)


def gather_rows(table: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """table's rows `ids` (any shape of token ids) dequantised to `dtype`: [*ids.shape, K], in one
    op (pagewire::embedding_gguf). An id outside the table raises IndexError."""
    if table.qtype not in EMBEDDABLE:
        raise ValueError(f"table: an embedding table kept in blocks is one of {', '.join(EMBEDDABLE)}, "
                         f"not {table.qtype}")
    if ids.dtype != torch.long:
        ids = ids.to(torch.long)
    if ids.is_cpu:  # server._C.fast: the op's CPU code without the dispatcher (csrc/fast_calls.cpp)
        return _fast.embedding_gguf(ids, table.data, table.op_qtype, dtype)
    return torch.ops.pagewire.embedding_gguf(ids, table.data, table.op_qtype, dtype)
