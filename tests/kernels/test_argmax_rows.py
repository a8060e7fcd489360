"""pagewire::argmax_rows (cpu/argmax.cpp), the greedy sampler's argmax, against torch.argmax on
every CPU family here, over float32 and bf16 rows: random rows, ties (the first index wins, also across the threads' slices),
NaNs (the first NaN wins), rows of -inf, +inf, one value, a row stride, and 1 or 2 threads."""
from __future__ import annotations

import pytest
import torch

from server.kernels import ops

SHAPES = [(1, 1), (1, 7), (1, 8), (3, 9), (1, 49152), (2, 32000), (8, 49152), (5, 16385), (1, 151936)]


def _check(x: torch.Tensor) -> None:
    got = ops.argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    torch.testing.assert_close(got, x.argmax(dim=-1), rtol=0, atol=0)
    # bf16 rows (the greedy step's unwidened logits): the index of the widened row's argmax.
    xb = x.bfloat16()
    got = ops.argmax_rows(xb)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    torch.testing.assert_close(got, xb.float().argmax(dim=-1), rtol=0, atol=0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_random_rows_are_torch_argmax(cpu_isa: str, shape: tuple[int, int], threads: int) -> None:
    g = torch.Generator().manual_seed(shape[0] * 100003 + shape[1])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(torch.randn(shape, generator=g) * 4)
        # Logits rounded to bf16 (as a bf16 model's are) hold many exact ties.
        _check((torch.randn(shape, generator=g) * 4).bfloat16().float())
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("v", [17, 49152, 32003])
def test_ties_keep_the_first_index_across_slices(cpu_isa: str, v: int) -> None:
    for pos in sorted({0, 1, 7, 8, v // 2 - 1, v // 2, v // 2 + 1, v - 9, v - 1}):
        x = torch.zeros(2, v)
        x[0, pos] = 3.0
        x[0, -1] = 3.0  # a later tie, in the other thread's slice
        x[1, pos:] = 5.0  # every value from pos on ties
        _check(x)


@pytest.mark.parametrize("v", [9, 49152])
def test_the_first_nan_wins(cpu_isa: str, v: int) -> None:
    for pos in sorted({0, 5, v // 2 - 1, v // 2, v - 1}):
        x = torch.randn(3, v)
        x[0, pos] = float("nan")
        x[1, pos] = float("nan")
        x[1, -1] = float("nan")
        x[1, 0] = float("inf")
        x[2, pos] = float("inf")
        _check(x)


def test_infinite_and_strided_rows(cpu_isa: str) -> None:
    x = torch.full((3, 40000), float("-inf"))
    x[1, 12345] = -1e30
    x[2].fill_(float("inf"))
    _check(x)
    wide = torch.randn(4, 50000)
    _check(wide[:, :49152])  # a row stride wider than the row
    wide_bf16 = wide.bfloat16()[:, :49152]
    torch.testing.assert_close(ops.argmax_rows(wide_bf16), wide_bf16.float().argmax(dim=-1), rtol=0, atol=0)
    _check(torch.tensor([[0.0, -0.0, 0.0], [-0.0, 0.0, -0.0]]))  # signed zeros compare equal


def test_bad_input_is_refused() -> None:
    with pytest.raises(RuntimeError, match="argmax_rows: x must be a float32"):
        ops.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="argmax_rows: x must be a float32 or bfloat16"):
        ops.argmax_rows(torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="argmax_rows: x must be a float32"):
        ops.argmax_rows(torch.zeros(3))
    with pytest.raises(RuntimeError, match="no columns"):
        ops.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="contiguous in its last dim"):
        ops.argmax_rows(torch.zeros(4, 3).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 49152), (3, 9), (8, 32000), (0, 5), (12, 17)])
def test_argmax_list_gives_the_rows_argmax_as_ints(cpu_isa: str, shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(shape[1])) * 4).to(dtype)
    got = ops.argmax_list(x)
    assert isinstance(got, list) and all(type(i) is int for i in got)
    assert got == x.float().argmax(dim=-1).tolist() == ops.argmax_rows(x).tolist()


def test_argmax_list_falls_back_to_torch_for_what_argmax_rows_refuses() -> None:
    x = torch.randn(3, 50) * 4
    for other in (x.half(), x.double(), x.t().contiguous().t()):  # fp16, fp64, a column-major view
        assert ops.argmax_list(other) == other.argmax(dim=-1).tolist()
    with pytest.raises(IndexError):
        ops.argmax_list(torch.zeros(2, 0))
