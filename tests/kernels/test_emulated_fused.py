"""The AVX-512 bodies of the gated activations (csrc/cpu/fused_avx512.cpp), run through emulated
intrinsics (tests/kernels/emu_build.py) next to the AVX2 bodies, on a CPU that may lack AVX-512:
against the float64 formulas, and against the AVX2 bodies (gated_body.h gives both the same
operations in the same order; only the lane count differs). Where the CPU has AVX-512,
test_fused_ops.py compares the native bodies bit for bit.
"""
from __future__ import annotations

import ctypes
import math

import pytest
import torch

from tests.kernels import emu_build

EMULATED_FAMILY = "avx512"
AVX2, AVX512 = 0, 1


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return emu_build.build("fused", ["fused_avx2.cpp", "fused_avx512.cpp"])


def run(lib: ctypes.CDLL, isa: int, gelu: bool, x: torch.Tensor) -> torch.Tensor:
    """act(gate) * up of x = cat(gate, up) through one family's body; bf16 travels as its bits."""
    T, I = x.shape[0], x.shape[1] // 2
    bf16 = x.dtype == torch.bfloat16
    out = torch.empty(T, I, dtype=x.dtype)
    view = (lambda t: t.view(torch.int16).numpy()) if bf16 else (lambda t: t.numpy())
    lib.pw_gated(ctypes.c_int(isa), ctypes.c_int(int(gelu)), ctypes.c_int(int(bf16)),
                 view(x).ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(2 * I),
                 view(out).ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(T), ctypes.c_int64(I))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("T,I", [(1, 7), (2, 24), (3, 40), (8, 1536), (5, 1003)])
def test_avx512_gated_matches_avx2_and_float64(lib: ctypes.CDLL, dtype: torch.dtype, gelu: bool, T: int,
                                               I: int) -> None:
    """Vector widths 16, one 8-lane step and scalar tails (I % 16, I % 8), rows on the team's
    threads (8 x 1536), both activations, gates out to where exp clamps and tanh saturates."""
    g = torch.Generator().manual_seed(T * I + int(gelu))
    x = (torch.randn(T, 2 * I, generator=g) * 4).to(dtype)
    x[0, : min(I, 6)] = torch.tensor([0.0, -0.0, 95.0, -95.0, 9.5, -9.5])[: min(I, 6)].to(dtype)
    wide, narrow = run(lib, AVX512, gelu, x), run(lib, AVX2, gelu, x)
    assert torch.equal(wide.view(torch.int32 if dtype == torch.float32 else torch.int16),
                       narrow.view(torch.int32 if dtype == torch.float32 else torch.int16))
    gate, up = x[:, :I].double(), x[:, I:].double()
    if gelu:
        ref = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))) * up
    else:
        ref = gate * torch.sigmoid(gate) * up
    # bf16: act(gate) and the product are each rounded; fp32: the exps carry a few ulps.
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-23
    roundings = 3 if dtype == torch.bfloat16 else 16
    tol = roundings * ulp / 2 * ref.abs() + 1e-6 * ref.abs().max()
    assert bool(((wide.double() - ref).abs() <= tol).all())
