"""pagewire::moe_route (csrc/cpu/moe_route_op.cpp), the router route() runs for CPU logits, against
route_torch (the torch ops it replaces there) and a float64 reference, for every router kind,
renormalisation on and off, a selection bias, expert groups, a scaling factor, k in {1, 2, 8},
T in {1, 17, 300} (300 takes the OpenMP path) and float32 / bfloat16 logits:
  - ids identical (logits without ties);
  - weights: not bit for bit but a few fp32 ulps apart (up to 9 seen for E = 64; the bound is 16):
    the op's softmax (over all E, or over the k for topk_softmax) and renormalising sum use std::exp
    and a serial sum, torch's vectorised kernels another exp and order. topk_softmax on bfloat16
    logits rounds to bfloat16 and agrees to one bfloat16 step (bit for bit in practice). All stay
    within 1e-6 relative of float64 (half a bfloat16 step when rounded to it);
a row alone equals the same row in a batch and at one thread; the schema and fake kernel agree;
bad arguments raise errors naming the argument."""
from __future__ import annotations

import pytest
import torch

from server.kernels import ops
from server.models.moe_router import route, route_torch

E = 64
FP32_ULPS = 16  # the fp32 scorings' bound against route_torch (see the module docstring)

# (router, selection bias, n_group, topk_group, routed_scaling)
KINDS = [
    ("softmax_topk", False, 1, 1, 1.0),
    ("softmax_topk", True, 8, 4, 2.5),
    ("sigmoid_topk", False, 1, 1, 1.0),
    ("sigmoid_topk", True, 1, 1, 2.5),
    ("sigmoid_topk", True, 8, 4, 2.5),
    ("topk_softmax", False, 1, 1, 1.0),
]


def logits_without_ties(T: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, E] logits whose values are distinct within each row, also after rounding to `dtype`:
    torch.randn for float32; for bfloat16 (whose 8 bits make randn collide) a shuffled ramp with a
    random scale per row, its steps wider than bfloat16's spacing."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        return torch.randn(T, E, generator=g) * 2
    vals = (torch.linspace(-4, 4, E) * (0.5 + torch.rand(T, 1, generator=g))).to(dtype)
    out = vals.gather(1, torch.rand(T, E, generator=g).argsort(-1))
    assert all(len(set(r.tolist())) == E for r in out.float())
    return out


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between same-signed float32 tensors in units in the last place."""
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


def reference64(logits: torch.Tensor, router: str, k: int, renorm: bool, bias: torch.Tensor | None,
                n_group: int, topk_group: int, scale: float) -> torch.Tensor:
    """The weights of route_torch's choice in float64 (the choice itself is checked against the op)."""
    ids, _ = route_torch(logits, router, k, renorm, bias, n_group, topk_group, scale)
    l64 = logits.double()
    if router == "topk_softmax":
        return torch.softmax(l64.gather(1, ids), dim=-1)
    scores = torch.sigmoid(l64) if router == "sigmoid_topk" else torch.softmax(l64, dim=-1)
    w = scores.gather(1, ids)
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 17, 300])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("kind", KINDS, ids=lambda c: f"{c[0]}-bias{int(c[1])}-g{c[2]}-s{c[4]}")
def test_matches_torch_route(kind: tuple[str, bool, int, int, float], renorm: bool, k: int, T: int,
                             dtype: torch.dtype) -> None:
    router, with_bias, n_group, topk_group, scale = kind
    logits = logits_without_ties(T, dtype, seed=T * 31 + k)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(k)) * 0.3 if with_bias else None
    args = (router, k, renorm, bias, n_group, topk_group, scale)
    ids, w = ops.moe_route(logits, *args)
    ref_ids, ref_w = route_torch(logits, *args)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (T, k)
    assert torch.equal(ids, ref_ids)
    rtol = 1e-6
    if router == "topk_softmax" and dtype == torch.bfloat16:
        # Both round to bfloat16: at most one step of it apart (bit for bit so far), within half a
        # step of float64.
        assert torch.equal(w.to(dtype).float(), w)
        assert ulps(w, ref_w) <= 1 << 16
        rtol = 2.0 ** -8
    else:
        assert ulps(w, ref_w) <= FP32_ULPS
    torch.testing.assert_close(w.double(), reference64(logits, *args), rtol=rtol, atol=1e-7 * scale)
    # route() takes the op for CPU logits: its result is the op's
    got_ids, got_w = route(logits, *args)
    assert torch.equal(got_ids, ids) and torch.equal(got_w, w)


