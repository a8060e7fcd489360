"""bf16 weights in the interleaved x8 layout (csrc/cpu/linear_bf16x8*.cpp, QuantizedWeight.from_bf16):
the layout round-trips, pagewire::linear_bf16x8 gives pagewire::linear's result bit for bit (AVX2, AVX512-BF16)
(so the model's floats do not change when its matrices are moved) and a float64 reference's within
bf16 rounding, rows do not depend on the batch, embedding_bf16x8 gathers F.embedding's rows, and
bad arguments name themselves. AVX2 and AVX512-BF16 CPUs interleave a model's matrices
(DecoderForCausalLM.interleave_bf16); the op itself runs everywhere (below AVX2 through a de-interleaved copy)."""
from __future__ import annotations

import pytest
import torch

from server.kernels import batch_invariant, linear_route, ops
from server.kernels.quant import QuantizedWeight
from tests.kernels.conftest import available_isas

SHAPES = [(8, 16), (45, 64), (7, 32), (576, 576), (17, 4096), (3072, 576), (24, 2832)]


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("n,k", SHAPES)
def test_layout_round_trips_and_keeps_the_bytes(n: int, k: int) -> None:
    w = _weight(n, k, n + k)
    qw = QuantizedWeight.from_bf16(w)
    assert qw.interleaved and qw.op_qtype == "bf16x8" and qw.nbytes == w.numel() * 2 and qw.shape == (n, k)
    assert torch.equal(qw.dequantize(torch.bfloat16), w)
    assert torch.equal(torch.sort(qw.data.flatten()).values, torch.sort(w.view(torch.uint8).flatten()).values)
    if n >= 8:  # moved: group 0's first chunk holds 16 values of row 0, then of row 1
        flat = qw.data.flatten()
        assert torch.equal(flat[:32].view(torch.bfloat16), w[0, :16])
        assert torch.equal(flat[32:64].view(torch.bfloat16), w[1, :16])


