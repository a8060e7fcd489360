"""pagewire::moe_decode's sigmoid router (csrc/cpu/moe_route.cpp, DeepSeek-V3 / dots.llm1 style):
sigmoid scores, a selection bias that chooses but does not weight, group-limited top-k, optional
renormalisation and a scaling factor, with an ungated shared expert -- against a float64 PyTorch
reference of the whole layer, for float experts (the moe_experts path) and quantised ones (the
one-region path) on every kernel family this CPU has; a row's floats do not depend on its batch
or the thread count; the schema and fake kernel agree; bad arguments are named."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from server.kernels import batch_invariant, linear_route, ops
from server.kernels.quant import QuantizedExperts, QuantizedWeight
from tests.kernels.test_moe_decode import _float, _kind, _shared
from tests.kernels.test_moe_experts import E, experts, quantised

Router = tuple[torch.Tensor, torch.Tensor, int, bool, int, int, float]  # weight, bias, k, renorm, groups, kept, scale
Shared = tuple[torch.Tensor | QuantizedWeight, torch.Tensor | QuantizedWeight]

# (k, renorm, n_group, topk_group, scale): E = 8 experts
SETTINGS = [(2, True, 1, 1, 1.0), (3, False, 1, 1, 2.5), (2, True, 4, 2, 2.5), (3, False, 2, 1, 1.0)]


def reference(x: torch.Tensor, r: Router, gu: torch.Tensor, dn: torch.Tensor, shared: Shared | None) -> torch.Tensor:
    """The layer in float64, a token at a time (transformers' DeepseekV3TopkRouter and MoE block)."""
    rw, bias, k, renorm, n_group, topk_group, scale = r
    x64 = x.double()
    scores = torch.sigmoid(x64 @ rw.double().t())
    choice = scores + bias.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        c = choice[t].clone()
        groups = c.view(n_group, -1).topk(2, dim=-1).values.sum(-1) if n_group > 1 else None
        if groups is not None:
            kept = torch.zeros(n_group, dtype=torch.bool)
            kept[groups.topk(topk_group).indices] = True
            c[~kept.repeat_interleave(E // n_group)] = float("-inf")
        ids = c.topk(k).indices
        w = scores[t, ids]
        if renorm:
            w = w / (w.sum() + 1e-20)
        w = w * scale
        for j in range(k):
            e = int(ids[j])
            g, u = (gu[e].double() @ x64[t]).chunk(2)
            out[t] += w[j] * (dn[e].double() @ (F.silu(g) * u))
        if shared is not None:
            sgu, sdn = (_float(m) for m in shared)
            sg, su = (sgu @ x64[t]).chunk(2)
            out[t] += sdn @ (F.silu(sg) * su)
    return out


def router(H: int, setting: tuple[int, bool, int, int, float], seed: int) -> Router:
    g = torch.Generator().manual_seed(seed)
    k, renorm, n_group, topk_group, scale = setting
    return torch.randn(E, H, generator=g) * 0.3, torch.randn(E, generator=g) * 0.3, k, renorm, n_group, topk_group, scale


def run(x: torch.Tensor, r: Router, gu: torch.Tensor | QuantizedExperts, dn: torch.Tensor | QuantizedExperts,
        shared: Shared | None) -> torch.Tensor:
    rw, bias, k, renorm, n_group, topk_group, scale = r
    sh = None
    if shared is not None:
        sgu, sdn = shared
        sh = (sgu.data if isinstance(sgu, QuantizedWeight) else sgu, _kind(sgu, x),
              sdn.data if isinstance(sdn, QuantizedWeight) else sdn, _kind(sdn, x), None, "")
    return ops.moe_decode(x, rw, str(linear_route.linear_kind(x.dtype, x.shape[0], rw, None)), None, "sigmoid_topk", k, renorm,
                          gu, dn, None, None, "silu", 1.702, 7.0, sh, bias, n_group, topk_group, scale)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "q6_k"])
def test_quantised_layer_matches_float64(cpu_isa: str, qtype: str, setting: tuple[int, bool, int, int, float]) -> None:
    gu, dn = (w.for_kernels() for w in quantised(qtype, seed=4))
    H = gu.shape[2]
    sgu, sdn, _ = _shared(qtype, H, H if qtype != "q8_0" else 32, seed=11)
    r = router(H, setting, seed=3)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(5))
    got = run(x, r, gu, dn, (sgu, sdn))
    ref = reference(x, r, gu.dequantize(), dn.dequantize(), (sgu, sdn))
    # The activations are quantised to 8 bits per block on the fly (x, and each expert's SiLU product).
    torch.testing.assert_close(got.double(), ref, atol=3e-2 * float(ref.abs().max()), rtol=3e-2)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_layer_matches_float64(cpu_isa: str, dtype: torch.dtype, setting: tuple[int, bool, int, int, float]) -> None:
    gu, dn = experts(7, dtype)
    H = gu.shape[2]
    g = torch.Generator().manual_seed(9)
    shared = ((torch.randn(64, H, generator=g) * 0.1).to(dtype), (torch.randn(H, 32, generator=g) * 0.1).to(dtype))
    rw, bias, *rest = router(H, setting, seed=2)
    r: Router = (rw.to(dtype), bias, *rest)  # type: ignore[assignment]
    x = torch.randn(16, H, generator=g).to(dtype)
    got = run(x, r, gu, dn, shared)
    ref = reference(x, r, gu, dn, shared)
    tol = 1e-4 if dtype is torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), ref, atol=tol * float(ref.abs().max()), rtol=tol)


