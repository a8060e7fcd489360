"""server._C.fast (csrc/fast_calls.cpp): the per-step CPU ops as plain pybind11 calls give what their
torch.ops.pagewire registrations give, bit for bit, and raise the same Python exceptions."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import server._C
from server.kernels.quant import QuantizedWeight
from tests.kernels.test_quant4 import random_q4

fast = server._C.fast
P = torch.ops.pagewire


def _same(a: Callable[..., Any], b: Callable[..., Any], *args: Any) -> None:
    # In-place ops (add_rms_norm's residual): each call gets its own copies of the tensors.
    copies = [[x.clone() if isinstance(x, torch.Tensor) else x for x in args] for _ in range(2)]
    ra, rb = a(*copies[0]), b(*copies[1])
    assert torch.equal(ra, rb)
    for x, y in zip(*copies):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norms_equal_the_ops(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x, d, w = (torch.randn(3, 576, generator=g).to(dtype) for _ in range(3))
    _same(fast.rms_norm, P.rms_norm, x, w[0], 1e-5)
    _same(fast.add_rms_norm, P.add_rms_norm, x, d, w[0], 1e-6)


def test_logits_ops_equal_the_ops() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 49152, generator=g).bfloat16()
    _same(fast.widen_rows, P.widen_rows, logits)
    _same(fast.argmax_rows, P.argmax_rows, logits.float())


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q4_k", "q6_k"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_linears_and_embedding_equal_the_ops(qtype: str, interleaved: bool) -> None:
    w = random_q4(qtype, 64, 256, seed=2)
    if interleaved:
        w = w.interleave()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    _same(fast.linear_q4, P.linear_q4, x, w.data, str(w.op_qtype), None)
    ids = torch.tensor([0, 9, 63, 8])
    _same(fast.embedding_gguf, P.embedding_gguf, ids, w.data, str(w.op_qtype), torch.bfloat16)


@pytest.mark.parametrize("interleaved", [False, True])
def test_q8_0_and_bf16x8_linears_equal_the_ops(interleaved: bool) -> None:
    g = torch.Generator().manual_seed(4)
    w = QuantizedWeight.quantize(torch.randn(64, 256, generator=g) * 0.05, "q8_0")
    if interleaved:
        w = w.interleave()
    x = torch.randn(2, 256, generator=g).bfloat16()
    bias = torch.randn(64, generator=g).bfloat16()
    _same(fast.linear_q8_0, P.linear_q8_0, x, w.data, bias, w.interleaved)
    wb = QuantizedWeight.from_bf16(torch.randn(64, 256, generator=g).bfloat16())
    _same(fast.linear_bf16x8, P.linear_bf16x8, x, wb.data, None)


@pytest.mark.parametrize("qtype,interleaved", [
    *[(q, False) for q in ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "mxfp4", "q5_0", "q5_1", "iq4_nl",
                           "iq4_xs", "q2_k", "q3_k", "iq3_xxs")],
    *[(q, True) for q in ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "iq4_nl",
                          "iq4_xs", "q2_k", "q3_k", "iq2_xxs")],  # x8 layouts
])
def test_kernel_at_every_row_count_is_its_blocks_of_sixteen(cpu_isa: str, qtype: str, interleaved: bool) -> None:
    """linear_rows (the autotune's "kernel" above 16 rows, batch-invariant mode, prefill chunks)
    runs the integer kernel in blocks of 16 rows into one output: each row's floats are those of
    the op called with its block alone, for every row count, layout, dtype and thread count, with
    a bias and a tail of N % 8 rows past the x8 groups; and they stay within the Q8 activation
    rounding of the dequantised weight's float64 product, where the op's own rule (dequantise +
    GEMM above 16 rows) would not have run the kernel at all."""
    g = torch.Generator().manual_seed(6)
    n, k = 76, 256  # 9 groups of 8 and a 4-row tail
    if qtype == "q8_0":
        w = QuantizedWeight.quantize(torch.randn(n, k, generator=g) * 0.05, "q8_0")
    else:
        w = random_q4(qtype, n, k, seed=7)
    if interleaved:
        w = w.interleave()
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m, dtype in ((17, torch.float32), (40, torch.bfloat16), (33, torch.float32), (16, torch.bfloat16)):
                x = torch.randn(m, k, generator=g).to(dtype)
                bias = torch.randn(n, generator=g).to(dtype)
                got = w.linear_rows(x, bias)
                blocks = torch.cat([w.linear(x[i : i + 16], bias) for i in range(0, m, 16)])
                assert got.dtype == dtype and torch.equal(got, blocks), (t, m, dtype)
                ref = x.double() @ w.dequantize(torch.float32).double().T + bias.double()
                err = (got.double() - ref).abs().max() / ref.abs().max()
                assert err < (2e-2 if dtype is torch.bfloat16 else 1e-2), (t, m, dtype, float(err))
    finally:
        torch.set_num_threads(threads)


def test_errors_are_the_ops_errors() -> None:
    w = random_q4("q4_0", 16, 64, seed=5)
    for call in (fast.embedding_gguf, P.embedding_gguf):
        with pytest.raises(IndexError, match="out of range for an embedding table of 16 rows"):
            call(torch.tensor([16]), w.data, "q4_0", torch.bfloat16)
        with pytest.raises(RuntimeError, match="qtype must be 'q8_0', 'q4_0'"):
            call(torch.tensor([0]), w.data, "tq1_0", torch.bfloat16)
    for call in (fast.add_rms_norm, P.add_rms_norm):
        with pytest.raises(RuntimeError, match="delta shape"):
            call(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="dtype must be a torch.dtype"):
        fast.embedding_gguf(torch.tensor([0]), w.data, "q4_0", "bfloat16")
