"""The AVX512-BF16 linear kernels (csrc/cpu/linear_avx512.cpp, and linear_bf16x8_avx512.cpp on the
interleaved x8 layout), run through emulated intrinsics.

On a CPU without AVX512-BF16 the extension never calls this kernel, so tests/kernels/test_linear.py
skips its family; here the same file is built against SIMDe (tests/kernels/emu_build.py) and checked
against a float64 reference, with the kernel's row-block shapes (M = 1 takes 8 weight rows per
block, more rows 4, in groups of up to 6), masked K tails and N % NR tails, and for batch
invariance; the x8 kernel must give the row-layout kernel's bits (its tiles of one to three x rows,
K % 32 = 16 tails, K over 2048 in spans, N % 8 rows left in row layout).
"""
from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np
import pytest
import torch

import server._C  # noqa: F401  (torch.ops.pagewire.interleave_bf16)
from tests.kernels import emu_build

# The CPU family whose kernels this file checks through emulation (tests/kernels/conftest.py's summary).
EMULATED_FAMILY = "avx512bf16"

U16 = ctypes.POINTER(ctypes.c_uint16)


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return emu_build.build("bf16", ["linear_avx512.cpp", "linear_bf16x8_avx512.cpp"])


def bits(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.contiguous().view(torch.int16).numpy().view(np.uint16))


def _call(kernel: Callable[..., None], x: torch.Tensor, wb: np.ndarray, b: torch.Tensor | None,
          N: int) -> torch.Tensor:
    """kernel(x, w, bias, out, M, N, K) on bf16 bit patterns; wb: the weight's uint16 bits in its layout."""
    M, K = x.shape
    xb = bits(x)
    bb = bits(b) if b is not None else None
    out = np.zeros((M, N), np.uint16)
    kernel(xb.ctypes.data_as(U16), wb.ctypes.data_as(U16), bb.ctypes.data_as(U16) if bb is not None else None,
           out.ctypes.data_as(U16), ctypes.c_int64(M), ctypes.c_int64(N), ctypes.c_int64(K))
    return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)


def run(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return _call(lib.pw_linear_bf16_avx512, x, bits(w), b, w.shape[0])


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


def run_x8(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    x8 = np.ascontiguousarray(torch.ops.pagewire.interleave_bf16(w).numpy().view(np.uint16))
    return _call(lib.pw_linear_bf16x8_avx512, x, x8, b, w.shape[0])


@pytest.mark.parametrize("N,K", [(8, 16), (16, 64), (21, 48), (45, 208), (7, 32), (9, 2096)])
def test_x8_kernel_gives_the_row_layout_kernels_bits(lib: ctypes.CDLL, N: int, K: int) -> None:
    gen = torch.Generator().manual_seed(N * 31 + K)
    w = torch.randn((N, K), generator=gen).bfloat16()
    b = torch.randn((N,), generator=gen).bfloat16()
    for M in (1, 2, 3, 4, 5, 8, 13):
        x = torch.randn((M, K), generator=gen).bfloat16()
        for bias in (None, b):
            got, want = run_x8(lib, x, w, bias), run(lib, x, w, bias)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (M, bias is None)


@pytest.mark.parametrize("N,K", [(8, 16), (21, 48), (45, 208), (7, 32), (9, 2096)])
def test_packed_kernel_gives_the_row_layout_kernels_bits(lib: ctypes.CDLL, N: int, K: int) -> None:
    """The packed layout (pack_bf16z): one to four x rows straight from the packed bytes, more from
    an unpacked copy of each group, steps left 16-bit where a value's high byte is not in its row's
    table; and the groups unpacked back to row layout bit for bit."""
    gen = torch.Generator().manual_seed(N * 7 + K)
    w = torch.randn((N, K), generator=gen).bfloat16()
    w.view(-1)[:: 37] = torch.tensor(1e-30).bfloat16()  # far-off values: some steps stay raw
    w.view(-1)[5:: 53] = torch.tensor(-3e25).bfloat16()
    b = torch.randn((N,), generator=gen).bfloat16()
    packed = np.ascontiguousarray(torch.ops.pagewire.pack_bf16z(w).numpy())
    p8 = packed.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    groups = N // 8
    rows = np.zeros((groups * 8, K), np.uint16)
    lib.pw_unpack_bf16z_avx512(p8, ctypes.c_int64(groups), rows.ctypes.data_as(U16))
    assert np.array_equal(rows, bits(w[: groups * 8]))
    for M in (1, 2, 3, 4, 5, 8, 13):
        x = torch.randn((M, K), generator=gen).bfloat16()
        for bias in (None, b):
            got = np.zeros((M, N), np.uint16)
            bb = bits(bias) if bias is not None else None
            lib.pw_linear_bf16z_avx512(bits(x).ctypes.data_as(U16), p8,
                                       bb.ctypes.data_as(U16) if bb is not None else None,
                                       got.ctypes.data_as(U16), ctypes.c_int64(M), ctypes.c_int64(N), ctypes.c_int64(K))
            want = run(lib, x, w, bias)
            assert np.array_equal(got, bits(want)), (M, bias is None)