@pytest.mark.parametrize("family", ["avx2", "avx512bf16"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_equals_the_row_layout_kernel_bit_for_bit(family: str, n: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On each family that interleaves, the two layouts run the same arithmetic per output, so the
    same bits, for every M (AVX2: tiles of one and two x rows; AVX512-BF16: tiles of one to three,
    and 32-wide steps whose K % 32 = 16 tail the x8 kernel mirrors; K over 2048 in spans, 2832 with an
    odd tail in the last), with and without bias, and N % 8
    rows left in row layout. Above 256 rows AVX512-BF16 runs ATen's GEMM on de-interleaved chunks
    (as F.linear on the row layout), except in batch-invariant mode, where the kernel serves every M."""
    if family not in available_isas():
        pytest.skip(f"this CPU has no {family} kernels ({available_isas()})")
    monkeypatch.setenv("PAGEWIRE_CPU_ISA", family)
    gen = torch.Generator().manual_seed(7)
    w = _weight(n, k, 3)
    qw = QuantizedWeight.from_bf16(w)
    b = torch.randn(n, generator=gen).bfloat16()
    rows = (1, 2, 3, 5, 16, 33) if family == "avx2" else (1, 2, 3, 4, 5, 7, 8, 13, 16, 33)
    for m in rows:
        x = torch.randn(m, k, generator=gen).bfloat16()
        for bias in (None, b):
            assert torch.equal(torch.ops.pagewire.linear_bf16x8(x, qw.data, bias),
                               torch.ops.pagewire.linear(x, w, bias)), (m, bias is None)
    if family == "avx512bf16":
        x = torch.randn(257, k, generator=gen).bfloat16()
        torch.testing.assert_close(torch.ops.pagewire.linear_bf16x8(x, qw.data, b), torch.nn.functional.linear(x, w, b))
        with batch_invariant.mode(True):
            assert torch.equal(torch.ops.pagewire.linear_bf16x8(x, qw.data, b), torch.ops.pagewire.linear(x, w, b))


@pytest.mark.parametrize("m", [1, 4, 40])
def test_matches_float64_reference(cpu_isa: str, m: int) -> None:
    """Every kernel family (portable: ATen on a de-interleaved copy): fp32 accumulation, one bf16 rounding."""
    gen = torch.Generator().manual_seed(m)
    w = _weight(75, 320, m)
    x = torch.randn(m, 320, generator=gen).bfloat16()
    b = torch.randn(75, generator=gen).bfloat16()
    y = ops.linear(x, QuantizedWeight.from_bf16(w), b)
    ref = x.double() @ w.double().t() + b.double()
    assert y.dtype == torch.bfloat16 and y.shape == (m, 75)
    torch.testing.assert_close(y.double(), ref, rtol=2.0**-7, atol=1e-3 * float(ref.abs().max()))


def test_rows_do_not_depend_on_the_batch(cpu_isa: str) -> None:
    """Deterministic mode: a row alone equals the same row in any batch (and the path never splits)."""
    gen = torch.Generator().manual_seed(11)
    qw = QuantizedWeight.from_bf16(_weight(45, 800, 11))
    x = torch.randn(37, 800, generator=gen).bfloat16()
    with batch_invariant.mode(True):
        alone = [ops.linear(x[r:r + 1], qw, None) for r in range(37)]
        for m in (2, 3, 16, 17, 37):
            y = ops.linear(x[:m], qw, None)
            for r in range(m):
                assert torch.equal(y[r:r + 1], alone[r]), (m, r)


def test_other_dtypes_and_paths_keep_f_linear_semantics() -> None:
    """fp32 activations and the autotune's GEMM path de-interleave a copy; results in x's dtype."""
    gen = torch.Generator().manual_seed(2)
    w = _weight(24, 64, 2)
    qw = QuantizedWeight.from_bf16(w)
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(ops.linear(x, qw, None), x @ w.float().t())
    xb = x.bfloat16()
    torch.testing.assert_close(linear_route._quant_gemm_path(xb, qw, None), torch.nn.functional.linear(xb, w))
    assert linear_route.fixed_rule_takes_kernel(qw, 1000) and linear_route.linear_kind(torch.bfloat16, 4, qw, None) == "bf16x8"


def test_embedding_gathers_the_rows() -> None:
    w = _weight(45, 64, 5)
    qw = QuantizedWeight.from_bf16(w)
    ids = torch.tensor([[0, 7, 8, 44], [40, 39, 1, 0]])
    assert torch.equal(linear_route.embedding(ids, qw), torch.nn.functional.embedding(ids, w))
    with pytest.raises(IndexError, match="index 45 is out of range for an embedding table of 45 rows"):
        linear_route.embedding(torch.tensor([45]), qw)


def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(ValueError, match="from_bf16 takes a bf16"):
        QuantizedWeight.from_bf16(torch.zeros(8, 16))
    with pytest.raises(ValueError, match="K = 24 must be a positive multiple of 16"):
        QuantizedWeight.from_bf16(torch.zeros(8, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="exists only in the x8 layout"):
        QuantizedWeight("bf16", torch.zeros(8, 32, dtype=torch.uint8), (8, 16))
    qw = QuantizedWeight.from_bf16(_weight(8, 32, 1))
    with pytest.raises(RuntimeError, match="x must be a CPU \\[M, K\\] tensor with K = 32"):
        torch.ops.pagewire.linear_bf16x8(torch.zeros(1, 16, dtype=torch.bfloat16), qw.data, None)
    with pytest.raises(RuntimeError, match="bias must be a CPU \\[N\\] tensor"):
        torch.ops.pagewire.linear_bf16x8(torch.zeros(1, 32, dtype=torch.bfloat16), qw.data,
                                         torch.zeros(9, dtype=torch.bfloat16))


def test_opcheck() -> None:
    gen = torch.Generator().manual_seed(6)
    w = _weight(16, 64, 6)
    qw = QuantizedWeight.from_bf16(w)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    torch.library.opcheck(torch.ops.pagewire.interleave_bf16.default, (w,))
    torch.library.opcheck(torch.ops.pagewire.deinterleave_bf16.default, (qw.data,))
    torch.library.opcheck(torch.ops.pagewire.linear_bf16x8.default, (x, qw.data, None))
    torch.library.opcheck(torch.ops.pagewire.linear_bf16x8.default, (x, qw.data, torch.randn(16).bfloat16()))
    torch.library.opcheck(torch.ops.pagewire.embedding_bf16x8.default, (torch.tensor([3, 0, 15]), qw.data))
