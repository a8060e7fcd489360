"""The AVX512-BF16 linear kernel (csrc/cpu/linear_avx512.cpp), run through emulated intrinsics.

On a CPU without AVX512-BF16 the extension never calls this kernel, so tests/kernels/test_linear.py
skips its family; here the same file is built against SIMDe (tests/kernels/emu_build.py) and checked
against a float64 reference, with the kernel's row-block shapes (M = 1 takes 8 weight rows per
block, more rows 4, in groups of up to 6), masked K tails and N % NR tails, and for batch
invariance.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tests.kernels import emu_build

# The CPU family whose kernels this file checks through emulation (tests/kernels/conftest.py's summary).
EMULATED_FAMILY = "avx512bf16"

U16 = ctypes.POINTER(ctypes.c_uint16)


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return emu_build.build("bf16", ["linear_avx512.cpp"])


def bits(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.contiguous().view(torch.int16).numpy().view(np.uint16))


def run(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    (M, K), N = x.shape, w.shape[0]
    xb, wb = bits(x), bits(w)
    bb = bits(b) if b is not None else None
    out = np.zeros((M, N), np.uint16)
    lib.pw_linear_bf16_avx512(xb.ctypes.data_as(U16), wb.ctypes.data_as(U16),
                              bb.ctypes.data_as(U16) if bb is not None else None, out.ctypes.data_as(U16),
                              ctypes.c_int64(M), ctypes.c_int64(N), ctypes.c_int64(K))
    return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)


@pytest.mark.parametrize("M", [1, 2, 5, 6, 8, 13, 17])
@pytest.mark.parametrize("N,K", [(16, 64), (13, 96), (9, 200), (8, 31)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_avx512_bf16_kernel_matches_float64_reference(lib: ctypes.CDLL, M: int, N: int, K: int,
                                                      with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(M * 7 + N + K)
    x = torch.randn((M, K), generator=gen).bfloat16()
    w = (torch.randn((N, K), generator=gen) / K**0.5).bfloat16()
    b = torch.randn((N,), generator=gen).bfloat16() if with_bias else None
    y = run(lib, x, w, b)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    # fp32 accumulation, then one bf16 rounding (2**-9 relative) of each output.
    bound = 2.0**-8 * ref.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T)
    assert bool(((y.double() - ref).abs() <= bound + 1e-6).all())


def test_avx512_bf16_kernel_is_batch_invariant(lib: ctypes.CDLL) -> None:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn((17, 136), generator=gen).bfloat16()
    w = torch.randn((21, 136), generator=gen).bfloat16()
    b = torch.randn((21,), generator=gen).bfloat16()
    alone = torch.cat([run(lib, x[m:m + 1], w, b) for m in range(17)])
    for M in range(2, 18):
        assert torch.equal(run(lib, x[:M], w, b).view(torch.int16), alone[:M].view(torch.int16)), f"M = {M}"