@pytest.mark.parametrize("kind", KINDS, ids=lambda c: f"{c[0]}-bias{int(c[1])}-g{c[2]}")
def test_row_does_not_depend_on_batch_or_threads(kind: tuple[str, bool, int, int, float]) -> None:
    router, with_bias, n_group, topk_group, scale = kind
    logits = logits_without_ties(300, torch.bfloat16, seed=7)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(3)) * 0.3 if with_bias else None
    args = (router, 8, True, bias, n_group, topk_group, scale)
    ids, w = ops.moe_route(logits, *args)
    for t in (0, 16, 17, 150, 299):
        one_ids, one_w = ops.moe_route(logits[t:t + 1], *args)
        assert torch.equal(one_ids[0], ids[t]) and torch.equal(one_w[0], w[t])
    part_ids, part_w = ops.moe_route(logits[5:70], *args)  # unaligned to the op's chunks, still parallel
    assert torch.equal(part_ids, ids[5:70]) and torch.equal(part_w, w[5:70])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_ids, one_w = ops.moe_route(logits, *args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_ids, ids) and torch.equal(one_w, w)


def test_other_dtypes_and_empty() -> None:
    logits = logits_without_ties(5, torch.float32, seed=2)
    # float16 logits take the op; float64 ones stay on the torch path (route_torch's float64 arithmetic)
    ids, w = route(logits.half(), "softmax_topk", 2, True)
    assert torch.equal(ids, route_torch(logits.half(), "softmax_topk", 2, True)[0])
    ids64, w64 = route(logits.double(), "softmax_topk", 2, True)
    ref = route_torch(logits.double(), "softmax_topk", 2, True)
    assert torch.equal(ids64, ref[0]) and torch.equal(w64, ref[1])
    ids, w = ops.moe_route(logits[:0], "sigmoid_topk", 3, True)
    assert ids.shape == w.shape == (0, 3)


def test_opcheck_and_bad_arguments() -> None:
    logits = logits_without_ties(20, torch.bfloat16, seed=1)
    bias = torch.randn(E)
    torch.library.opcheck(torch.ops.pagewire.moe_route.default, (logits, "sigmoid_topk", 4, True, bias, 8, 4, 2.5))
    torch.library.opcheck(torch.ops.pagewire.moe_route.default, (logits.float(), "topk_softmax", 2, False, None, 1, 1,
                                                                 1.0))

    def call(router: str = "sigmoid_topk", k: int = 2, sel: torch.Tensor | None = bias, n_group: int = 1,
             topk_group: int = 1, scale: float = 1.0, x: torch.Tensor = logits) -> object:
        return ops.moe_route(x, router, k, True, sel, n_group, topk_group, scale)

    with pytest.raises(RuntimeError, match="router must be"):
        call(router="softmax")
    with pytest.raises(ValueError, match="router"):
        route(logits, "softmax", 2, True)
    for k in (0, E + 1):
        with pytest.raises(RuntimeError, match=r"top_k must be in \[1, 64\]"):
            call(k=k)
    with pytest.raises(RuntimeError, match="selection_bias must be"):
        call(sel=torch.zeros(E + 1))
    with pytest.raises(RuntimeError, match="selection_bias must be"):
        call(sel=torch.zeros(E, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="takes no selection_bias"):
        call(router="topk_softmax")
    with pytest.raises(RuntimeError, match="takes no selection_bias"):
        call(router="topk_softmax", sel=None, scale=2.0)
    for n_group, topk_group, k in ((3, 1, 2), (64, 1, 1), (2, 3, 2), (8, 1, 9), (0, 1, 1)):
        with pytest.raises(RuntimeError, match="n_group"):
            call(n_group=n_group, topk_group=topk_group, k=k)
    with pytest.raises(RuntimeError, match="logits must be"):
        call(x=logits.double())
    with pytest.raises(RuntimeError, match="logits must be"):
        call(x=logits[0])
