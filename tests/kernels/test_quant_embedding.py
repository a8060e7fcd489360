"""An embedding table kept in GGUF blocks (server.kernels.quant_embedding): the gathered rows are
exactly the rows of the table the `gguf` package's numpy dequantiser gives, rounded to the model's
dtype (what the loader's float table held), for every block format a table can stay in, in GGUF's
row layout and in the x8 layout (a tied model's table, its lm_head's weight), tail rows included."""
from __future__ import annotations

import pytest
import torch

from server.kernels import linear_route
from server.kernels.quant import INTERLEAVABLE, Qtype, QuantizedWeight
from server.kernels.quant_embedding import EMBEDDABLE, gather_rows
from tests.kernels.test_quant4 import gguf_dequantize, random_q4

N, K = 37, 512  # 37 rows: four groups of eight in the x8 layout, then five rows it leaves as rows


def table(qtype: Qtype, seed: int = 0) -> QuantizedWeight:
    if qtype is Qtype.Q8_0:
        g = torch.Generator().manual_seed(seed)
        return QuantizedWeight.quantize(torch.randn(N, K, generator=g) * 0.05, "q8_0")
    return random_q4(str(qtype), N, K, seed=seed, zero_rows=(5,))


@pytest.mark.parametrize("qtype,layout", [(q, "rows") for q in EMBEDDABLE]
                         + [(q, "x8") for q in EMBEDDABLE if q in INTERLEAVABLE])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_equal_the_dequantised_table(qtype: Qtype, layout: str, dtype: torch.dtype) -> None:
    t = table(qtype)
    want = gguf_dequantize(t).to(dtype)  # the float table the loader would build
    if layout == "x8":
        t = t.interleave()
    every = torch.arange(N)
    assert torch.equal(gather_rows(t, every, dtype), want)  # every row, bit for bit
    ids = torch.tensor([[36, 0, 7, 8, 31, 32, 5], [35, 35, 1, 1, 33, 9, 0]])  # tail rows, repeats, group edges
    got = linear_route.embedding(ids, t, dtype)
    assert got.shape == (2, 7, K) and got.dtype == dtype
    assert torch.equal(got, torch.nn.functional.embedding(ids, want))
    for i in (0, 7, 8, 31, 32, 36):  # one id (a single sequence's decode step), group edges and tail
        assert torch.equal(gather_rows(t, torch.tensor([i]), dtype), want[i : i + 1])
    # Up to 64 ids are gathered row by row on the calling thread, more (a prompt's) through the
    # dequantised rows' tensor: the same bits either way.
    many = torch.randint(0, N, (3, 50), generator=torch.Generator().manual_seed(1))
    assert torch.equal(gather_rows(t, many, dtype), torch.nn.functional.embedding(many, want))
    assert torch.equal(gather_rows(t, many[0, :33], dtype), want[many[0, :33]])
    assert gather_rows(t, torch.tensor([], dtype=torch.long), dtype).shape == (0, K)


def test_bad_ids_and_tables_are_named() -> None:
    t = table(Qtype.Q4_K)
    for bad in ([0, 37], [-1]):
        with pytest.raises(IndexError):
            gather_rows(t, torch.tensor(bad), torch.bfloat16)
        with pytest.raises(IndexError):
            gather_rows(t.interleave(), torch.tensor(bad), torch.bfloat16)
    with pytest.raises(ValueError, match="dtype: a q4_k embedding table needs the dtype"):
        linear_route.embedding(torch.tensor([0]), t)
    mx = random_q4("mxfp4", 8, 64, seed=0)
    with pytest.raises(ValueError, match="table: an embedding table kept in blocks is one of"):
        gather_rows(mx, torch.tensor([0]), torch.bfloat16)


def test_op_checks() -> None:
    """pagewire::embedding_gguf's schema, fake kernel and argument checks."""
    ids = torch.tensor([[3, 36], [8, 0]])
    for t in (table(Qtype.Q8_0), table(Qtype.Q8_0).interleave(), table(Qtype.Q6_K).interleave(), table(Qtype.Q5_K)):
        torch.library.opcheck(torch.ops.pagewire.embedding_gguf.default, (ids, t.data, str(t.op_qtype), torch.bfloat16))
    t = table(Qtype.Q4_K)
    with pytest.raises(RuntimeError, match="qtype must be 'q8_0', 'q4_0'"):
        torch.ops.pagewire.embedding_gguf(ids, t.data, "tq1_0", torch.bfloat16)
    with pytest.raises(RuntimeError, match="qtype 'mxfp4x8' has no x8 layout"):
        torch.ops.pagewire.embedding_gguf(ids, table(Qtype.Q5_K).data, "mxfp4x8", torch.bfloat16)
    with pytest.raises(RuntimeError, match="ids must be a CPU int64 tensor"):
        torch.ops.pagewire.embedding_gguf(ids.int(), t.data, "q4_k", torch.bfloat16)
