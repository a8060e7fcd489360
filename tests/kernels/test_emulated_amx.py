"""The AMX kernels of csrc/cpu/linear_amx.cpp, run through emulated tile instructions.

This CPU may have no AMX, so emu_build compiles the kernel file unchanged against
tests/kernels/emu/amx_emu.h (the tile instructions after Intel's pseudo-code) and SIMDe (AVX-512).
First the emulation itself is checked against numpy, bit for bit, including partial tile shapes;
then the kernels against float64 references, the Q8_0 one also against the portable kernel's
fp32 arithmetic (bit for bit) and the AVX2 kernel, and both for batch invariance. Speed is not
measured here: emulated tiles are slow, so the shapes are small.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import server._C  # noqa: F401  (registers torch.ops.pagewire)
from tests.kernels import emu_build

# The CPU family whose kernels this file checks through emulation (tests/kernels/conftest.py's summary).
EMULATED_FAMILY = "amx"

I64 = ctypes.c_int64
PTR = ctypes.c_void_p


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    so = emu_build.build("amx", ["linear_amx.cpp", "linear_x8_amx.cpp", "linear_q8_avx2.cpp", "linear_x8_avx2.cpp",
                                  "linear_x8k_avx2.cpp"])
    so.pw_amx_emu_dp.argtypes = [ctypes.c_int, PTR, PTR, I64, PTR, I64, PTR, I64]
    so.pw_linear_bf16_amx.argtypes = [PTR, I64, PTR, PTR, PTR, I64, I64, I64]
    so.pw_quantize_rows_q8.argtypes = [PTR, I64, I64, PTR, PTR]
    so.pw_linear_q8_0.argtypes = [ctypes.c_int, PTR, PTR, I64, I64, PTR, PTR, PTR, I64]
    so.pw_linear_q8_0x8.argtypes = [ctypes.c_int, PTR, PTR, I64, I64, PTR, PTR, PTR, I64]
    so.pw_linear_q4x8.argtypes = [ctypes.c_int, ctypes.c_int, PTR, PTR, PTR, I64, I64, PTR, PTR, PTR, I64]
    so.pw_quantize_rows_q8_sums.argtypes = [PTR, I64, I64, PTR, PTR, PTR]
    return so


def ptr(a: np.ndarray | None) -> int | None:
    if a is None:
        return None
    assert a.flags.c_contiguous
    return int(a.ctypes.data)


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------------------------------------
# The emulator


def tile_config(shapes: dict[int, tuple[int, int]]) -> np.ndarray:
    """LDTILECFG's 64 bytes: palette 1, uint16 colsb[16] at byte 16, uint8 rows[16] at byte 48."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    for t, (rows, colsb) in shapes.items():
        cfg[16 + 2 * t : 18 + 2 * t] = np.array([colsb], np.uint16).view(np.uint8)
        cfg[48 + t] = rows
    return cfg


def run_dp(lib: ctypes.CDLL, kind: int, c: np.ndarray, a: np.ndarray, b: np.ndarray, m: int, k4: int, n: int) -> None:
    """C (tile 0, m x n dwords) += A (tile 1, m x k4 dwords) . B (tile 2, k4 x n dwords); buffers are
    16 x 64-byte rows, only the configured part is read or written."""
    cfg = tile_config({0: (m, 4 * n), 1: (m, 4 * k4), 2: (k4, 4 * n)})
    lib.pw_amx_emu_dp(kind, ptr(cfg), ptr(c), 64, ptr(a), 64, ptr(b), 64)


SHAPES = [(16, 16, 16), (3, 5, 7), (1, 1, 1), (16, 3, 2), (5, 16, 16)]


