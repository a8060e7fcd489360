"""pagewire::lora_add (every row's own LoRA term for one fused projection in one call) against a
float64 PyTorch reference, in float32, bfloat16 and float16: ragged stacks of adapters of ranks 1,
8, 16 and 64, parts (PEFT modules) whose widths and input sizes are not multiples of 8 or 16,
adapters that target only some parts, rows with no adapter (left bit for bit as they were). The
portable body gives the AVX2 body's bits, and a row's result does not depend on its batch.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from server.kernels import ops


@dataclass
class Problem:
    x: torch.Tensor            # [T, in]
    out: torch.Tensor          # [T, N], the base output the terms are added to
    adapter: torch.Tensor      # int32 [T]
    a: torch.Tensor            # [R, in]
    spans: torch.Tensor        # int32 [n, P, 2]
    scales: torch.Tensor       # float32 [n]
    bts: list[torch.Tensor]
    parts: list[int]
    # per adapter and part: (A [r, in], B [rows, r]) in float64 (of the stored values), or None
    weights: list[list[tuple[torch.Tensor, torch.Tensor] | None]]


def make(seed: int, dtype: torch.dtype, T: int, inp: int, widths: list[int], ranks: list[int],
         targets: list[list[bool]]) -> Problem:
    """n = len(ranks) adapters over P = len(widths) parts (output columns laid side by side with a
    gap, so columns outside every part are checked untouched); targets[k][p]: adapter k has a term
    in part p."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    n, P = len(ranks), len(widths)
    rows_at, col = [], 3
    for w in widths:
        rows_at.append(col)
        col += w + 2
    N = col
    a_rows: list[torch.Tensor] = []
    bts: list[torch.Tensor] = []
    parts: list[int] = []
    spans = torch.zeros(n, P, 2, dtype=torch.int32)
    weights: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = [[None] * P for _ in range(n)]
    R = 0
    for p, w in enumerate(widths):
        c0, cols = R, []
        for k, r in enumerate(ranks):
            if not targets[k][p]:
                continue
            A = (torch.randn(r, inp, generator=g) / inp ** 0.5).to(dtype)
            B = (torch.randn(w, r, generator=g) / r ** 0.5).to(dtype)
            spans[k, p] = torch.tensor([R, r])
            a_rows.append(A)
            cols.append(B.t())
            weights[k][p] = (A.double(), B.double())
            R += r
        bts.append(torch.cat(cols).contiguous() if cols else torch.zeros(0, w, dtype=dtype))
        parts += [rows_at[p], w, c0]
    a = torch.cat(a_rows).contiguous()
    x = torch.randn(T, inp, generator=g).to(dtype)
    out = torch.randn(T, N, generator=g).to(dtype)
    adapter = torch.tensor([rng.randrange(-1, n) for _ in range(T)], dtype=torch.int32)
    scales = torch.tensor([rng.choice([0.5, 2.0, 1.7]) for _ in range(n)], dtype=torch.float32)
    return Problem(x, out, adapter, a, spans, scales, bts, parts, weights)


def reference(pb: Problem, dtype: torch.dtype) -> torch.Tensor:
    """float64, rounding where PEFT's tensors of `dtype` round: lora_A's output, lora_B's, the
    scaling, the sum (none for float32)."""
    def rnd(v: torch.Tensor) -> torch.Tensor:
        return v if dtype == torch.float32 else v.to(dtype).double()

    ref = pb.out.double().clone()
    for t, k in enumerate(pb.adapter.tolist()):
        if k < 0:
            continue
        for p, w in enumerate(pb.weights[k]):
            if w is None:
                continue
            A, B = w
            row, rows = pb.parts[3 * p], pb.parts[3 * p + 1]
            u = rnd(A @ pb.x[t].double())
            d = rnd(rnd(B @ u) * float(pb.scales[k]))
            ref[t, row:row + rows] = rnd(ref[t, row:row + rows] + d)
    return ref


def run(pb: Problem) -> torch.Tensor:
    out = pb.out.clone()
    ops.lora_add(out, pb.x, pb.adapter, pb.a, pb.spans, pb.scales, pb.bts, pb.parts)
    return out


TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
       torch.float16: dict(atol=3e-3, rtol=2e-3)}
