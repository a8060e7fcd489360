"""The x8 interleaved kernels' AVX-512 VNNI build (csrc/cpu/linear_x8_vnni.cpp, x8_body.h with
256-bit vpdpbusd) against their AVX2 build (linear_x8_avx2.cpp, maddubs + madd): both add the same
integer products exactly, so every output must be the same float, bit for bit, for Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS and the lattice types held in its layout (x8_q5nl_body.h), and for
Q2_K / Q3_K / Q4_K / Q5_K / Q6_K (x8k_body.h:
linear_x8k_avx2.cpp against linear_x8k_vnni.cpp).

Checked here on any CPU through the emulated build of both files (tests/kernels/emu_build.py),
at row counts 1-9 (every tile shape of the kernels: 4, 2 and 1 rows, one and two groups per unit),
extreme codes and activations included; test_interleaved.py checks the same natively where the CPU
has AVX-512 VNNI (PAGEWIRE_CPU_ISA=avx2 against avx512 through the ops). The float64 accuracy of the x8 layout itself is
test_interleaved.py's (whose grid runs the avx512 family natively where the CPU has it).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import server._C  # noqa: F401  (the interleave ops)
from server.kernels.quant import QuantizedWeight
from tests.kernels import emu_build
from tests.kernels.test_quant4 import random_q4

EMULATED_FAMILY = "avx512"  # tests/kernels/conftest.py's summary
# The module's fixture compiles five kernel files with SIMDe (the x8 bodies of every type, both
# builds; emu_build runs a compiler per file, one per core): 5.5-8 minutes on a quiet 2-core
# machine with one compiler, past the suite's 900 s limit beside two busy processes (session 42's
# loaded run). A slow build, not a hang: a limit of its own.
pytestmark = pytest.mark.timeout(2700)

F32 = ctypes.POINTER(ctypes.c_float)
I8 = ctypes.POINTER(ctypes.c_int8)
U8 = ctypes.POINTER(ctypes.c_uint8)
QTYPE_ID = {"q8_0": -1, "q4_0": 0, "q4_1": 1, "q4_k": 2, "q5_k": 3, "q6_k": 4, "q5_0": 6, "q5_1": 7,
            "iq4_nl": 8, "iq4_xs": 9, "q2_k": 10, "q3_k": 11, "iq3_xxs": 12, "iq3_s": 13, "iq2_xxs": 14,
            "iq1_s": 15, "iq2_xs": 16, "iq2_s": 17, "iq1_m": 18}  # quant4_kernel.h's Q4Type; -1 Q8_0
ROWS = [1, 2, 3, 4, 5, 7, 9, 13, 16]  # 13: Q6_K's VNNI build runs 8, 4 and 1 rows (x8k_body.h kQ6KRows)
SHAPES = [(64, 256), (40, 512), (40, 1024)]  # N: an even and an odd number of groups (pairs of groups and a lone one);
# K = 1024: the 4-bit pairs' eight-row tiles where the host is AMD (x8_body.h eight_row_tiles)


def weight(qtype: str, n: int, k: int, seed: int, extreme: bool = False) -> QuantizedWeight:
    """Row-layout blocks; `extreme`: every code at its largest magnitude (Q8_0 -127 and 127, 4-bit 0 and 15,
    Q5 31 everywhere, IQ4_NL's -127 level everywhere, IQ4_XS's too under its -32 sub-scale, Q2_K's 3
    under scales and mins of 15, Q3_K's -4 under sub-scales of -32, the lattice types' most negative
    level under their largest multiplier)."""
    if qtype == "q8_0":
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
        if extreme:
            w = torch.where(w >= 0, 1.0, -1.0)
        return QuantizedWeight.quantize(w)
    qw = random_q4(qtype, n, k, seed)
    if extreme and qtype in ("q4_0", "q4_1"):
        codes_at = 2 if qtype == "q4_0" else 4
        data = qw.data.clone().reshape(n, -1, codes_at + 16)
        data[:, :, codes_at:] = torch.where(torch.arange(16) % 2 == 0, 0x0F, 0xF0).to(torch.uint8)
        qw = QuantizedWeight(qw.qtype, data.reshape(n, -1), qw.shape)
    if extreme and qtype in ("q5_0", "q5_1", "iq4_nl"):
        codes_at = {"q5_0": 2, "q5_1": 4, "iq4_nl": 2}[qtype]  # (Q5: the fifth bits, then the nibbles)
        data = qw.data.clone().reshape(n, -1, {"q5_0": 22, "q5_1": 24, "iq4_nl": 18}[qtype])
        data[:, :, codes_at:] = 0x00 if qtype == "iq4_nl" else 0xFF
        qw = QuantizedWeight(qw.qtype, data.reshape(n, -1), qw.shape)
    if extreme and qtype == "q2_k":  # every scale and min 15, every code 3
        data = qw.data.clone().reshape(n, -1, 84)
        data[:, :, :80] = 0xFF
        qw = QuantizedWeight(qw.qtype, data.reshape(n, -1), qw.shape)
    if extreme and qtype == "q3_k":  # hmask, codes and scales all 0: codes -4, sub-scales -32
        data = qw.data.clone().reshape(n, -1, 110)
        data[:, :, :108] = 0
        qw = QuantizedWeight(qw.qtype, data.reshape(n, -1), qw.shape)
    if extreme and qtype == "iq4_xs":  # scales_h, scales_l and codes all 0: sub-scales -32, levels -127
        data = qw.data.clone().reshape(n, -1, 136)
        data[:, :, 2:] = 0
        qw = QuantizedWeight(qw.qtype, data.reshape(n, -1), qw.shape)
    if extreme and qtype in ("iq3_xxs", "iq3_s", "iq2_xxs", "iq1_s"):  # (IQ4_XS's layout) the largest
        data = qw.data.clone().reshape(n, -1, 136)  # multiplier, 31 (ls 63), over code 0, the type's
        data[:, :, 2:8] = 0xFF  # most negative level
        data[:, :, 8:] = 0
        qw = QuantizedWeight(qw.qtype, data.reshape(n, -1), qw.shape)
    if extreme and qtype in ("iq2_xs", "iq2_s", "iq1_m"):  # (the x16 layout) every l 15 (multiplier 31), code 0
        data = qw.data.clone().reshape(n, -1, 138)
        data[:, :, 2:10] = 0xFF
        data[:, :, 10:] = 0
        qw = QuantizedWeight(qw.qtype, data.reshape(n, -1), qw.shape)
    return qw


def activations(m: int, k: int, seed: int, extreme: bool) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    return torch.where(x >= 0, 1.0, -1.0) if extreme else x  # extreme: every quantised value +-127


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return emu_build.build("x8", ["linear_q8_avx2.cpp", "linear_x8_avx2.cpp", "linear_x8_vnni.cpp",
                                  "linear_x8k_avx2.cpp", "linear_x8k_vnni.cpp"])


def ptr(a: np.ndarray, kind: type) -> ctypes._Pointer:  # type: ignore[type-arg]
    return a.ctypes.data_as(kind)


def run(lib: ctypes.CDLL, vnni: int, qtype: str, x: np.ndarray, w: np.ndarray, bias: np.ndarray) -> np.ndarray:
    M, K = x.shape
    N = bias.shape[0]
    q = np.zeros((M, K), np.int8)
    d = np.zeros((M, K // 32), np.float32)
    s = np.zeros((M, K // 32), np.float32)
    lib.pw_quantize_rows_q8_sums(ptr(x, F32), ctypes.c_int64(M), ctypes.c_int64(K), ptr(q, I8), ptr(d, F32), ptr(s, F32))
    out = np.full((M, N), np.nan, np.float32)
    lib.pw_linear_x8(ctypes.c_int(vnni), ctypes.c_int(QTYPE_ID[qtype]), ptr(q, I8), ptr(d, F32), ptr(s, F32),
                     ctypes.c_int64(M), ctypes.c_int64(K), ptr(w, U8), ptr(bias, F32), ptr(out, F32), ctypes.c_int64(N))
    return out


@pytest.mark.parametrize("qtype", list(QTYPE_ID))
@pytest.mark.parametrize("extreme", [False, True])
def test_vnni_x8_is_the_avx2_x8_bit_for_bit_emulated(lib: ctypes.CDLL, qtype: str, extreme: bool) -> None:
    for n, k in SHAPES:
        w = np.ascontiguousarray(weight(qtype, n, k, seed=n + k, extreme=extreme).interleave().data.numpy())
        bias = np.ascontiguousarray(torch.randn(n, generator=torch.Generator().manual_seed(3)).numpy())
        for m in ROWS:
            x = np.ascontiguousarray(activations(m, k, seed=m, extreme=extreme).numpy())
            avx2, vnni = run(lib, 0, qtype, x, w, bias), run(lib, 1, qtype, x, w, bias)
            assert np.isfinite(avx2).all()
            np.testing.assert_array_equal(vnni, avx2, err_msg=f"{qtype} N={n} K={k} M={m}")