@pytest.mark.parametrize("m,k2,n", SHAPES)
def test_tdpbf16ps_matches_numpy_bit_for_bit(lib: ctypes.CDLL, m: int, k2: int, n: int) -> None:
    """Per row m, column n: for each k-pair, tmp += a[2k] * b[2n], then tmp += a[2k+1] * b[2n+1],
    in fp32 (bf16 products are exact in fp32, so numpy's float32 multiply-then-add is the same)."""
    gen = torch.Generator().manual_seed(m * 100 + k2 * 10 + n)
    a = bf16_bits(torch.randn((16, 32), generator=gen).bfloat16())
    b = bf16_bits(torch.randn((16, 32), generator=gen).bfloat16())
    c0 = torch.randn((16, 16), generator=gen).numpy()
    c0[m:, :] = np.nan  # outside the configured shape: must come back untouched
    c0[:, n:] = np.nan
    c = c0.copy()
    run_dp(lib, 0, c, a, b, m, k2, n)
    af, bf = bits_to_f32(a), bits_to_f32(b)
    ref = c0[:m, :n].copy()
    for k in range(k2):
        for j in range(2):
            ref = ref + af[:m, 2 * k + j, None] * bf[k, j : 2 * n : 2][None, :]
    assert np.array_equal(c[:m, :n].view(np.uint32), ref.view(np.uint32))
    assert np.array_equal(c.view(np.uint32)[m:], c0.view(np.uint32)[m:])
    assert np.array_equal(c.view(np.uint32)[:, n:], c0.view(np.uint32)[:, n:])


def test_tdpbf16ps_denormals_in_are_zero_and_out_are_flushed(lib: ctypes.CDLL) -> None:
    a = np.zeros((16, 32), np.uint16)
    b = np.zeros((16, 32), np.uint16)
    a[0, 0] = 0x0001  # a bf16 denormal (2**-133): read as zero, however large its partner
    b[0, 0] = bf16_bits(torch.tensor([2.0**100]).bfloat16())[0]  # C[0][0] += a[0][0] * b[0][0]
    tiny = bf16_bits(torch.tensor([2.0**-70]).bfloat16())[0]
    a[1, 1] = b[0, 3] = tiny  # C[1][1] += a[1][1] * b[0][2 * 1 + 1] = 2**-140, a denormal fp32
    c = np.zeros((16, 16), np.float32)
    c[0, 1] = c[1, 0] = 3.0
    run_dp(lib, 0, c, a, b, 2, 1, 2)
    assert c[0, 0] == 0.0  # without DAZ: 2**-33
    assert c[1, 1] == 0.0  # without FTZ: 2**-140
    assert np.array_equal(c[:2, :2], np.array([[0.0, 3.0], [3.0, 0.0]], np.float32))


@pytest.mark.parametrize("m,k4,n", SHAPES)
def test_tdpbssd_matches_numpy(lib: ctypes.CDLL, m: int, k4: int, n: int) -> None:
    """Signed x signed bytes, four products per dword, added to int32 with wrap-around."""
    rng = np.random.default_rng(m * 100 + k4 * 10 + n)
    a = rng.integers(-128, 128, (16, 64), dtype=np.int8)
    b = rng.integers(-128, 128, (16, 64), dtype=np.int8)
    c0 = rng.integers(-(2**31), 2**31, (16, 16), dtype=np.int64).astype(np.int32)
    c0[0, 0] = 2**31 - 1  # the first positive product wraps this one
    a[0, :4] = b[0, :4] = 127
    c = c0.copy()
    run_dp(lib, 1, c, a, b, m, k4, n)
    prod = a[:m, : 4 * k4].astype(np.int64) @ b[:k4].reshape(k4, 16, 4)[:, :n].transpose(0, 2, 1).reshape(4 * k4, n)
    ref = ((c0[:m, :n].astype(np.int64) + prod + 2**31) % 2**32 - 2**31).astype(np.int32)
    assert np.array_equal(c[:m, :n], ref)
    assert np.array_equal(c[m:], c0[m:]) and np.array_equal(c[:, n:], c0[:, n:])


# ---------------------------------------------------------------------------------------------
# bf16 kernel


