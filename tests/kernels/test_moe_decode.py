"""pagewire::moe_decode, a mixture-of-experts layer's router, experts and shared expert for a decode
step in one call: against a float64 PyTorch reference of the whole layer (router softmax, top-k,
renormalisation on and off, gpt-oss's top-k softmax with router and expert biases and the clamped
SwiGLU, Qwen2-MoE's shared expert and its sigmoid gate) for every expert format pagewire keeps
(float, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4; row and x8 layouts), on every kernel family this
CPU has, with several tokens routed to different experts; and a token's row does not depend on the
other rows of its step or on the thread count."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from server.kernels import batch_invariant, linear_route, ops
from server.kernels.quant import QuantizedExperts, QuantizedWeight
from tests.kernels.test_moe_experts import E, _interleaved, experts, quantised
from tests.kernels.test_quant4 import random_q4

Shared = tuple[torch.Tensor | QuantizedWeight, torch.Tensor | QuantizedWeight, torch.Tensor]


def reference(x: torch.Tensor, rw: torch.Tensor, rb: torch.Tensor | None, router: str, k: int, renorm: bool,
              gu: torch.Tensor, dn: torch.Tensor, gub: torch.Tensor | None, db: torch.Tensor | None,
              activation: str, alpha: float, limit: float, shared: Shared | None) -> torch.Tensor:
    """The whole layer in float64, a token at a time, from the float experts gu [E, 2I, H], dn [E, H, I]."""
    x64 = x.double()
    logits = x64 @ rw.double().t() + (rb.double() if rb is not None else 0)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        if router == "topk_softmax":
            top, ids = torch.topk(logits[t], k)
            w = torch.softmax(top, -1)
        else:
            w, ids = torch.topk(torch.softmax(logits[t], -1), k)
            if renorm:
                w = w / w.sum()
        for j in range(k):
            e = int(ids[j])
            h = gu[e].double() @ x64[t] + (gub[e].double() if gub is not None else 0)
            g, u = h.chunk(2)
            if activation == "silu":
                a = F.silu(g) * u
            else:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                a = (u + 1) * g * torch.sigmoid(alpha * g)
            out[t] += w[j] * (dn[e].double() @ a + (db[e].double() if db is not None else 0))
        if shared is not None:
            sgu, sdn, sg = (_float(m) for m in shared)
            sgt, sup = (sgu @ x64[t]).chunk(2)
            out[t] += torch.sigmoid(sg @ x64[t]) * (sdn @ (F.silu(sgt) * sup))
    return out


def _float(w: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return (w.dequantize() if isinstance(w, QuantizedWeight) else w).double()


def _kind(w: torch.Tensor | QuantizedWeight, x: torch.Tensor) -> str:
    kind = linear_route.linear_kind(x.dtype, x.shape[0], w, None)
    assert kind is not None
    return str(kind)


def run(x: torch.Tensor, rw: torch.Tensor, rb: torch.Tensor | None, router: str, k: int, renorm: bool,
        gu: torch.Tensor | QuantizedExperts, dn: torch.Tensor | QuantizedExperts, gub: torch.Tensor | None = None,
        db: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
        shared: Shared | None = None) -> torch.Tensor:
    sh = None
    if shared is not None:
        sgu, sdn, sg = shared
        sh = (sgu.data if isinstance(sgu, QuantizedWeight) else sgu, _kind(sgu, x),
              sdn.data if isinstance(sdn, QuantizedWeight) else sdn, _kind(sdn, x), sg, _kind(sg, x))
    return ops.moe_decode(x, rw, str(linear_route.linear_kind(x.dtype, x.shape[0], rw, rb)), rb, router, k, renorm, gu, dn,
                          gub, db, activation, alpha, limit, sh)


def _shared(qtype: str, H: int, S: int, seed: int) -> Shared:
    """A shared expert in `qtype` blocks (gate_up [2S, H], down [H, S]) and its float gate [1, H]."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(1, H, generator=g) * 0.3
    if qtype in ("q8_0", "q4_0"):
        return (QuantizedWeight.quantize(torch.randn(2 * S, H, generator=g) * 0.1, qtype).for_kernels(),
                QuantizedWeight.quantize(torch.randn(H, S, generator=g) * 0.1, qtype).for_kernels(), gate)
    return random_q4(qtype, 2 * S, H, seed).for_kernels(), random_q4(qtype, H, S, seed + 1).for_kernels(), gate


def _router(H: int, seed: int, bias: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, H, generator=g) * 0.3, (torch.randn(E, generator=g) if bias else None)


@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "iq4_nl",
                                   "iq4_xs", "q2_k", "q3_k", "iq3_s"])
def test_quantised_layer_matches_float64(cpu_isa: str, qtype: str, interleave: bool, renorm: bool) -> None:
    """Softmax router, top-3 of 8 with and without renormalisation, a shared expert in the same
    format; five tokens spread over the experts."""
    gu, dn = quantised(qtype, seed=4)
    if interleave:
        gu, dn = _interleaved(gu), _interleaved(dn)
    H = gu.shape[2]
    shared = _shared(qtype, H, H if qtype not in ("q8_0", "q4_0") else 32, seed=11)
    rw, _ = _router(H, seed=3)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(5))
    got = run(x, rw, None, "softmax_topk", 3, renorm, gu, dn, shared=shared)
    ref = reference(x, rw, None, "softmax_topk", 3, renorm, gu.dequantize(), dn.dequantize(), None, None, "silu",
                    0.0, 0.0, shared)
    # The activations are quantised to 8 bits per block on the fly (x, and each expert's SiLU product).
    scale = float(ref.abs().max())
    torch.testing.assert_close(got.double(), ref, atol=3e-2 * scale, rtol=3e-2)