def test_the_bias_chooses_but_does_not_weight() -> None:
    """Float experts: with a bias that flips choices, the layer equals the reference that chooses
    by the biased scores and weights by the unbiased ones -- and differs from one without bias."""
    gu, dn = experts(3, torch.float32)
    H = gu.shape[2]
    rw, _, *rest = router(H, (2, True, 1, 1, 1.0), seed=5)
    bias = torch.tensor([0.6, -0.6] * (E // 2))
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(6))
    r: Router = (rw, bias, *rest)  # type: ignore[assignment]
    got = run(x, r, gu, dn, None)
    torch.testing.assert_close(got.double(), reference(x, r, gu, dn, None), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, run(x, (rw, torch.zeros(E), *rest), gu, dn, None))  # type: ignore[arg-type]


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k"])
def test_a_rows_result_depends_on_that_row_alone(qtype: str) -> None:
    gu, dn = (w.for_kernels() for w in quantised(qtype, seed=2))
    H = gu.shape[2]
    sgu, sdn, _ = _shared(qtype, H, H if qtype != "q8_0" else 32, seed=12)
    r = router(H, (3, True, 4, 2, 2.5), seed=1)
    r = (r[0].bfloat16(), *r[1:])  # type: ignore[assignment]
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    with batch_invariant.mode(True):
        full = run(x, r, gu, dn, (sgu, sdn))
        for t in (0, 7, 15):
            assert torch.equal(run(x[t:t + 1], r, gu, dn, (sgu, sdn))[0], full[t])
        torch.set_num_threads(1)
        try:
            assert torch.equal(run(x, r, gu, dn, (sgu, sdn)), full)
        finally:
            torch.set_num_threads(threads)


def test_opcheck_and_bad_arguments() -> None:
    gu, dn = (w.for_kernels() for w in quantised("q8_0", seed=3))
    H = gu.shape[2]
    rw, bias, *_ = router(H, SETTINGS[0], seed=2)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(4))
    kind = str(linear_route.linear_kind(x.dtype, 3, rw, None))
    torch.library.opcheck(torch.ops.pagewire.moe_decode.default,
                          (x, rw, kind, None, "sigmoid_topk", 2, True, gu.data, str(gu.op_qtype), dn.data,
                           str(dn.op_qtype), None, None, "silu", 1.702, 7.0, None, "", None, "", None, "", bias, 2, 1,
                           2.5))

    def call(router_name: str = "sigmoid_topk", sel: torch.Tensor | None = bias, n_group: int = 1,
             topk_group: int = 1, k: int = 2) -> torch.Tensor:
        return ops.moe_decode(x, rw, kind, None, router_name, k, True, gu, dn, None, None, "silu", 1.702, 7.0, None,
                              sel, n_group, topk_group, 1.0)

    with pytest.raises(RuntimeError, match="selection_bias must be"):
        call(sel=torch.zeros(E + 1))
    with pytest.raises(RuntimeError, match="takes no selection_bias"):
        call(router_name="topk_softmax")
    for n_group, topk_group, k in ((3, 1, 2), (8, 1, 1), (2, 3, 2), (4, 1, 3)):
        with pytest.raises(RuntimeError, match="n_group"):
            call(n_group=n_group, topk_group=topk_group, k=k)
