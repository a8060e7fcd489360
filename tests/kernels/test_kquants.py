"""The K-quants kept in their blocks, in GGUF's row layout and in the x8 layout, through
pagewire::linear_q4, on every kernel family this CPU has.

Each is checked against the `gguf` package's dequantiser (an independent reading of the block
format): pagewire's dequantisation equals it bit for bit, and the kernels' outputs are near a
float64 product of x and its dequantised weights, for decode (M = 1), small batches (the integer
kernels, up to 16 rows) and larger ones (dequantised chunks and torch's GEMM). The x8 layout is the
same bytes rearranged; a row's output does not depend on its batch neighbours (deterministic mode);
the SIMD kernels equal the portable one up to fp32 summation order.
"""
from __future__ import annotations

import pytest
import torch

from server.kernels import batch_invariant, ops
from server.kernels.quant import QuantizedWeight
from tests.kernels.conftest import available_isas
from tests.kernels.test_quant4 import gguf_dequantize, linear_reference, random_q4

K_TYPES = ["q4_k", "q5_k", "q6_k"]
# (qtype, interleaved): every K-quant layout a QuantizedWeight can hold.
LAYOUTS = [("q4_k", False), ("q4_k", True), ("q5_k", False), ("q5_k", True), ("q6_k", False), ("q6_k", True)]


def weight(qtype: str, interleaved: bool, n: int, k: int, seed: int, zero_rows: tuple[int, ...] = ()) -> tuple[
        QuantizedWeight, QuantizedWeight]:
    """(the weight in the layout asked for, the same weight in GGUF's row layout)."""
    rows = random_q4(qtype, n, k, seed, zero_rows)
    return (rows.interleave() if interleaved else rows), rows


@pytest.mark.parametrize("qtype", K_TYPES)
def test_dequantize_equals_the_gguf_package(qtype: str) -> None:
    qw = random_q4(qtype, 9, 768, seed=1, zero_rows=(3,))
    deq = qw.dequantize()
    assert deq.shape == (9, 768) and deq.dtype == torch.float32
    assert torch.equal(deq, gguf_dequantize(qw))
    assert not deq[3].any()  # zero super-scales: every value is zero


def test_q4_k_x8_is_the_same_bytes_rearranged() -> None:
    rows = random_q4("q4_k", 21, 512, seed=2)  # two whole groups and a 5-row tail
    x8 = rows.interleave()
    assert x8.interleaved and x8.op_qtype == "q4_kx8" and x8.data.shape == rows.data.shape
    assert not torch.equal(x8.data[:16], rows.data[:16])
    assert torch.equal(x8.data[16:], rows.data[16:])  # the tail stays in row layout
    assert torch.equal(x8.dequantize(), gguf_dequantize(rows))
    assert sorted(x8.data[:8].flatten().tolist()) == sorted(rows.data[:8].flatten().tolist())
    if ops.cpu_isa() != "portable":
        assert rows.for_kernels().interleaved  # the layout the x8 kernels read
    assert not random_q4("q4_k", 7, 256, seed=3).for_kernels().interleaved  # under eight rows: kept in rows


