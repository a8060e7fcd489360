"""The AVX-512 Gated DeltaNet bodies (csrc/cpu/gdn_avx512.cpp), run through emulated intrinsics
(tests/kernels/emu_build.py) since this CPU may lack AVX-512: one head's chunk (the UT-transform
form) and one token's recurrent step against the float64 definition, with head sizes that leave
masked tails, and the conv row against a float64 sum."""
from __future__ import annotations

import ctypes

import pytest
import torch

from tests.kernels import emu_build
from tests.kernels.gdn_reference import l2norm, relative_error, rule_reference

TOL = 2e-5


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    lib = emu_build.build("gdn", ["gdn_avx512.cpp"])
    lib.pw_gdn_work_floats.restype = ctypes.c_int64
    return lib


def p(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


@pytest.mark.parametrize("L", [1, 2, 17, 64])
@pytest.mark.parametrize("dk,dv", [(16, 16), (20, 40), (128, 128)])
def test_avx512_gdn_chunk_and_step(lib: ctypes.CDLL, L: int, dk: int, dv: int) -> None:
    gen = torch.Generator().manual_seed(L * 1000 + dk + dv)
    q, k = torch.randn(L, 1, dk, generator=gen), torch.randn(L, 1, dk, generator=gen)
    v = torch.randn(L, 1, dv, generator=gen)
    g = -torch.rand(L, 1, generator=gen) * 2
    beta = torch.rand(L, 1, generator=gen)
    state0 = torch.randn(1, dk, dv, generator=gen) * 0.5
    want, want_state = rule_reference(q, k, v, g, beta, state0)
    qn = (l2norm(q[:, 0]) * dk**-0.5).contiguous()
    kn = l2norm(k[:, 0]).contiguous()
    state = state0[0].clone()
    out = torch.full((L, dv), float("nan"))
    work = torch.empty(max(int(lib.pw_gdn_work_floats(L, dk, dv)), dv))
    vc, gc, bc = v[:, 0].contiguous(), g[:, 0].contiguous(), beta[:, 0].contiguous()
    lib.pw_gdn_chunk_avx512(p(qn), p(kn), p(vc), p(gc), p(bc), p(state), p(out), p(work),
                            ctypes.c_int64(L), ctypes.c_int64(dk), ctypes.c_int64(dv))
    assert relative_error(out, want[:, 0]) <= TOL
    assert relative_error(state, want_state[0]) <= TOL


@pytest.mark.parametrize("C", [16, 37])
def test_avx512_gdn_conv_row(lib: ctypes.CDLL, C: int) -> None:
    gen = torch.Generator().manual_seed(C)
    K = 4
    rows = [torch.randn(C, generator=gen) for _ in range(K)]
    wt = torch.randn(K, C, generator=gen)
    out = torch.full((C,), float("nan"))
    ptrs = (ctypes.c_void_p * K)(*[r.data_ptr() for r in rows])
    lib.pw_gdn_conv_row_avx512(ptrs, p(wt), p(out), ctypes.c_int64(K), ctypes.c_int64(C))
    want = sum(wt[i].double() * rows[i].double() for i in range(K))
    assert relative_error(out, want) <= 1e-6
