"""The fused decoder ops (pagewire::rms_norm, add_rms_norm, rotary_embedding, silu_and_mul,
gelu_tanh_and_mul) against
float64 references, against the torch compositions the model uses off-CPU, and under opcheck."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from server.kernels import ops
from server.models import layers
from server.models.config import RopeScaling
from server.models.rope import RotaryEmbedding
from tests.kernels.conftest import available_isas

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def ulp(dtype: torch.dtype) -> float:
    """Relative spacing of the dtype (one rounding costs at most half of it)."""
    return {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]


def assert_close_to(y: torch.Tensor, ref: torch.Tensor, roundings: int) -> None:
    """|y - ref| within `roundings` half-ulps of the dtype, relative to each element (plus a tiny floor)."""
    tol = roundings * ulp(y.dtype) / 2 * ref.abs() + 1e-6 * ref.abs().max()
    err = (y.double() - ref).abs()
    assert bool((err <= tol).all()), f"max excess {(err - tol).max().item():.3g}"


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,d", [(1, 1024), (5, 72), (300, 256)])
def test_rms_norm(dtype: torch.dtype, T: int, d: int) -> None:
    gen = torch.Generator().manual_seed(T + d)
    x = (torch.randn(T, d, generator=gen) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype)
    y = ops.rms_norm(x, w, 1e-5)
    assert y.dtype == dtype and y.shape == (T, d)
    # bf16/fp16: the normalised value and the product with weight are each rounded (2 roundings),
    # and fp32 sums of squares add a little.
    assert_close_to(y, rms_norm_ref(x, w, 1e-5), roundings=3)
    # And it is the torch composition (transformers' rounding) up to one last-place difference.
    torch.testing.assert_close(y, layers.rms_norm(x, w, 1e-5), rtol=ulp(dtype), atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_residual(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    residual = torch.randn(4, 128, generator=gen).to(dtype)
    delta = torch.randn(4, 128, generator=gen).to(dtype)
    w = torch.randn(128, generator=gen).to(dtype)
    want_residual = residual + delta  # rounded to dtype once, as the model's residual add is
    r = residual.clone()
    y = ops.add_rms_norm(r, delta, w, 1e-6)
    assert torch.equal(r, want_residual)
    assert_close_to(y, rms_norm_ref(want_residual, w, 1e-6), roundings=3)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float64 from the inverse frequencies."""
    ang = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, d/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    xd = x.double()
    half = x.shape[-1] // 2
    x1, x2 = xd[..., :half], xd[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


SCALINGS = {
    "default": None,
    "llama3": RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", sorted(SCALINGS))
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_embedding_in_place_on_strided_qk(dtype: torch.dtype, scaling: str, qk_norm: bool) -> None:
    """q and k as the model has them: the first nh + nkv heads of a fused qkv row (row stride > width)."""
    T, nh, nkv, d = 6, 4, 2, 32
    gen = torch.Generator().manual_seed(7)
    rope = RotaryEmbedding(d, 512, 10000.0, SCALINGS[scaling])
    from server.models.rope import rope_inv_freq

    inv_freq = rope_inv_freq(d, 10000.0, SCALINGS[scaling])
    qkv = torch.randn(T, (nh + 2 * nkv) * d, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 17, 63, 200, 511])
    norm_w = (1 + 0.2 * torch.randn(nh + nkv, d, generator=gen)).to(dtype) if qk_norm else None
    before = qkv.clone()
    qk = qkv[:, : (nh + nkv) * d].view(T, nh + nkv, d)
    ops.rotary_embedding(qk, positions, rope.cos, rope.sin, norm_w, 1e-6)

    src = before[:, : (nh + nkv) * d].view(T, nh + nkv, d)
    if norm_w is not None:
        src64 = rms_norm_ref(src, norm_w, 1e-6)
    else:
        src64 = src.double()
    ref = rope_ref(src64, positions, inv_freq)
    # Values near zero lose relative precision in the bf16 sum of two rounded products; compare
    # against the row's scale: cos/sin cast, two products, the sum, and the norm's two roundings,
    # plus the fp32 tables' own angle error (position * inv_freq rounded in fp32, as transformers
    # computes it: up to ~1e-5 at position 511).
    scale = ref.abs().amax(-1, keepdim=True)
    err = (qk.double() - ref).abs()
    assert bool((err <= (6 * ulp(dtype) + 2e-5) * scale).all()), (err / scale).max().item()
    # The v columns are untouched.
    assert torch.equal(qkv[:, (nh + nkv) * d :], before[:, (nh + nkv) * d :])
    # The torch path (used off-CPU) agrees to within rounding.
    rb = rope.prepare(positions, dtype)
    ours_torch = src.clone()
    fake_batch = type(rb)(positions, *rope.lookup(positions, dtype))
    rope.rotate_(ours_torch, fake_batch, norm_w, 1e-6)
    torch.testing.assert_close(qk, ours_torch, rtol=2 * ulp(dtype), atol=2 * ulp(dtype) * scale.max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 2816), (3, 40), (70, 1003)])