def test_q5_k_x8_is_the_documented_permutation() -> None:
    """quant4_kernel.h's Q5_K x8 layout, byte for byte: Q4_K's (d, dmin, the three packed scale words,
    32 code chunks from each block's byte 48), then 8 qh chunks (bytes 4j..4j+3 of each row's 32)."""
    rows = random_q4("q5_k", 21, 512, seed=6)  # two whole groups and a 5-row tail
    x8 = rows.interleave()
    assert x8.interleaved and x8.op_qtype == "q5_kx8" and x8.data.shape == rows.data.shape
    for g in range(2):
        out = x8.data[8 * g: 8 * g + 8].reshape(-1)
        for s in range(2):
            sb = out[s * 8 * 176: (s + 1) * 8 * 176]
            for r in range(8):
                blk = rows.data[8 * g + r, s * 176: (s + 1) * 176]
                assert torch.equal(sb[2 * r: 2 * r + 2], blk[0:2]) and torch.equal(sb[16 + 2 * r: 18 + 2 * r], blk[2:4])
                for w in range(3):
                    assert torch.equal(sb[32 + 32 * w + 4 * r: 36 + 32 * w + 4 * r], blk[4 + 4 * w: 8 + 4 * w])
                for c in range(32):
                    assert torch.equal(sb[128 + 32 * c + 4 * r: 132 + 32 * c + 4 * r], blk[48 + 4 * c: 52 + 4 * c])
                for j in range(8):
                    assert torch.equal(sb[1152 + 32 * j + 4 * r: 1156 + 32 * j + 4 * r], blk[16 + 4 * j: 20 + 4 * j])
    assert torch.equal(x8.data[16:], rows.data[16:])  # the tail stays in row layout
    assert torch.equal(x8.dequantize(), gguf_dequantize(rows))


def test_q6_k_x8_is_the_documented_permutation() -> None:
    """quant4_kernel.h's Q6_K x8 layout, byte for byte: per super-block of eight rows their d, their
    sixteen scales as four vectors, 32 ql chunks and 16 qh chunks (four bytes of each row)."""
    rows = random_q4("q6_k", 21, 512, seed=4)  # two whole groups and a 5-row tail
    x8 = rows.interleave()
    assert x8.interleaved and x8.op_qtype == "q6_kx8" and x8.data.shape == rows.data.shape
    for g in range(2):
        out = x8.data[8 * g: 8 * g + 8].reshape(-1)
        for s in range(2):
            grp = out[s * 8 * 210: (s + 1) * 8 * 210]
            for r in range(8):
                blk = rows.data[8 * g + r, s * 210: (s + 1) * 210]
                assert torch.equal(grp[2 * r: 2 * r + 2], blk[208:210])  # d
                for v in range(4):
                    assert torch.equal(grp[16 + 32 * v + 4 * r: 20 + 32 * v + 4 * r], blk[192 + 4 * v: 196 + 4 * v])
                for c in range(32):
                    assert torch.equal(grp[144 + 32 * c + 4 * r: 148 + 32 * c + 4 * r], blk[4 * c: 4 * c + 4])
                for c in range(16):
                    assert torch.equal(grp[1168 + 32 * c + 4 * r: 1172 + 32 * c + 4 * r], blk[128 + 4 * c: 132 + 4 * c])
    assert torch.equal(x8.data[16:], rows.data[16:])  # the tail stays in row layout
    assert torch.equal(x8.dequantize(), gguf_dequantize(rows))
    if ops.cpu_isa() != "portable":
        assert rows.for_kernels().interleaved  # the layout the x8 kernels read


# Per family and layout: decode, the integer kernel's tile shapes (1-4 rows, remainders), its
# 16-row limit, and past it (17, 40: dequantised chunks and torch's GEMM).
LINEAR_GRID = [(isa, q, il, m) for isa in available_isas() for q, il in LAYOUTS for m in (1, 2, 3, 5, 16, 17, 40)]


@pytest.mark.parametrize("cpu_isa,qtype,interleaved,M", LINEAR_GRID, indirect=["cpu_isa"])
def test_linear_matches_float64_reference(cpu_isa: str, qtype: str, interleaved: bool, M: int) -> None:
    gen = torch.Generator().manual_seed(M * 7 + len(qtype))
    for (N, K), dtype, with_bias in (((37, 512), torch.float32, True), ((96, 768), torch.bfloat16, False)):
        x = torch.randn(M, K, generator=gen).to(dtype)
        qw, rows = weight(qtype, interleaved, N, K, seed=M + N, zero_rows=(5,))
        b = torch.randn(N, generator=gen).to(dtype) if with_bias else None
        y = ops.linear(x, qw, b)
        assert y.shape == (M, N) and y.dtype == dtype
        ref = linear_reference(x, rows, b)  # the gguf package's dequantisation, in float64
        # Activations rounded to 8 bits per 32-value block (as for Q8_0 and the 4-bit types);
        # bf16 output adds 2**-8.
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-2 + (2.0**-8 if dtype == torch.bfloat16 else 0), (N, K, err)
        want_col = b[5].float() if b is not None else torch.zeros(())
        torch.testing.assert_close(y[:, 5].float(), want_col.expand(M), rtol=0, atol=0)  # zero-scale row
        if M > 16:  # dequantised chunks and torch's GEMM: no activation rounding
            assert err <= 2.0**-7


