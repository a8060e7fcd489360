"""Q8_0 weights: the byte layout (GGUF's), quantise/dequantise, and pagewire::linear_q8_0 against a
float64 reference of the dequantised weights, on every kernel family this CPU has."""
from __future__ import annotations

import struct

import pytest
import torch

from server.kernels import ops
from server.kernels.quant import QuantizedWeight
from tests.kernels.conftest import available_isas
from tests.pairwise import pairwise


def gguf_q8_0_reference(w: torch.Tensor) -> bytes:
    """GGUF's quantize_row_q8_0_ref, written out independently in Python: per 32 values
    d = amax / 127, q = round-half-away-from-zero(x / d), block = fp16 d then 32 int8."""
    out = bytearray()
    wf = w.float()
    for row in wf:
        for blk in row.view(-1, 32):
            amax = float(blk.abs().max())
            d = torch.tensor(amax, dtype=torch.float32) / 127
            inv = 1 / d if float(d) != 0 else torch.tensor(0.0)
            v = blk * inv
            q = torch.sign(v) * torch.floor(v.abs() + 0.5)
            out += struct.pack("<e", float(d))
            out += bytes(int(x) & 0xFF for x in q.to(torch.int32).tolist())
    return bytes(out)


def test_layout_is_gguf_q8_0() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 96, generator=gen)
    w[1, :32] = 0  # an all-zero block: d = 0, q = 0
    w[2, 5] = 40.0  # one large value dominates its block
    qw = QuantizedWeight.quantize(w)
    assert qw.data.dtype == torch.uint8 and tuple(qw.data.shape) == (3, 3 * 34)
    assert bytes(qw.data.flatten().tolist()) == gguf_q8_0_reference(w)
    # Handing the bytes over as a GGUF reader would (a flat uint8 buffer) needs no conversion.
    again = QuantizedWeight.from_q8_0_bytes(qw.data.flatten(), 3, 96)
    assert torch.equal(again.dequantize(), qw.dequantize())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_is_within_half_a_step(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 256, generator=gen).to(dtype)
    deq = QuantizedWeight.quantize(w).dequantize(torch.float64)
    step = w.double().view(16, -1, 32).abs().amax(-1, keepdim=True) / 127
    err = (deq.view(16, -1, 32) - w.double().view(16, -1, 32)).abs()
    # Half a quantisation step, plus the fp16 rounding of the scale (2**-11 relative, times 127).
    assert bool((err <= step * (0.5 + 127 * 2.0**-11) + 1e-12).all())


def linear_q8_reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ qw.dequantize(torch.float64).T
    return y + bias.double() if bias is not None else y


# Every pair of (family, rows, shape, dtype, bias) values (tests/pairwise.py), and in full for each
# family: one decode row on the smallest shape, 17 rows (past the 16-row kernel path) and 40 (the
# dequantise + GEMM path) on the largest and on the odd one (K = 800: 25 blocks), bias in bf16.
LINEAR_GRID = [(isa, m, n, k, dtype, bias) for isa, m, (n, k), dtype, bias in pairwise(
    [available_isas(), [1, 2, 3, 8, 16, 17, 40], [(64, 64), (37, 96), (512, 1024), (45, 800)],
     [torch.bfloat16, torch.float32], [False, True]],
    edges=[(isa, m, nk, torch.bfloat16, True) for isa in available_isas()
           for m, nk in ((1, (64, 64)), (17, (512, 1024)), (40, (512, 1024)), (17, (45, 800)))])]


@pytest.mark.parametrize("cpu_isa,M,N,K,dtype,with_bias", LINEAR_GRID, indirect=["cpu_isa"])
def test_linear_q8_0_matches_float64_reference(
    cpu_isa: str, M: int, N: int, K: int, dtype: torch.dtype, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(M * 31 + N + K)
    x = torch.randn(M, K, generator=gen).to(dtype)
    qw = QuantizedWeight.quantize(torch.randn(N, K, generator=gen) / K**0.5)
    b = torch.randn(N, generator=gen).to(dtype) if with_bias else None
    y = ops.linear(x, qw, b)
    assert y.shape == (M, N) and y.dtype == dtype
    ref = linear_q8_reference(x, qw, b)
    # The activations are quantised to 8 bits per 32-value block (at most half a step, 1/254 of
    # the block's max, per value); errors add like a random walk over K, so relative to the
    # output scale they stay near 1/254 / sqrt(3). The bf16 output rounding adds 2**-9.
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-2 + (2.0**-8 if dtype == torch.bfloat16 else 0)
    # Large batches (M > 16) dequantise and use torch's GEMM: no activation quantisation at all.
    if M > 16:
        assert err <= 2.0**-7


def test_kernel_families_agree(cpu_isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same integer dot products: the SIMD kernel equals the portable one up to fp32 summation order."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 512, generator=gen)
    qw = QuantizedWeight.quantize(torch.randn(70, 512, generator=gen))
    y = ops.linear(x, qw)
    monkeypatch.setenv("PAGEWIRE_CPU_ISA", "portable")
    torch.testing.assert_close(y, ops.linear(x, qw), rtol=1e-5, atol=1e-4)


def test_activation_quantisation_is_the_same_on_every_family(cpu_isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SIMD activation quantiser gives the portable one's bytes and scales, ties included.

    Weight row n is the unit vector e_n, so output (m, n) is one product of x's quantised value,
    its block scale and the weight's: equal across families exactly when the quantised activations
    are. Blocks whose largest magnitude is 127 have scale 1, so values k + 0.5 are exact ties for
    round-half-away-from-zero."""
    gen = torch.Generator().manual_seed(11)
    K = 800
    x = torch.randn(4, K, generator=gen) * 40
    x[0] = torch.arange(K, dtype=torch.float32) % 64 - 31.5  # ties: -31.5 .. 31.5
    x[0, ::32] = 127.0
    x[1, 32:64] = 0.0  # an all-zero block
    qw = QuantizedWeight.quantize(torch.eye(K))
    y = ops.linear(x, qw)
    monkeypatch.setenv("PAGEWIRE_CPU_ISA", "portable")
    assert torch.equal(y, ops.linear(x, qw))


def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.pagewire.quantize_q8_0(torch.randn(4, 40))
    qw = QuantizedWeight.quantize(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="weight must be \\[N, 68\\]"):
        torch.ops.pagewire.linear_q8_0(torch.randn(2, 64), qw.data[:, :60], None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.pagewire.linear_q8_0(torch.randn(2, 64), qw.data, torch.randn(9))
    with pytest.raises(ValueError, match="data: expected uint8"):
        QuantizedWeight("q8_0", qw.data[:, :34], (8, 64))


def test_opcheck_q8_0_ops() -> None:
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(16, 64, generator=gen)
    qw = QuantizedWeight.quantize(w)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    torch.library.opcheck(torch.ops.pagewire.quantize_q8_0.default, (w,))
    torch.library.opcheck(torch.ops.pagewire.dequantize_q8_0.default, (qw.data,))
    torch.library.opcheck(torch.ops.pagewire.linear_q8_0.default, (x, qw.data, None))
    torch.library.opcheck(torch.ops.pagewire.linear_q8_0.default, (x, qw.data, torch.randn(16).bfloat16()))