def test_silu_and_mul(cpu_isa: str, dtype: torch.dtype, T: int, I: int) -> None:
    """Every kernel family (AVX2's vectorised exp and the portable libm loop), odd tails included."""
    gen = torch.Generator().manual_seed(T * I)
    x = (torch.randn(T, 2 * I, generator=gen) * 4).to(dtype)
    y = ops.silu_and_mul(x)
    g, u = x[:, :I].double(), x[:, I:].double()
    ref = g * torch.sigmoid(g) * u
    # fp32: the two exps (ours, torch's) each carry a few ulps.
    assert_close_to(y, ref, roundings=3 if dtype != torch.float32 else 16)
    torch.testing.assert_close(y, F.silu(x[:, :I]) * x[:, I:], rtol=ulp(dtype) if dtype != torch.float32 else 1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 2816), (3, 40), (70, 1003)])
def test_gelu_tanh_and_mul(cpu_isa: str, dtype: torch.dtype, T: int, I: int) -> None:
    """GELU-tanh (Gemma's MLP) on every kernel family: the float64 formula, and torch's own
    F.gelu(approximate="tanh") * up (the models' off-CPU path and transformers' rounding)."""
    gen = torch.Generator().manual_seed(T * I + 1)
    x = (torch.randn(T, 2 * I, generator=gen) * 4).to(dtype)
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-4, -1e-4, 9.5, -9.5, 30.0, -30.0]).to(dtype)  # tanh's ends and middle
    y = ops.gelu_tanh_and_mul(x)
    g, u = x[:, :I].double(), x[:, I:].double()
    ref = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u
    assert_close_to(y, ref, roundings=3 if dtype != torch.float32 else 16)
    # torch's vectorised tanh saturates to -1 sooner (gelu of a gate below ~ -5 becomes exactly 0 there):
    # absolute agreement at fp32 precision of the largest value.
    torch.testing.assert_close(y, F.gelu(x[:, :I], approximate="tanh") * x[:, I:],
                               rtol=ulp(dtype) if dtype != torch.float32 else 1e-6,
                               atol=1e-6 * float(ref.abs().max()))
    assert torch.equal(layers.gelu_tanh_and_mul(x), y)


def _on_family(isa: str, fn):  # type: ignore[no-untyped-def]
    """fn() with the C++ ops forced onto kernel family `isa` (PAGEWIRE_CPU_ISA, read per call)."""
    import os

    import server

    old = os.environ.get("PAGEWIRE_CPU_ISA")
    os.environ["PAGEWIRE_CPU_ISA"] = isa
    try:
        assert server._C.cpu_isa() == isa
        return fn()
    finally:
        if old is None:
            os.environ.pop("PAGEWIRE_CPU_ISA", None)
        else:
            os.environ["PAGEWIRE_CPU_ISA"] = old