@pytest.mark.parametrize("qtype,interleaved", LAYOUTS)
def test_kernel_families_agree(cpu_isa: str, qtype: str, interleaved: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same integer dot products: each SIMD kernel equals the portable one up to fp32
    rounding order (M = 1's four-row tiles and the several-row tiles; N with a tail)."""
    gen = torch.Generator().manual_seed(5)
    qw, _ = weight(qtype, interleaved, 70, 768, seed=5)
    for M in (1, 6):
        x = torch.randn(M, 768, generator=gen)
        y = ops.linear(x, qw)
        monkeypatch.setenv("PAGEWIRE_CPU_ISA", "portable")
        # (Q6_K's SIMD body applies its two 16-value scales in integers, the portable one in fp32.)
        torch.testing.assert_close(y, ops.linear(x, qw), rtol=1e-5, atol=3e-5 * float(y.abs().max()))
        monkeypatch.setenv("PAGEWIRE_CPU_ISA", cpu_isa)


@pytest.mark.parametrize("qtype,interleaved", LAYOUTS)
def test_rows_do_not_depend_on_the_batch(cpu_isa: str, qtype: str, interleaved: bool) -> None:
    """Deterministic mode: a row's output is bit-identical whatever the rows beside it."""
    gen = torch.Generator().manual_seed(9)
    qw, _ = weight(qtype, interleaved, 45, 768, seed=9)
    x = torch.randn(16, 768, generator=gen).bfloat16()
    b = torch.randn(45, generator=gen).bfloat16()
    with batch_invariant.mode(True):
        alone = [ops.linear(x[r:r + 1], qw, b) for r in range(16)]
        for m in (2, 3, 5, 8, 13, 16):
            y = ops.linear(x[:m], qw, b)
            for r in range(m):
                assert torch.equal(y[r:r + 1], alone[r]), (m, r)


def test_extreme_codes_are_exact() -> None:
    """Q6_K codes at -32 and +31 with scales of +-127 against activations of +-127 (the kernels'
    16- and 32-bit sums at their largest), and Q5_K's codes at 31 with 6-bit scales at 63: the
    result equals the float64 product of the exactly representable inputs."""
    K = 512
    q6 = random_q4("q6_k", 8, K, seed=11).data.reshape(8, -1, 210).clone()
    q6[:, :, :128] = torch.where(torch.arange(8).reshape(8, 1, 1) % 2 == 0, 0x00, 0xFF)  # low bits: 0 or 15
    q6[:, :, 128:192] = torch.where(torch.arange(8).reshape(8, 1, 1) % 2 == 0, 0x00, 0xFF)  # high bits: 0 or 3
    q6[:, :, 192:208] = torch.tensor([127, 129] * 8, dtype=torch.uint8)  # int8 scales 127 and -127
    q5 = random_q4("q5_k", 8, K, seed=12).data.reshape(8, -1, 176).clone()
    q5[:, :, 4:16] = 0xFF  # every 6-bit scale and min 63
    q5[:, :, 16:] = 0xFF  # every code 31
    x = torch.full((3, K), 127.0)
    x[1, ::2] = -127.0
    for qtype, data in (("q6_k", q6), ("q5_k", q5)):
        qw = QuantizedWeight(qtype, data.reshape(8, -1).contiguous(), (8, K))
        ref = linear_reference(x, qw, None)
        y = ops.linear(x, qw)
        torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))
