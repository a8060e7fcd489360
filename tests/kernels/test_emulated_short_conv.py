"""The AVX-512 body of the short convolution (csrc/cpu/short_conv_avx512.cpp), run through
emulated intrinsics (tests/kernels/emu_build.py) next to the AVX2 body, on a CPU that may lack
AVX-512: against the float64 reference of test_short_conv.py, and against the AVX2 body (both do
each channel's fused multiply-adds in the same order; only the lane count differs).
Where the CPU has AVX-512, test_short_conv.py runs the same body natively.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tests.kernels import emu_build
from tests.kernels.short_conv_reference import reference

EMULATED_FAMILY = "avx512"
AVX2, AVX512 = 0, 1


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return emu_build.build("short_conv", ["short_conv_avx2.cpp", "short_conv_avx512.cpp"])


def run(lib: ctypes.CDLL, isa: int, bcx: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None,
        state: torch.Tensor) -> torch.Tensor:
    """One sequence through a body; state is updated in place. bf16 tensors travel as their bits."""
    T, C3 = bcx.shape
    C, K = C3 // 3, w_t.shape[0]
    bf16 = bcx.dtype == torch.bfloat16
    out = torch.empty(T, C, dtype=bcx.dtype)
    view = (lambda t: t.view(torch.int16).numpy()) if bf16 else (lambda t: t.numpy())
    b, s, o = view(bcx), view(state), view(out)
    lib.pw_short_conv(ctypes.c_int(isa), ctypes.c_int(int(bf16)), b.ctypes.data_as(ctypes.c_void_p),
                      ctypes.c_int64(3 * C), s.ctypes.data_as(ctypes.c_void_p),
                      w_t.numpy().ctypes.data_as(ctypes.c_void_p),
                      bias.numpy().ctypes.data_as(ctypes.c_void_p) if bias is not None else None,
                      o.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(T), ctypes.c_int64(C), ctypes.c_int64(K))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C,K,T", [(16, 3, 1), (48, 3, 7), (40, 4, 2), (72, 2, 13)])
def test_avx512_body_matches_reference_and_avx2(lib: ctypes.CDLL, dtype: torch.dtype, C: int, K: int, T: int) -> None:
    g = torch.Generator().manual_seed(C * 100 + K * 10 + T)
    bcx = torch.randn(T, 3 * C, generator=g).to(dtype)
    w = torch.randn(C, K, generator=g).to(dtype).float()
    bias = torch.randn(C, generator=g) if K != 3 else None
    init = torch.randn(K - 1, C, generator=g).to(dtype)
    w_t = w.t().contiguous()
    results = []
    for isa in (AVX512, AVX2):
        state = init.clone()
        results.append((run(lib, isa, bcx, w_t, bias, state), state))
    (o512, s512), (o2, s2) = results
    # Channels both bodies run in vector registers agree bit for bit. The AVX-512 body's channel
    # tail runs one lane at a time with a true fused multiply-add, which SIMDe's emulated AVX2
    # fmadd is not (it rounds the product), so there the two may differ in the last bit (on a real
    # CPU both are fused: test_short_conv.py compares the native bodies bit for bit).
    v = C // 16 * 16
    assert torch.equal(o512[:, :v], o2[:, :v]) and torch.equal(s512, s2)
    torch.testing.assert_close(o512[:, v:], o2[:, v:], atol=1e-6, rtol=1e-6)
    ref_out, ref_state = reference(bcx.float(), w, bias, init.float())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=3e-2)
    torch.testing.assert_close(o512.double(), ref_out, **tol)
    torch.testing.assert_close(s512.double(), ref_state, **tol)
    assert np.isfinite(o512.float().numpy()).all()
