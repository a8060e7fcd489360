"""pagewire::widen_rows (cpu/widen_rows.cpp), compute_logits' bf16 -> float32: every bit of torch's
`.float()` on every CPU family here, for one row (the calling thread) and several (the threads'
column slices), odd widths, NaN, infinities and signed zeros, 1 or 2 threads; ops.to_float32 takes
it only for bf16 [S, V] CPU rows and refuses nothing else."""
from __future__ import annotations

import pytest
import torch

from server.kernels import ops

SHAPES = [(1, 1), (1, 7), (1, 49152), (2, 32000), (8, 49152), (3, 4097), (5, 9)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_widening_is_torch_float_bit_for_bit(cpu_isa: str, shape: tuple[int, int], threads: int) -> None:
    g = torch.Generator().manual_seed(shape[0] * 7919 + shape[1])
    x = (torch.randn(shape, generator=g) * 30).bfloat16()
    flat = x.view(-1)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40], dtype=torch.bfloat16)
    flat[: min(len(specials), flat.numel())] = specials[: flat.numel()]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.ops.pagewire.widen_rows(x)
    finally:
        torch.set_num_threads(before)
    want = x.float()
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # NaN payloads and -0.0 too


def test_to_float32_routes_only_bf16_matrices() -> None:
    x = torch.randn(3, 5).bfloat16()
    t = x.t()  # not contiguous: widened from a contiguous copy, values in place
    assert torch.equal(ops.to_float32(t), t.float())
    for other in (torch.randn(3, 5).half(), torch.randn(3, 5), torch.randn(7).bfloat16()):
        assert torch.equal(ops.to_float32(other), other.float())
    with pytest.raises(RuntimeError, match="widen_rows: x must be a bfloat16"):
        torch.ops.pagewire.widen_rows(torch.randn(2, 3))