def linear_bf16_amx(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x may be a row-strided view (its row stride is passed as ldx)."""
    M, K = x.shape
    N = w.shape[0]
    assert x.stride(1) == 1
    xbits = x.view(torch.int16)  # same strides as x
    wb = bf16_bits(w)
    bb = bf16_bits(b) if b is not None else None
    out = np.zeros((M, N), np.uint16)
    lib.pw_linear_bf16_amx(xbits.data_ptr(), x.stride(0), ptr(wb), ptr(bb), ptr(out), M, N, K)
    return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)


def check_bf16(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    if b is not None:
        ref = ref + b.double()
        mag = mag + b.double().abs()
    err = (y.double() - ref).abs()
    # One bf16 rounding (2**-9 relative) on top of an fp32 sum's error, element by element.
    assert bool((err <= 2.0**-8 * ref.abs() + 1e-5 * mag + 1e-30).all()), float((err - 2.0**-8 * ref.abs()).max())


@pytest.mark.parametrize("M", [1, 3, 4, 7, 16, 17, 33])
@pytest.mark.parametrize("K", [32, 48, 96, 200])
def test_bf16_matches_float64_reference(lib: ctypes.CDLL, M: int, K: int) -> None:
    for N in [1, 15, 16, 40, 100]:
        for with_bias in [False, True]:
            gen = torch.Generator().manual_seed(M * 1000 + N * 10 + K + with_bias)
            x = torch.randn((M, K), generator=gen).bfloat16()
            w = (torch.randn((N, K), generator=gen) / K**0.5).bfloat16()
            b = torch.randn((N,), generator=gen).bfloat16() if with_bias else None
            check_bf16(linear_bf16_amx(lib, x, w, b), x, w, b)


@pytest.mark.parametrize("K", [1, 2, 31, 33, 63, 65])
def test_bf16_odd_k_and_strided_rows(lib: ctypes.CDLL, K: int) -> None:
    gen = torch.Generator().manual_seed(K)
    big = torch.randn((5, K + 11), generator=gen).bfloat16()
    x = big[:, 3 : 3 + K]  # rows K + 11 apart
    w = torch.randn((70, K), generator=gen).bfloat16()
    b = torch.randn((70,), generator=gen).bfloat16()
    check_bf16(linear_bf16_amx(lib, x, w, b), x, w, b)


def test_bf16_special_values(lib: ctypes.CDLL) -> None:
    """inf and NaN propagate as in any fp32 sum; bias-only when x is zero."""
    w = torch.ones((17, 40)).bfloat16()
    x = torch.zeros((3, 40)).bfloat16()
    x[1, 5] = float("inf")
    x[2, 7] = float("nan")
    b = torch.arange(17).bfloat16()
    y = linear_bf16_amx(lib, x, w, b)
    assert torch.equal(y[0], b)
    assert bool(torch.isinf(y[1]).all()) and bool(torch.isnan(y[2]).all())


@pytest.mark.parametrize("N,K", [(40, 80), (100, 64)])
def test_bf16_batch_invariance(lib: ctypes.CDLL, N: int, K: int) -> None:
    """Row m's output is the same bits alone (M = 1) and inside any batch of 2..17 rows."""
    gen = torch.Generator().manual_seed(N + K)
    x = torch.randn((17, K), generator=gen).bfloat16()
    w = torch.randn((N, K), generator=gen).bfloat16()
    b = torch.randn((N,), generator=gen).bfloat16()
    alone = torch.cat([linear_bf16_amx(lib, x[m : m + 1], w, b) for m in range(17)])
    for M in range(2, 18):
        assert torch.equal(linear_bf16_amx(lib, x[:M], w, b).view(torch.int16), alone[:M].view(torch.int16)), M
    perm = torch.randperm(17, generator=gen)
    assert torch.equal(linear_bf16_amx(lib, x[perm], w, b).view(torch.int16), alone[perm].view(torch.int16))


# ---------------------------------------------------------------------------------------------
# Q8_0 kernel


def quantize_weight(w: torch.Tensor) -> np.ndarray:
    return torch.ops.pagewire.quantize_q8_0(w).numpy()


def weight_parts(wq: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray]:
    """(fp32 scales [N, nb], int8 values [N, K]) of Q8_0 bytes."""
    blocks = wq.reshape(wq.shape[0], K // 32, 34)
    d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    q = blocks[:, :, 2:].copy().view(np.int8).reshape(wq.shape[0], K)
    return d, q


def quantize_x(lib: ctypes.CDLL, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    M, K = x.shape
    q = np.zeros((M, K), np.int8)
    d = np.zeros((M, K // 32), np.float32)
    lib.pw_quantize_rows_q8(ptr(x), M, K, ptr(q), ptr(d))
    return q, d


def linear_q8(
    lib: ctypes.CDLL, isa: int, xq: np.ndarray, xd: np.ndarray, wq: np.ndarray, b: np.ndarray | None
) -> np.ndarray:
    M, K = xq.shape
    N = wq.shape[0]
    out = np.zeros((M, N), np.float32)
    lib.pw_linear_q8_0(
        isa, ptr(np.ascontiguousarray(xq)), ptr(np.ascontiguousarray(xd)), M, K, ptr(wq), ptr(b), ptr(out), N
    )
    return out


def portable_q8(xq: np.ndarray, xd: np.ndarray, wq: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """linear_q8_0_portable's arithmetic in numpy float32: acc += float(dot) * (wd * xd), block by
    block in K order, then + bias (or + 0)."""
    K = xq.shape[1]
    wd, wv = weight_parts(wq, K)
    acc = np.zeros((xq.shape[0], wq.shape[0]), np.float32)
    for blk in range(K // 32):
        s = slice(32 * blk, 32 * blk + 32)
        dot = (xq[:, s].astype(np.int64) @ wv[:, s].astype(np.int64).T).astype(np.float32)
        acc = acc + dot * (wd[None, :, blk] * xd[:, blk, None])
    return acc + (b[None, :] if b is not None else np.float32(0))


@pytest.mark.parametrize("M", [1, 3, 4, 7, 16, 17, 33])
@pytest.mark.parametrize("K", [32, 96, 256])
def test_q8_0_matches_references(lib: ctypes.CDLL, M: int, K: int) -> None:
    for N in [1, 15, 16, 40, 100]:
        for with_bias in [False, True]:
            gen = torch.Generator().manual_seed(M * 1000 + N * 10 + K + with_bias)
            wq = quantize_weight(torch.randn((N, K), generator=gen) / K**0.5)
            x = torch.randn((M, K), generator=gen).numpy()
            b = torch.randn((N,), generator=gen).numpy() if with_bias else None
            xq, xd = quantize_x(lib, x)
            y = linear_q8(lib, 1, xq, xd, wq, b)
            # The portable kernel's floats, exactly.
            assert np.array_equal(y.view(np.uint32), portable_q8(xq, xd, wq, b).view(np.uint32))
            # Float64 of the dequantised operands.
            wd, wv = weight_parts(wq, K)
            wdq = np.repeat(wd.astype(np.float64), 32, axis=1) * wv
            xdq = np.repeat(xd.astype(np.float64), 32, axis=1) * xq
            ref = xdq @ wdq.T + (b.astype(np.float64) if b is not None else 0.0)
            mag = np.abs(xdq) @ np.abs(wdq).T + (np.abs(b) if b is not None else 0.0)
            assert np.all(np.abs(y - ref) <= 1e-5 * mag + 1e-30)
            # The AVX2 kernel (another summation order): ~1e-5 relative.
            y2 = linear_q8(lib, 0, xq, xd, wq, b)
            assert np.abs(y - y2).max() <= 1e-5 * max(np.abs(y2).max(), 1e-30)


def test_q8_0_extreme_values(lib: ctypes.CDLL) -> None:
    """All-(-128) and all-127 bytes (largest |dot|), zero blocks, a zero activation row."""
    K, N = 64, 20
    wq = np.zeros((N, K // 32 * 34), np.uint8)
    blocks = wq.reshape(N, K // 32, 34)
    blocks[:, :, :2] = np.array([0.5], np.float16).view(np.uint8)
    blocks[: N // 2, :, 2:] = np.uint8(0x80)  # -128
    blocks[N // 2 :, 0, 2:] = 127
    xq = np.full((3, K), 127, np.int8)
    xq[1] = -127
    xq[2] = 0
    xd = np.full((3, K // 32), 0.25, np.float32)
    y = linear_q8(lib, 1, xq, xd, wq, None)
    assert np.array_equal(y.view(np.uint32), portable_q8(xq, xd, wq, None).view(np.uint32))
    assert y[0, 0] == -128 * 127 * 64 * 0.125 and y[2].max() == 0.0


@pytest.mark.parametrize("N,K", [(40, 96), (100, 64)])
def test_q8_0_batch_invariance(lib: ctypes.CDLL, N: int, K: int) -> None:
    gen = torch.Generator().manual_seed(N + K)
    wq = quantize_weight(torch.randn((N, K), generator=gen))
    xq, xd = quantize_x(lib, torch.randn((17, K), generator=gen).numpy())
    b = torch.randn((N,), generator=gen).numpy()
    alone = np.concatenate([linear_q8(lib, 1, xq[m : m + 1], xd[m : m + 1], wq, b) for m in range(17)])
    for M in range(2, 18):
        assert np.array_equal(linear_q8(lib, 1, xq[:M], xd[:M], wq, b).view(np.uint32), alone[:M].view(np.uint32)), M
    perm = torch.randperm(17, generator=gen).numpy()
    assert np.array_equal(linear_q8(lib, 1, xq[perm], xd[perm], wq, b).view(np.uint32), alone[perm].view(np.uint32))


@pytest.mark.parametrize("M", [1, 4, 5, 16, 17])
@pytest.mark.parametrize("N", [8, 40, 64])
def test_q8_0_x8_amx_is_the_avx2_x8_bit_for_bit(lib: ctypes.CDLL, M: int, N: int) -> None:
    """linear_q8_0x8_amx (the activations as the A tile, the x8 chunks as the B tile) against the
    AVX2 x8 kernel: the same integer dots and fp32 steps, so the same floats; one to five groups
    per thread step, partial and several chunks of 16 activation rows, with a bias."""
    K = 96
    gen = torch.Generator().manual_seed(M * 100 + N)
    w = torch.randn(N, K, generator=gen)
    x8 = torch.ops.pagewire.interleave_q8_0(torch.ops.pagewire.quantize_q8_0(w)).numpy()
    xq, xd = quantize_x(lib, torch.randn(M, K, generator=gen).numpy())
    b = torch.randn(N, generator=gen).numpy()
    outs = []
    for isa in (0, 1):
        out = np.zeros((M, N), np.float32)
        lib.pw_linear_q8_0x8(isa, ptr(xq), ptr(xd), M, K, ptr(x8), ptr(b), ptr(out), N)
        outs.append(out)
    assert np.array_equal(outs[0].view(np.int32), outs[1].view(np.int32))
    ref = portable_q8(xq, xd, quantize_weight(w), b)
    np.testing.assert_allclose(outs[1], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M", [1, 4, 5, 8, 16, 17, 33])
@pytest.mark.parametrize("N", [8, 40, 72, 136])
@pytest.mark.parametrize("qtype", ["q4_0", "q4_1"])
def test_q4_x8_amx_is_the_avx2_x8_bit_for_bit(lib: ctypes.CDLL, qtype: str, M: int, N: int) -> None:
    """linear_q4x8_amx (the activations as the A tile, two groups' codes unpacked to bytes as a
    16-column B tile) against the AVX2 x8 kernel: the same integer dots and fp32 steps, so the same
    floats; one to nine groups (odd counts leave a lone last group), one to four tiles per step,
    partial and several chunks of 16 activation rows, with a bias; and against the float64
    product of the dequantised operands."""
    from tests.kernels.test_quant4 import random_q4

    K = 96
    gen = torch.Generator().manual_seed(M * 100 + N)
    qw = random_q4(qtype, N, K, seed=M + N)
    x8 = qw.interleave().data.numpy()
    x = torch.randn(M, K, generator=gen).numpy()
    xq = np.zeros((M, K), np.int8)
    xd = np.zeros((M, K // 32), np.float32)
    xs = np.zeros((M, K // 32), np.float32)
    lib.pw_quantize_rows_q8_sums(ptr(x), M, K, ptr(xq), ptr(xd), ptr(xs))
    b = torch.randn(N, generator=gen).numpy()
    outs = []
    for isa in (0, 1):
        out = np.full((M, N), np.nan, np.float32)
        lib.pw_linear_q4x8(isa, 0 if qtype == "q4_0" else 1, ptr(xq), ptr(xd), ptr(xs), M, K, ptr(x8), ptr(b),
                           ptr(out), N)
        outs.append(out)
    assert np.array_equal(outs[0].view(np.int32), outs[1].view(np.int32))
    xdq = np.repeat(xd.astype(np.float64), 32, axis=1) * xq
    wdq = qw.dequantize(torch.float64).numpy()
    ref = xdq @ wdq.T + b
    mag = np.abs(xdq) @ np.abs(wdq).T + np.abs(b)
    assert np.all(np.abs(outs[1] - ref) <= 1e-5 * mag + 1e-6)