SHAPES = [  # T, in, part widths, ranks, targets
    (1, 64, [48], [8], [[True]]),
    (5, 45, [37, 19, 19], [1, 8, 16], [[True, True, True], [True, False, True], [False, True, False]]),
    (13, 77, [100, 16], [64, 16, 8, 1], [[True, True], [True, True], [False, True], [True, False]]),
    (16, 200, [33], [16, 16, 64], [[True], [True], [True]]),
    (40, 24, [9, 130], [8, 64], [[True, True], [True, True]]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_lora_add_matches_float64(dtype: torch.dtype, shape: int) -> None:
    T, inp, widths, ranks, targets = SHAPES[shape]
    pb = make(shape, dtype, T, inp, widths, ranks, targets)
    got = run(pb)
    torch.testing.assert_close(got.double(), reference(pb, dtype), **TOL[dtype])
    # Rows without an adapter, and columns outside every part, keep their bits.
    none = pb.adapter < 0
    assert torch.equal(got[none], pb.out[none])
    outside = torch.ones(got.shape[1], dtype=torch.bool)
    for p in range(len(widths)):
        outside[pb.parts[3 * p]:pb.parts[3 * p] + pb.parts[3 * p + 1]] = False
    assert torch.equal(got[:, outside], pb.out[:, outside])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_portable_body_gives_the_same_bits(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    for shape in range(len(SHAPES)):
        pb = make(100 + shape, dtype, *SHAPES[shape])
        native = run(pb)
        monkeypatch.setenv("PAGEWIRE_CPU_ISA", "portable")
        portable = run(pb)
        monkeypatch.delenv("PAGEWIRE_CPU_ISA")
        assert torch.equal(native, portable), shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """Each row alone (the others set to no adapter) gives the bits it gets in the full batch, and
    so does the batch split over several threads or one."""
    pb = make(7, dtype, *SHAPES[4])
    full = run(pb)
    adapter = pb.adapter.clone()
    for t in range(adapter.shape[0]):
        pb.adapter = torch.full_like(adapter, -1)
        pb.adapter[t] = adapter[t]
        assert torch.equal(run(pb)[t], full[t]), t
    pb.adapter = adapter
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run(pb), full)
    finally:
        torch.set_num_threads(threads)


def test_strided_rows() -> None:
    """x and out may be column slices of wider tensors (rows strided, each row contiguous)."""
    pb = make(3, torch.float32, *SHAPES[1])
    want = run(pb)
    wide_x = torch.zeros(pb.x.shape[0], pb.x.shape[1] + 11)
    wide_x[:, 5:5 + pb.x.shape[1]] = pb.x
    wide_out = torch.zeros(pb.out.shape[0], pb.out.shape[1] + 7)
    wide_out[:, 2:2 + pb.out.shape[1]] = pb.out
    out = wide_out[:, 2:2 + pb.out.shape[1]]
    ops.lora_add(out, wide_x[:, 5:5 + pb.x.shape[1]], pb.adapter, pb.a, pb.spans, pb.scales, pb.bts, pb.parts)
    assert torch.equal(out, want)


def test_bad_arguments_are_refused() -> None:
    pb = make(4, torch.float32, *SHAPES[1])
    bad = pb.adapter.clone()
    bad[0] = 3
    with pytest.raises(RuntimeError, match=r"adapter\[0\] = 3 but there are 3 adapters"):
        ops.lora_add(pb.out.clone(), pb.x, bad, pb.a, pb.spans, pb.scales, pb.bts, pb.parts)
    spans = pb.spans.clone()
    spans[0, 0, 1] = 1000
    with pytest.raises(RuntimeError, match=r"spans\[0\]\[0\]"):
        ops.lora_add(pb.out.clone(), pb.x, pb.adapter, pb.a, spans, pb.scales, pb.bts, pb.parts)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.lora_add(pb.out.clone().to(torch.bfloat16), pb.x, pb.adapter, pb.a, pb.spans, pb.scales, pb.bts,
                     pb.parts)
    with pytest.raises(RuntimeError, match="parts must hold"):
        ops.lora_add(pb.out.clone(), pb.x, pb.adapter, pb.a, pb.spans, pb.scales, pb.bts, pb.parts[:-1])


@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_torch_fallback_matches_float64(shape: int) -> None:
    """ops.lora_add off CPU composes torch ops (ops.lora_add_torch), checked here on CPU tensors."""
    pb = make(200 + shape, torch.float32, *SHAPES[shape])
    out = pb.out.clone()
    ops.lora_add_torch(out, pb.x, pb.adapter, pb.a, pb.spans, pb.scales, pb.bts, pb.parts)
    torch.testing.assert_close(out.double(), reference(pb, torch.float32), **TOL[torch.float32])


def test_opcheck() -> None:
    """The schema (out mutated in place), the fake kernel and the CPU kernel agree."""
    pb = make(9, torch.bfloat16, *SHAPES[1])
    torch.library.opcheck(torch.ops.pagewire.lora_add.default,
                          (pb.out.clone(), pb.x, pb.adapter, pb.a, pb.spans, pb.scales, pb.bts, pb.parts))
