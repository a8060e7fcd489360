"""bf16 weights packed losslessly (csrc/cpu/bf16z_layout.h, linear_bf16z.cpp, QuantizedWeight.pack_bf16):
unpacking gives back every bit (NaN, infinities, signed zeros, subnormals and values spread over all
binades included, which leave steps in 16-bit form), a normal weight packs to ~0.76x its bytes,
pagewire::linear_bf16z gives pagewire::linear's result bit for bit on AVX512-BF16 and AVX2 at every
row count their kernels take, and a float64 reference's within bf16 rounding elsewhere (the op
unpacks and runs ATen's GEMM), rows do not depend on the batch, embedding_bf16z gathers F.embedding's
rows, and bad arguments name themselves."""
from __future__ import annotations

import pytest
import torch

from server.kernels import batch_invariant, ops
from server.kernels.quant import QuantizedWeight
from tests.kernels.conftest import available_isas

# (N, K): tails of N % 8 rows; K % 32 = 16 (an odd last chunk); K = 16 (no whole step); wide K;
# N < 8 (every row in the row-layout tail); SmolLM2's and Llama-1B's widths.
SHAPES = [(8, 16), (45, 208), (7, 32), (16, 48), (576, 576), (17, 4096), (24, 2832), (64, 2048)]


def _weight(n: int, k: int, seed: int, scale: float = 0.02) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _with_outliers(w: torch.Tensor, seed: int) -> torch.Tensor:
    """w with a sprinkling of values from every corner of bf16: tiny, huge, subnormal, signed zeros,
    infinities and NaN, so that many steps hold a high byte outside their row's 16."""
    out = w.clone().view(-1)
    gen = torch.Generator().manual_seed(seed)
    specials = torch.tensor([1e-30, -3e-35, 7e25, -1e38, 1e-40, -0.0, 0.0, float("inf"), float("-inf"),
                             float("nan"), 2.0**-133, -(2.0**120)]).bfloat16()
    at = torch.randint(0, out.numel(), (max(1, out.numel() // 200),), generator=gen)
    out[at] = specials[torch.arange(at.numel()) % specials.numel()]
    return out.view_as(w)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("outliers", [False, True])
def test_unpacking_gives_back_every_bit(n: int, k: int, outliers: bool) -> None:
    w = _weight(n, k, n + k)
    if outliers:
        w = _with_outliers(w, n * k)
    qw = QuantizedWeight.pack_bf16(w)
    assert qw.interleaved and qw.op_qtype == "bf16zx8" and qw.shape == (n, k) and qw.is_bf16
    assert torch.equal(_bits(qw.dequantize(torch.bfloat16)), _bits(w))
    ids = torch.arange(n - 1, -1, -1).repeat(2)
    assert torch.equal(_bits(torch.ops.pagewire.embedding_bf16z(ids, qw.data, k)), _bits(w[ids]))


def test_every_high_byte_round_trips() -> None:
    """All 65,536 bf16 bit patterns, in rows whose high bytes are far more than 16."""
    w = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    for mat in (w, w.T.contiguous(), w[torch.randperm(256, generator=torch.Generator().manual_seed(1))]):
        qw = QuantizedWeight.pack_bf16(mat)
        assert torch.equal(_bits(qw.dequantize(torch.bfloat16)), _bits(mat))


def test_a_normal_weight_packs_to_three_quarters_of_its_bytes() -> None:
    """12 bits a value plus 0.5-1 % for the row tables and step bitmaps; where a step holds a high
    byte outside its row's table it keeps 16 bits (so outliers cost bytes, never values)."""
    w = _weight(256, 2048, 5)
    plain = w.numel() * 2
    packed = QuantizedWeight.pack_bf16(w).nbytes
    assert 0.75 * plain <= packed <= 0.77 * plain
    # a column of a far-off value: frequent enough to take a table entry in every row, whose rarest
    # high byte then leaves the table (a few raw steps)
    spoiled = w.clone()
    spoiled[:, 100] = 1e-30
    assert packed <= QuantizedWeight.pack_bf16(spoiled).nbytes <= packed * 1.01
    wild = _with_outliers(w, 9)
    assert packed < QuantizedWeight.pack_bf16(wild).nbytes <= plain * 1.01


@pytest.mark.parametrize("family", ["avx2", "avx512bf16"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_equals_the_row_layout_kernel_bit_for_bit(family: str, n: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed kernels add the x8 kernels' products in their order: the family's row-layout
    kernel's bits at every M (AVX512-BF16 up to 256: one to four rows from the packed bytes, more
    with the first pair's pass leaving an x8 copy of each group for the others; AVX2 at every M: the
    first row's pass leaves the copy), with and without bias, raw steps included."""
    if family not in available_isas():
        pytest.skip(f"this CPU has no {family} kernels ({available_isas()})")
    monkeypatch.setenv("PAGEWIRE_CPU_ISA", family)
    gen = torch.Generator().manual_seed(7)
    w = _with_outliers(_weight(n, k, 3, scale=1.0), 4)
    w = torch.where(w.isfinite(), w, torch.zeros((), dtype=w.dtype))  # finite products: comparable bits
    qw = QuantizedWeight.pack_bf16(w)
    b = torch.randn(n, generator=gen).bfloat16()
    rows = (1, 2, 3, 5, 16, 33) if family == "avx2" else (1, 2, 3, 4, 5, 7, 8, 13, 16, 33, 256)
    for m in rows:
        x = torch.randn(m, k, generator=gen).bfloat16()
        for bias in (None, b):
            assert torch.equal(_bits(torch.ops.pagewire.linear_bf16z(x, qw.data, bias)),
                               _bits(torch.ops.pagewire.linear(x, w, bias))), (m, bias is None)
    if family == "avx2":
        return
    x = torch.randn(257, k, generator=gen).bfloat16()  # above 256 rows: ATen's GEMM on unpacked chunks
    torch.testing.assert_close(torch.ops.pagewire.linear_bf16z(x, qw.data, b), torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("family", ["portable", "avx2", "avx512", "avx512bf16", "amx"])
@pytest.mark.parametrize("m", [1, 4, 40, 300])
def test_matches_float64_reference(family: str, m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every family reads a packed weight (those without the kernel through unpacked chunks and ATen's
    GEMM), fp32 activations too."""
    if family not in available_isas():
        pytest.skip(f"this CPU has no {family} kernels ({available_isas()})")
    monkeypatch.setenv("PAGEWIRE_CPU_ISA", family)
    n, k = 83, 336
    gen = torch.Generator().manual_seed(m)
    w = _weight(n, k, m, scale=k**-0.5)
    qw = QuantizedWeight.pack_bf16(w)
    b = torch.randn(n, generator=gen).bfloat16()
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(m, k, generator=gen).to(dtype)
        y = qw.linear(x, b.to(dtype))
        assert y.dtype == dtype and y.shape == (m, n)
        ref = x.double() @ w.double().T + b.double()
        bound = 2.0**-7 * ref.abs() + 2.0**-12 * (x.double().abs() @ w.double().abs().T) + 1e-6
        assert bool(((y.double() - ref).abs() <= bound).all()), dtype


def test_rows_do_not_depend_on_the_batch() -> None:
    """A row's result is the same alone or among others, at every M the kernel serves (and in
    batch-invariant mode past 256 rows)."""
    gen = torch.Generator().manual_seed(2)
    w = _weight(72, 1040, 6, scale=0.05)
    qw = QuantizedWeight.pack_bf16(w)
    x = torch.randn(20, 1040, generator=gen).bfloat16()
    alone = torch.cat([qw.linear(x[i:i + 1], None) for i in range(20)])
    for m in (2, 3, 4, 5, 9, 20):
        assert torch.equal(_bits(qw.linear(x[:m], None)), _bits(alone[:m])), m
    with batch_invariant.mode(True):
        many = torch.randn(300, 1040, generator=gen).bfloat16()
        y = qw.linear(many, None)
        assert torch.equal(_bits(y[-3:]), _bits(qw.linear(many[-3:], None)))


def test_bad_arguments_name_themselves() -> None:
    w = _weight(16, 64, 1)
    with pytest.raises(ValueError, match="K = 40 must be a positive multiple of 16"):
        QuantizedWeight.pack_bf16(_weight(16, 40, 1))
    with pytest.raises(ValueError, match="pack_bf16 takes a bf16"):
        QuantizedWeight.pack_bf16(w.float())
    qw = QuantizedWeight.pack_bf16(w)
    with pytest.raises(RuntimeError, match="not a packed bf16z buffer"):
        torch.ops.pagewire.linear_bf16z(torch.randn(1, 64).bfloat16(), torch.zeros(16, 64, dtype=torch.uint8), None)
    with pytest.raises(RuntimeError, match="x must be a CPU \\[M, K\\] tensor with K = 64"):
        torch.ops.pagewire.linear_bf16z(torch.randn(1, 32).bfloat16(), qw.data, None)
    with pytest.raises(RuntimeError, match="k = 32 does not match the packed weight's K = 64"):
        torch.ops.pagewire.unpack_bf16z(qw.data, 32)
    with pytest.raises(IndexError, match="index 16 is out of range"):
        torch.ops.pagewire.embedding_bf16z(torch.tensor([16]), qw.data, 64)
    with pytest.raises(ValueError, match="a bf16z weight is an interleaved uint8"):
        QuantizedWeight(qw.qtype, qw.data, (16, 64))


def test_opcheck() -> None:
    w = _weight(24, 64, 3)
    data = torch.ops.pagewire.pack_bf16z(w)
    x = torch.randn(3, 64).bfloat16()
    for op, args in ((torch.ops.pagewire.linear_bf16z, (x, data, None)),
                     (torch.ops.pagewire.unpack_bf16z, (data, 64)),
                     (torch.ops.pagewire.embedding_bf16z, (torch.tensor([0, 23]), data, 64))):
        torch.library.opcheck(op, args)
    assert ops.cpu_isa() in available_isas()