@pytest.mark.parametrize("T,d", [(1, 576), (3, 72), (8, 576), (9, 1030), (40, 264)])
def test_bf16_norms_are_the_portable_bits(cpu_isa: str, T: int, d: int) -> None:
    """rms_norm and add_rms_norm in bf16 on this family (AVX2 bodies from the avx2 family up) give the
    portable loop's bits exactly, residual included: tails (d % 8), rows on one thread and split
    over the team, huge and tiny values."""
    gen = torch.Generator().manual_seed(T * d)
    x = (torch.randn(T, d, generator=gen) * 3).bfloat16()
    x[0, :4] = torch.tensor([3e38, -1e-38, 0.0, 65504.0]).bfloat16()
    delta = (torch.randn(T, d, generator=gen) * 2).bfloat16()
    w = (1 + 0.1 * torch.randn(d, generator=gen)).bfloat16()

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = x.clone()
        return ops.rms_norm(x, w, 1e-5), ops.add_rms_norm(r, delta, w, 1e-6), r

    want = _on_family("portable", run)
    got = _on_family(cpu_isa, run)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("T,heads,d", [(1, 12, 64), (8, 12, 64), (3, 5, 72), (6, 4, 40)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_bf16_rotary_is_the_portable_bits(cpu_isa: str, T: int, heads: int, d: int, qk_norm: bool) -> None:
    """rotary_embedding in bf16 (with and without Qwen3's per-head norm) on a strided qk view: this
    family's bits are the portable loop's, head_dim tails (d / 2 % 8) included."""
    gen = torch.Generator().manual_seed(T * heads + d)
    rope = RotaryEmbedding(d, 4096, 10000.0, None)
    qkv = (torch.randn(T, (heads + 2) * d, generator=gen) * 2).bfloat16()
    positions = torch.randint(0, 4096, (T,), generator=gen)
    norm_w = (1 + 0.2 * torch.randn(heads, d, generator=gen)).bfloat16() if qk_norm else None

    def run() -> torch.Tensor:
        out = qkv.clone()
        ops.rotary_embedding(out[:, : heads * d].view(T, heads, d), positions, rope.cos, rope.sin, norm_w, 1e-6)
        return out

    assert torch.equal(_on_family(cpu_isa, run).view(torch.int16), _on_family("portable", run).view(torch.int16))


@pytest.mark.parametrize("cpu_isa", [isa for isa in available_isas() if isa != "portable"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,I", [(1, 7), (3, 40), (8, 1536), (5, 1003)])
def test_gated_bits_are_the_avx2_bits(cpu_isa: str, dtype: torch.dtype, T: int, I: int) -> None:
    """silu_and_mul and gelu_tanh_and_mul on this family give the AVX2 family's bits (the AVX-512
    bodies run gated_body.h's operations 16 lanes at a time): widths 16 and 8, scalar tails, rows
    split over the team, gates where exp clamps. (The portable family's libm loop rounds otherwise:
    the tests above hold it to the float64 formulas.)"""
    gen = torch.Generator().manual_seed(T * I)
    x = (torch.randn(T, 2 * I, generator=gen) * 4).to(dtype)
    x[0, : min(I, 6)] = torch.tensor([0.0, -0.0, 95.0, -95.0, 9.5, -9.5])[: min(I, 6)].to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for op in (ops.silu_and_mul, ops.gelu_tanh_and_mul):
        assert torch.equal(_on_family(cpu_isa, lambda: op(x)).view(bits), _on_family("avx2", lambda: op(x)).view(bits))


def test_bad_arguments_name_the_argument() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="weight must be \\[hidden\\]"):
        ops.rms_norm(x, torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="delta shape"):
        ops.add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-6)
    rope = RotaryEmbedding(8, 16, 10000.0, None)
    with pytest.raises(RuntimeError, match="positions\\[1\\] = 16"):
        ops.rotary_embedding(torch.randn(2, 1, 8), torch.tensor([0, 16]), rope.cos, rope.sin)
    with pytest.raises(RuntimeError, match="x must be \\[T, 2 \\* I\\]"):
        ops.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="x must be \\[T, 2 \\* I\\]"):
        ops.gelu_tanh_and_mul(torch.randn(2, 7))


def test_opcheck_fused_ops() -> None:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    w = torch.randn(64, generator=gen).bfloat16()
    torch.library.opcheck(torch.ops.pagewire.rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.pagewire.add_rms_norm.default, (x.clone(), x.clone(), w, 1e-6))
    rope = RotaryEmbedding(16, 32, 10000.0, None)
    qk = torch.randn(3, 4, 16, generator=gen).bfloat16()
    torch.library.opcheck(torch.ops.pagewire.rotary_embedding.default,
                          (qk, torch.tensor([0, 5, 31]), rope.cos, rope.sin, None, 1e-6))
    torch.library.opcheck(torch.ops.pagewire.rotary_embedding.default,
                          (qk, torch.tensor([0, 5, 31]), rope.cos, rope.sin, torch.ones(4, 16).bfloat16(), 1e-6))
    torch.library.opcheck(torch.ops.pagewire.silu_and_mul.default, (x,))
    torch.library.opcheck(torch.ops.pagewire.gelu_tanh_and_mul.default, (x,))
    assert math.isfinite(float(x.float().sum()))