@pytest.mark.parametrize("T,k", [(1, 2), (5, 3), (16, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_experts_and_float_shared_expert_match_float64(cpu_isa: str, dtype: torch.dtype, T: int,
                                                             k: int) -> None:
    gu, dn = experts(7, dtype)
    H = gu.shape[2]
    g = torch.Generator().manual_seed(9)
    shared = ((torch.randn(64, H, generator=g) * 0.1).to(dtype), (torch.randn(H, 32, generator=g) * 0.1).to(dtype),
              (torch.randn(1, H, generator=g) * 0.3).to(dtype))
    rw, _ = _router(H, seed=2)
    x = torch.randn(T, H, generator=g).to(dtype)
    got = run(x, rw.to(dtype), None, "softmax_topk", k, True, gu, dn, shared=shared)
    ref = reference(x, rw.to(dtype), None, "softmax_topk", k, True, gu, dn, None, None, "silu", 0.0, 0.0, shared)
    tol = 1e-4 if dtype is torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), ref, atol=tol * float(ref.abs().max()), rtol=tol)


@pytest.mark.parametrize("fmt", ["float", "q8_0", "mxfp4"])
def test_gpt_oss_layer_matches_float64(cpu_isa: str, fmt: str) -> None:
    """gpt-oss's router (top-k of the biased logits, softmax over those k) and experts (biases, the
    clamped SwiGLU with a limit the pre-activations cross), float32 activations."""
    gu, dn = experts(4, torch.float32)
    H, I = gu.shape[2], dn.shape[2]
    g = torch.Generator().manual_seed(5)
    gub, db = torch.randn(E, 2 * I, generator=g) * 0.3, torch.randn(E, H, generator=g) * 0.3
    rw, rb = _router(H, seed=6, bias=True)
    x = torch.randn(6, H, generator=g) * 2
    alpha, limit = 1.702, 0.7
    qgu: torch.Tensor | QuantizedExperts = gu
    qdn: torch.Tensor | QuantizedExperts = dn
    if fmt == "q8_0":
        qgu, qdn = QuantizedExperts.quantize(gu, fmt).for_kernels(), QuantizedExperts.quantize(dn, fmt).for_kernels()
    elif fmt == "mxfp4":
        qgu = QuantizedExperts.from_gguf_bytes(fmt, random_q4(fmt, E * 2 * I, H, 1).data, E, 2 * I, H)
        qdn = QuantizedExperts.from_gguf_bytes(fmt, random_q4(fmt, E * H, I, 2).data, E, H, I)
    fgu = qgu.dequantize() if isinstance(qgu, QuantizedExperts) else gu
    fdn = qdn.dequantize() if isinstance(qdn, QuantizedExperts) else dn
    got = run(x, rw, rb, "topk_softmax", 2, False, qgu, qdn, gub, db, "swiglu_oai", alpha, limit)
    ref = reference(x, rw, rb, "topk_softmax", 2, False, fgu, fdn, gub, db, "swiglu_oai", alpha, limit, None)
    tol = 1e-4 if fmt == "float" else 3e-2
    torch.testing.assert_close(got.double(), ref, atol=tol * float(ref.abs().max()), rtol=tol)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "q6_k"])
def test_a_rows_result_depends_on_that_row_alone(qtype: str) -> None:
    """In batch-invariant mode, and at any thread count: a row alone, and among rows that route to
    the same and other experts, gives the same floats."""
    gu, dn = (w.for_kernels() for w in quantised(qtype, seed=2))
    H = gu.shape[2]
    sgu, sdn, sg = _shared(qtype, H, H if qtype != "q8_0" else 32, seed=12)
    shared = (sgu, sdn, sg.bfloat16())
    rw, _ = _router(H, seed=1)
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    with batch_invariant.mode(True):
        full = run(x, rw.bfloat16(), None, "softmax_topk", 4, True, gu, dn, shared=shared)
        for t in (0, 7, 15):
            assert torch.equal(run(x[t : t + 1], rw.bfloat16(), None, "softmax_topk", 4, True, gu, dn, shared=shared)[0],
                               full[t])
        torch.set_num_threads(1)
        try:
            assert torch.equal(run(x, rw.bfloat16(), None, "softmax_topk", 4, True, gu, dn, shared=shared), full)
        finally:
            torch.set_num_threads(threads)


def test_bad_arguments_are_named() -> None:
    gu, dn = experts(1, torch.float32)
    H = gu.shape[2]
    rw, _ = _router(H, seed=1)
    x = torch.randn(2, H)
    with pytest.raises(RuntimeError, match="router must be 'softmax_topk', 'topk_softmax' or 'sigmoid_topk'"):
        run(x, rw, None, "sigmoid", 2, True, gu, dn)
    with pytest.raises(RuntimeError, match="top_k must be in"):
        run(x, rw, None, "softmax_topk", E + 1, True, gu, dn)
    with pytest.raises(RuntimeError, match="at most 16 tokens"):
        run(torch.randn(17, H), rw, None, "softmax_topk", 2, True, gu, dn)


def test_opcheck_moe_decode() -> None:
    """The schema, the fake kernel and the CPU kernel agree (torch.library.opcheck)."""
    gu, dn = (w.for_kernels() for w in quantised("q8_0", seed=3))
    H = gu.shape[2]
    rw, _ = _router(H, seed=2)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(4))
    kind = str(linear_route.linear_kind(x.dtype, 3, rw, None))
    torch.library.opcheck(torch.ops.pagewire.moe_decode.default,
                          (x, rw, kind, None, "softmax_topk", 2, True, gu.data, str(gu.op_qtype), dn.data,
                           str(dn.op_qtype), None, None, "silu", 1.702, 7.0, None, "", None, "", None, ""))
