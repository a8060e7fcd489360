"""The AVX-512 VNNI 4-bit and K-quant kernels (csrc/cpu/linear_q4_avx512.cpp: Q4_0, Q4_1, Q4_K, MXFP4;
linear_k56_avx512.cpp: Q5_K, Q6_K), run through emulated intrinsics.

This machine's CPU may lack AVX-512 VNNI, so the kernel file is built unchanged against SIMDe
(tests/kernels/emu_build.py) next to the AVX2 4-bit kernels and the activation quantiser, and
checked for each type:
  - against a float64 reference of the dequantised weights (the extension's dequantize_q4) times
    the dequantised activations;
  - against the AVX2 kernel: both compute each block's int32 dot exactly, so they differ only in
    the order of the fp32 accumulation;
  - for batch invariance: a row's result is bitwise the same alone and inside any batch;
  - for exactness at the extremes: codes 0 and 15 against activations of +-127.
Shapes cover M = 1..16 (the op's kernel limit), N tails of the 4-row groups, and K with whole
8-block steps, a tail pair and a lone last block.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import server._C  # noqa: F401  (loads the op registrations: dequantize_q4)
from server.kernels.quant import QuantizedWeight
from tests.gguf_files import random_k_blocks
from tests.kernels import emu_build

# The CPU family whose kernels this file checks through emulation (tests/kernels/conftest.py's summary).
EMULATED_FAMILY = "avx512"

F32 = ctypes.POINTER(ctypes.c_float)
I8 = ctypes.POINTER(ctypes.c_int8)
U8 = ctypes.POINTER(ctypes.c_uint8)
AVX2, AVX512 = 0, 1
QTYPE_ID = {"q4_0": 0, "q4_1": 1, "q4_k": 2, "q5_k": 3, "q6_k": 4, "mxfp4": 5}  # csrc/cpu/quant4_kernel.h's Q4Type
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q4_k": 144, "q5_k": 176, "q6_k": 210, "mxfp4": 17}
BLOCK_VALUES = {"q4_0": 32, "q4_1": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256, "mxfp4": 32}
# where a block's code bytes start (Q6_K: 0..192)
CODES_AT = {"q4_0": 2, "q4_1": 4, "q4_k": 16, "q5_k": 16, "mxfp4": 1}
K_NAMES = {"q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return emu_build.build("q4", ["linear_q8_avx2.cpp", "linear_q4_avx2.cpp", "linear_q4_avx512.cpp",
                                  "linear_k56_avx2.cpp", "linear_k56_avx512.cpp", "linear_q5nl_avx2.cpp",
                                  "linear_q2k_avx2.cpp", "linear_q3k_avx2.cpp"])


def ptr(a: np.ndarray, kind: type) -> ctypes._Pointer:  # type: ignore[type-arg]
    return a.ctypes.data_as(kind)


def quantize_rows(lib: ctypes.CDLL, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int8 [M, K], d [M, K/32], s [M, K/32]) from the AVX2 quantiser, as the op uses it."""
    M, K = x.shape
    q = np.zeros((M, K), np.int8)
    d = np.zeros((M, K // 32), np.float32)
    s = np.zeros((M, K // 32), np.float32)
    lib.pw_quantize_rows_q8_sums(ptr(x, F32), ctypes.c_int64(M), ctypes.c_int64(K), ptr(q, I8), ptr(d, F32),
                                 ptr(s, F32))
    return q, d, s


def run(lib: ctypes.CDLL, isa: int, qtype: str, act: tuple[np.ndarray, np.ndarray, np.ndarray], w: np.ndarray,
        bias: np.ndarray | None) -> np.ndarray:
    q, d, s = (np.ascontiguousarray(a) for a in act)
    M, K = q.shape
    N = w.shape[0]
    out = np.full((M, N), np.nan, np.float32)
    lib.pw_linear_q4(ctypes.c_int(isa), ctypes.c_int(QTYPE_ID[qtype]), ptr(q, I8), ptr(d, F32), ptr(s, F32),
                     ctypes.c_int64(M), ctypes.c_int64(K), ptr(w, U8), ptr(bias, F32) if bias is not None else None,
                     ptr(out, F32), ctypes.c_int64(N))
    return out


def weight_bytes(qtype: str, N: int, K: int, seed: int) -> np.ndarray:
    """[N, row bytes] uint8 GGUF blocks: q4_0 from pagewire's quantiser, q4_1 from the `gguf`
    package's, the K-quants random valid blocks (gguf has no K-quant quantiser); row 0's first block has a
    zero scale (q4_0) or the all-zero weights' block (q4_1)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen)
    w[0, :32] = 0
    if qtype == "q4_0":
        return np.ascontiguousarray(QuantizedWeight.quantize(w, "q4_0").data.numpy())
    if qtype in ("q4_1", "mxfp4"):
        from gguf import GGMLQuantizationType, quants

        t = GGMLQuantizationType.Q4_1 if qtype == "q4_1" else GGMLQuantizationType.MXFP4
        return np.ascontiguousarray(quants.quantize(w.numpy(), t)).reshape(N, -1)
    return np.ascontiguousarray(random_k_blocks(N, K, K_NAMES[qtype], seed))


def dequantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """float64 [N, K] by the extension's dequantize_q4."""
    return torch.ops.pagewire.dequantize_q4(torch.from_numpy(w.copy()), qtype).double().numpy()


def offsets(w: np.ndarray, qtype: str) -> np.ndarray:
    """float64 [N, K]: each value's offset term (its block's value at code 0; MXFP4's kernels
    offset its codes by 12 steps of 2^(e - 128))."""
    blocks = w.copy().reshape(w.shape[0], -1, BLOCK_BYTES[qtype])
    if qtype == "mxfp4":
        step = np.exp2(blocks[:, :, 0].astype(np.float64) - 128)
        return np.repeat(12 * step, 32, axis=1)
    if qtype == "q6_k":
        blocks[:, :, :192] = 0  # ql and qh: every code 0 (value -32 d sc)
    else:
        blocks[:, :, CODES_AT[qtype]:] = 0
    return dequantize(np.ascontiguousarray(blocks.reshape(w.shape)), qtype)


def case(qtype: str, M: int, N: int, K: int, seed: int,
         with_bias: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    gen = torch.Generator().manual_seed(seed + 1)
    x = np.ascontiguousarray(torch.randn(M, K, generator=gen).numpy())
    bias = torch.randn(N, generator=gen).numpy() if with_bias else None
    return weight_bytes(qtype, N, K, seed), bias, x


SHAPES = {
    # K / 32 blocks: 1 (a lone block), 3 (a pair and a lone one), 8, 9, 10 (a step and a pair), 17.
    "q4_0": [(1, 1, 32), (1, 4, 544), (2, 3, 96), (3, 5, 288), (4, 9, 320), (5, 16, 256), (8, 5, 544),
             (16, 9, 96)],
    "q4_k": [(1, 1, 256), (1, 4, 768), (2, 3, 256), (3, 5, 768), (4, 9, 256), (5, 16, 768), (8, 5, 256),
             (16, 9, 768)],
}
SHAPES["q4_1"] = SHAPES["mxfp4"] = SHAPES["q4_0"]
SHAPES["q5_k"] = SHAPES["q6_k"] = SHAPES["q4_k"]
CASES = [(t, *shape) for t in QTYPE_ID for shape in SHAPES[t]]


@pytest.mark.parametrize("qtype,M,N,K", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_vnni_q4_kernel_matches_float64_reference(lib: ctypes.CDLL, qtype: str, M: int, N: int, K: int,
                                                  with_bias: bool) -> None:
    w, bias, x = case(qtype, M, N, K, seed=M * 1000 + N * 10 + K, with_bias=with_bias)
    act = quantize_rows(lib, x)
    q, d, _ = act
    got = run(lib, AVX512, qtype, act, w, bias)
    # The reference is the exact product of what the kernel multiplies: the dequantised activations
    # and weights, in float64; only the kernel's fp32 steps separate the two. The bound scales with
    # the terms' magnitudes before cancellation: |a q| <= |w| + |c| per value, plus the offsets |c|.
    xd = (q.astype(np.float64).reshape(M, -1, 32) * d.astype(np.float64)[:, :, None]).reshape(M, K)
    wd = dequantize(w, qtype)
    ref = xd @ wd.T + (bias.astype(np.float64) if bias is not None else 0.0)
    scale = np.abs(xd) @ (np.abs(wd) + 2 * np.abs(offsets(w, qtype))).T + 1e-30
    assert np.all(np.abs(got - ref) <= 4e-6 * scale + 1e-6), np.max(np.abs(got - ref) / scale)
    avx2 = run(lib, AVX2, qtype, act, w, bias)
    assert np.allclose(got, avx2, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(avx2))))


@pytest.mark.parametrize("qtype", list(QTYPE_ID))
def test_vnni_q4_kernel_is_batch_invariant(lib: ctypes.CDLL, qtype: str) -> None:
    K = 512 if qtype in K_NAMES else 288
    w, bias, x = case(qtype, 16, 11, K, seed=7, with_bias=True)
    q, d, s = quantize_rows(lib, x)
    alone = np.concatenate([run(lib, AVX512, qtype, (q[m:m + 1], d[m:m + 1], s[m:m + 1]), w, bias)
                            for m in range(16)])
    for M in range(2, 17):
        batch = run(lib, AVX512, qtype, (q[:M], d[:M], s[:M]), w, bias)
        assert np.array_equal(batch, alone[:M]), f"M = {M}"


def extreme_blocks(qtype: str, N: int, K: int) -> np.ndarray:
    """Every weight's value is its code - 8 (codes 15 in row 0, 0 in row 1, alternating 15/0
    nibbles below): scale 1 and offset -8 in each type's own encoding."""
    one, m8 = (np.frombuffer(np.float16(v).tobytes(), np.uint8) for v in (1.0, -8.0))
    blocks = np.zeros((N, K // BLOCK_VALUES[qtype], BLOCK_BYTES[qtype]), np.uint8)
    blocks[:, :, 0:2] = one
    if qtype == "q4_1":
        blocks[:, :, 2:4] = m8
    if qtype == "q4_k":
        blocks[:, :, 2:4] = one  # dmin
        # Sub-scales 1 and mins 8 by q4_k_scale_min's packing: bytes 0-3 scales 0-3, 4-7 mins 0-3,
        # 8-11 (low nibble) scales 4-7 and (high nibble) mins 4-7.
        blocks[:, :, 4:8] = 1
        blocks[:, :, 8:12] = 8
        blocks[:, :, 12:16] = 0x81
    c = CODES_AT[qtype]
    blocks[0, :, c:] = 0xFF
    blocks[1, :, c:] = 0x00
    blocks[2:, :, c:] = 0x0F
    return np.ascontiguousarray(blocks.reshape(N, -1))


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q4_k"])
def test_vnni_q4_kernel_is_exact_at_the_extremes(lib: ctypes.CDLL, qtype: str) -> None:
    """Codes 15 and 0 against activations of +-127 with unit scales: every product and sum is an
    integer fp32 holds exactly, so the kernel must return the integer result."""
    M, N, K = 3, 5, 512
    q = np.full((M, K), 127, np.int8)
    q[1] = -127
    q[2, ::2] = -127
    d = np.ones((M, K // 32), np.float32)
    s = q.astype(np.float32).reshape(M, -1, 32).sum(axis=2)
    w = extreme_blocks(qtype, N, K)
    wd = dequantize(w, qtype)
    assert set(np.unique(wd)) <= {-8.0, 7.0}
    ref = q.astype(np.int64) @ wd.astype(np.int64).T
    assert np.array_equal(run(lib, AVX512, qtype, (q, d, s), w, None), ref.astype(np.float32))


@pytest.mark.parametrize("isa", [AVX2, AVX512])
def test_mxfp4_kernels_are_exact_at_the_extremes(lib: ctypes.CDLL, isa: int) -> None:
    """MXFP4 codes +-6 (the E2M1 extremes) and 0 at scale 2^0 (e = 127) against activations of
    +-127 with unit scales: integer products and sums fp32 holds exactly, on both kernels."""
    M, N, K = 3, 5, 512
    q = np.full((M, K), 127, np.int8)
    q[1] = -127
    q[2, ::2] = -127
    d = np.ones((M, K // 32), np.float32)
    s = q.astype(np.float32).reshape(M, -1, 32).sum(axis=2)
    blocks = np.zeros((N, K // 32, 17), np.uint8)
    blocks[:, :, 0] = 127
    blocks[0, :, 1:] = 0x77  # +6 everywhere
    blocks[1, :, 1:] = 0xFF  # -6
    blocks[2, :, 1:] = 0xF7  # +6 low, -6 high
    blocks[3, :, 1:] = 0x80  # 0 and -0
    blocks[4, :, 1:] = 0x3C  # -4 low (code 12), 1.5 high (code 3)
    w = np.ascontiguousarray(blocks.reshape(N, -1))
    wd = dequantize(w, "mxfp4")
    ref = q.astype(np.float64) @ wd.T
    assert np.array_equal(run(lib, isa, "mxfp4", (q, d, s), w, None), ref.astype(np.float32))
