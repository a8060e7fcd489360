"""The AVX-512 VNNI Q8_0 kernel (csrc/cpu/linear_q8_avx512.cpp), run through emulated intrinsics.

This machine's CPU may lack AVX-512 VNNI, so the kernel file is built unchanged against SIMDe
(tests/kernels/emu_build.py) next to the AVX2 kernel and the activation quantiser, and checked:
  - against a float64 reference of the dequantised weights and activations;
  - against the AVX2 kernel: both compute each block's int32 dot exactly, so they differ only in
    the order of the fp32 accumulation;
  - for batch invariance: a row's result is bitwise the same alone and inside any batch.
Where the CPU has VNNI, tests/kernels/test_quant.py runs the same kernel natively in the extension
(family "avx512" and up).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from server.kernels.quant import QuantizedWeight
from tests.kernels import emu_build

# The CPU family whose kernels this file checks through emulation (tests/kernels/conftest.py's summary).
EMULATED_FAMILY = "avx512"

F32 = ctypes.POINTER(ctypes.c_float)
I8 = ctypes.POINTER(ctypes.c_int8)
U8 = ctypes.POINTER(ctypes.c_uint8)
AVX2, AVX512 = 0, 1


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return emu_build.build("q8", ["linear_q8_avx2.cpp", "linear_q8_avx512.cpp"])


def ptr(a: np.ndarray, kind: type) -> ctypes._Pointer:  # type: ignore[type-arg]
    return a.ctypes.data_as(kind)


def quantize_rows(lib: ctypes.CDLL, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    M, K = x.shape
    q = np.zeros((M, K), np.int8)
    d = np.zeros((M, K // 32), np.float32)
    lib.pw_quantize_rows_q8(ptr(x, F32), ctypes.c_int64(M), ctypes.c_int64(K), ptr(q, I8), ptr(d, F32))
    return q, d


def run(lib: ctypes.CDLL, isa: int, q: np.ndarray, d: np.ndarray, w: np.ndarray, bias: np.ndarray | None,
        N: int) -> np.ndarray:
    M, K = q.shape
    out = np.full((M, N), np.nan, np.float32)
    q, d = np.ascontiguousarray(q), np.ascontiguousarray(d)
    lib.pw_linear_q8_0(ctypes.c_int(isa), ptr(q, I8), ptr(d, F32), ctypes.c_int64(M), ctypes.c_int64(K), ptr(w, U8),
                       ptr(bias, F32) if bias is not None else None, ptr(out, F32), ctypes.c_int64(N))
    return out


def case(M: int, N: int, K: int, seed: int, with_bias: bool) -> tuple[np.ndarray, QuantizedWeight, np.ndarray | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).numpy()
    w = torch.randn(N, K, generator=gen)
    w[0, :32] = 0  # an all-zero block (scale 0)
    qw = QuantizedWeight.quantize(w)
    bias = torch.randn(N, generator=gen).numpy() if with_bias else None
    return np.ascontiguousarray(x), qw, bias


# K covers whole 8-block groups, a pair tail and a lone block; N covers the 4-row groups' tail.
SHAPES = [(1, 4, 256), (1, 7, 96), (2, 9, 288), (3, 16, 64), (4, 5, 32), (5, 13, 544), (8, 12, 320), (17, 6, 160)]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_vnni_kernel_matches_float64_reference(lib: ctypes.CDLL, M: int, N: int, K: int, with_bias: bool) -> None:
    x, qw, bias = case(M, N, K, seed=M * 1000 + N * 10 + K, with_bias=with_bias)
    q, d = quantize_rows(lib, x)
    w = np.ascontiguousarray(qw.data.numpy())
    got = run(lib, AVX512, q, d, w, bias, N)
    # The reference is the exact product of what the kernel multiplies: the dequantised activations
    # and weights, in float64; only the kernel's fp32 accumulation separates the two.
    xd = (q.astype(np.float64).reshape(M, -1, 32) * d.astype(np.float64)[:, :, None]).reshape(M, K)
    ref = xd @ qw.dequantize(torch.float64).numpy().T + (bias.astype(np.float64) if bias is not None else 0.0)
    scale = np.abs(xd) @ np.abs(qw.dequantize(torch.float64).numpy().T) + 1e-30
    assert np.all(np.abs(got - ref) <= 2e-6 * scale + 1e-6), np.max(np.abs(got - ref) / scale)
    avx2 = run(lib, AVX2, q, d, w, bias, N)
    assert np.allclose(got, avx2, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(avx2))))


def test_vnni_kernel_is_batch_invariant(lib: ctypes.CDLL) -> None:
    x, qw, bias = case(17, 11, 352, seed=7, with_bias=True)
    q, d = quantize_rows(lib, x)
    w = np.ascontiguousarray(qw.data.numpy())
    alone = np.concatenate([run(lib, AVX512, q[m:m + 1], d[m:m + 1], w, bias, 11) for m in range(17)])
    for M in range(2, 18):
        batch = run(lib, AVX512, q[:M], d[:M], w, bias, 11)
        assert np.array_equal(batch, alone[:M]), f"M = {M}"


def test_vnni_kernel_handles_extreme_bytes(lib: ctypes.CDLL) -> None:
    """Weights of -128 (a GGUF file may hold them) and activations of +-127: the +128 offset and the
    weight-sum correction must cancel exactly, with no int32 overflow."""
    M, N, K = 3, 4, 128
    q = np.full((M, K), 127, np.int8)
    q[1] = -127
    q[2, ::2] = -127
    d = np.ones((M, K // 32), np.float32)
    blocks = np.zeros((N, K // 32, 34), np.uint8)
    blocks[:, :, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    blocks[:, :, 2:] = np.array(-128, np.int8).view(np.uint8)
    blocks[1, :, 2:] = 127
    w = np.ascontiguousarray(blocks.reshape(N, -1))
    got = run(lib, AVX512, q, d, w, None, N)
    wq = blocks[:, :, 2:].view(np.int8).reshape(N, K).astype(np.int64)
    ref = q.astype(np.int64) @ wq.T
    assert np.array_equal(got, ref.astype(np.float32))
