"""pagewire::moe_experts, the routed experts of a mixture-of-experts layer: against a float64
PyTorch reference (float experts, and quantised experts against their dequantised weights), on
every kernel family this CPU has; experts no token chose are never read; in batch-invariant mode a
token's row does not depend on the other tokens of the step; and the quantised op equals the same
row kernels run expert by expert."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from server.kernels import batch_invariant, ops
from server.kernels.quant import QuantizedExperts
from tests.kernels.test_quant4 import random_q4

E, H, I = 8, 64, 96


def reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """float64: sum_j w[t, j] * down_e(silu(gate_e x) * up_e x), a token at a time."""
    x64, gu, dn = x.double(), gate_up.double(), down.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            g, u = (gu[e] @ x64[t]).chunk(2)
            out[t] += float(w[t, j]) * (dn[e] @ (F.silu(g) * u))
    return out


def routing(T: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax router's output: k distinct experts per token and their (renormalised) weights."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(T, E, generator=g), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).float()


def experts(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype),
            (torch.randn(E, H, I, generator=g) * 0.1).to(dtype))


@pytest.mark.parametrize("T,k", [(1, 2), (5, 3), (40, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_experts_match_float64(cpu_isa: str, dtype: torch.dtype, T: int, k: int) -> None:
    gate_up, down = experts(1, dtype)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    ids, w = routing(T, k, seed=3)
    got = ops.moe_experts(x, ids, w, gate_up, down)
    assert got.dtype == dtype and got.shape == (T, H)
    ref = reference(x, ids, w, gate_up, down)
    tol = 1e-4 if dtype is torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), ref, atol=tol * float(ref.abs().max()), rtol=tol)


def quantised(qtype: str, seed: int) -> tuple[QuantizedExperts, QuantizedExperts]:
    if qtype in ("q8_0", "q4_0"):
        gate_up, down = experts(seed, torch.float32)
        return QuantizedExperts.quantize(gate_up, qtype), QuantizedExperts.quantize(down, qtype)
    # Q4_1 and the K-quants: random valid blocks (K a multiple of 256 for the K-quants: H and I below are)
    gu = random_q4(qtype, E * 2 * 256, 256, seed)
    dn = random_q4(qtype, E * 256, 256, seed + 1)
    return (QuantizedExperts.from_gguf_bytes(qtype, gu.data, E, 2 * 256, 256),
            QuantizedExperts.from_gguf_bytes(qtype, dn.data, E, 256, 256))


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "iq4_nl",
                                   "iq4_xs", "q2_k", "q3_k", "iq1_s"])
def test_quantised_experts_match_their_dequantised_weights(cpu_isa: str, qtype: str, interleave: bool) -> None:
    gate_up, down = quantised(qtype, seed=4)
    if interleave:
        gate_up = QuantizedExperts(gate_up.qtype, gate_up.data, gate_up.shape)
        flat_gu = gate_up.dequantize()
        gate_up = _interleaved(gate_up)
        down = _interleaved(down)
        assert torch.equal(gate_up.dequantize(), flat_gu)  # the same weights, another layout
    hidden = gate_up.shape[2]
    T, k = 7, 3
    x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(5))
    ids, w = routing(T, k, seed=6)
    got = ops.moe_experts(x, ids, w, gate_up, down)
    ref = reference(x, ids, w, gate_up.dequantize(), down.dequantize())
    # The activations are quantised to 8 bits per block on the fly (twice: x and the SiLU product).
    scale = float(ref.abs().max())
    torch.testing.assert_close(got.double(), ref, atol=3e-2 * scale, rtol=3e-2)
    # ... and exactly the format's row kernels, run expert by expert, summed in slot order. In
    # batch-invariant mode: otherwise an AMX CPU's Q8_0 kernel takes AMX tiles from 4 rows (an
    # expert's token group here) and the AVX-512 kernel for the lone rows below, which round apart.
    with batch_invariant.mode(True):
        got = ops.moe_experts(x, ids, w, gate_up, down)
        exact = torch.zeros(T, hidden)
        for t in range(T):
            for j in range(k):
                e = int(ids[t, j])
                h = ops.silu_and_mul(gate_up.expert(e).linear(x[t : t + 1], None))
                exact[t] += w[t, j] * down.expert(e).linear(h, None)[0]
    assert torch.equal(got, exact)


def _interleaved(q: QuantizedExperts) -> QuantizedExperts:
    e, n, k = q.shape
    from server.kernels.quant import QuantizedWeight

    flat = QuantizedWeight(q.qtype, q.data.reshape(e * n, -1), (e * n, k)).interleave()
    return QuantizedExperts(q.qtype, flat.data.reshape(q.data.shape), q.shape, interleaved=True)


def test_experts_no_token_chose_are_never_read() -> None:
    gate_up, down = experts(7, torch.float32)
    ids = torch.tensor([[0, 3], [3, 5], [5, 0]])
    w = torch.full((3, 2), 0.5)
    unused = [e for e in range(E) if e not in (0, 3, 5)]
    gate_up[unused] = float("nan")
    down[unused] = float("nan")
    x = torch.randn(3, H)
    got = ops.moe_experts(x, ids, w, gate_up, down)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), reference(x, ids, w, gate_up, down), atol=1e-4, rtol=1e-4)


def test_empty_slots_and_bad_ids() -> None:
    gate_up, down = experts(8, torch.float32)
    x = torch.randn(2, H)
    ids = torch.tensor([[1, -1], [-1, -1]])
    w = torch.tensor([[0.7, 0.3], [0.5, 0.5]])
    got = ops.moe_experts(x, ids, w, gate_up, down)
    assert torch.equal(got[1], torch.zeros(H))
    torch.testing.assert_close(got.double(), reference(x, ids, w, gate_up, down), atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.moe_experts(x, torch.tensor([[E, 0], [0, 1]]), w, gate_up, down)
    with pytest.raises(RuntimeError, match="topk_weights must be float32"):
        ops.moe_experts(x, ids, w.double(), gate_up, down)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "q8_0", "q4_0"])
def test_a_tokens_row_does_not_depend_on_its_batch_in_batch_invariant_mode(kind: str) -> None:
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    gate_up, down = experts(9, dtype)
    if kind.startswith("q"):
        gate_up, down = QuantizedExperts.quantize(gate_up, kind), QuantizedExperts.quantize(down, kind)
        gate_up, down = gate_up.for_kernels(), down.for_kernels()
    T = 45  # > 16 rows for some experts: the quantised kernel runs in blocks, the float kernel at any M
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(10)).to(dtype)
    ids, w = routing(T, 2, seed=11)
    with batch_invariant.mode(True):
        batch = ops.moe_experts(x, ids, w, gate_up, down)
        for t in (0, 17, 44):
            alone = ops.moe_experts(x[t : t + 1], ids[t : t + 1], w[t : t + 1], gate_up, down)
            assert torch.equal(alone[0], batch[t]), t
        # a different neighbour set: the rows reversed
        rev = ops.moe_experts(x.flip(0), ids.flip(0), w.flip(0), gate_up, down)
        assert torch.equal(rev.flip(0), batch)


def swiglu_oai_reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor, gub: torch.Tensor, db: torch.Tensor, alpha: float,
                         limit: float) -> torch.Tensor:
    """float64 gpt-oss experts: h = gate_up_e x + b; g = min(gate, limit), u = clamp(up, +-limit);
    down_e((u + 1) * g * sigmoid(alpha g)) + b, weighted and summed over the token's slots."""
    x64, gu, dn = x.double(), gate_up.double(), down.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (gu[e] @ x64[t] + gub[e].double()).chunk(2)
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            out[t] += float(w[t, j]) * (dn[e] @ ((u + 1) * g * torch.sigmoid(alpha * g)) + db[e].double())
    return out


@pytest.mark.parametrize("T,k", [(1, 2), (7, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_experts_match_float64(cpu_isa: str, dtype: torch.dtype, T: int, k: int) -> None:
    """gpt-oss's experts: biases on both matrices and the clamped SwiGLU, with a limit the
    activations cross (so the clamps are exercised), float and Q8_0-kept experts."""
    gate_up, down = experts(4, dtype)
    g = torch.Generator().manual_seed(5)
    gub, db = (torch.randn(E, 2 * I, generator=g) * 0.3).to(dtype), (torch.randn(E, H, generator=g) * 0.3).to(dtype)
    x = (torch.randn(T, H, generator=g) * 2).to(dtype)
    ids, w = routing(T, k, seed=6)
    alpha, limit = 1.702, 0.7
    pre = torch.einsum("enh,th->ten", gate_up.double(), x.double())
    assert (pre.abs() > limit).float().mean() > 0.2  # the clamps bite
    got = ops.moe_experts(x, ids, w, gate_up, down, gub, db, "swiglu_oai", alpha, limit)
    ref = swiglu_oai_reference(x, ids, w, gate_up, down, gub, db, alpha, limit)
    tol = 1e-4 if dtype is torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), ref, atol=tol * float(ref.abs().max()), rtol=tol)
    qgu, qdn = QuantizedExperts.quantize(gate_up.float(), "q8_0"), QuantizedExperts.quantize(down.float(), "q8_0")
    got_q = ops.moe_experts(x, ids, w, qgu.for_kernels(), qdn.for_kernels(), gub, db, "swiglu_oai", alpha, limit)
    ref_q = swiglu_oai_reference(x, ids, w, qgu.dequantize(), qdn.dequantize(), gub, db, alpha, limit)
    torch.testing.assert_close(got_q.double(), ref_q, atol=3e-2 * float(ref_q.abs().max()), rtol=3e-2)


def test_bad_expert_biases_and_activation_are_named() -> None:
    gate_up, down = experts(1, torch.float32)
    x = torch.randn(2, H)
    ids, w = routing(2, 2, seed=1)
    with pytest.raises(RuntimeError, match="gate_up_bias must be"):
        ops.moe_experts(x, ids, w, gate_up, down, torch.zeros(E, I), None, "swiglu_oai")
    with pytest.raises(RuntimeError, match="activation must be 'silu' or 'swiglu_oai'"):
        ops.moe_experts(x, ids, w, gate_up, down, None, None, "gelu")


def test_mxfp4_experts_run_on_their_blocks(cpu_isa: str) -> None:
    """MXFP4 experts (GGML's blocks, as gpt-oss GGUF files keep them) are multiplied from their
    blocks by the 4-bit integer kernels (activations quantised to Q8 per 32 values, as for the other
    block formats): near a float64 reference of the decoded experts, whose decode equals the gguf
    package's."""
    from gguf import GGMLQuantizationType, quants

    gate_up, down = experts(7, torch.float32)
    t = GGMLQuantizationType.MXFP4
    packed = [torch.from_numpy(quants.quantize(w.reshape(-1, w.shape[-1]).numpy(), t)).reshape(E, w.shape[1], -1)
              for w in (gate_up, down)]
    qgu = QuantizedExperts("mxfp4", packed[0], (E, 2 * I, H))
    qdn = QuantizedExperts("mxfp4", packed[1], (E, H, I))
    fgu, fdn = qgu.dequantize(), qdn.dequantize()
    want = quants.dequantize(packed[0].reshape(E * 2 * I, -1).numpy(), t).reshape(E, 2 * I, H)
    assert torch.equal(fgu, torch.from_numpy(want))
    g = torch.Generator().manual_seed(8)
    x, gub, db = torch.randn(6, H, generator=g), torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    ids, w = routing(6, 2, seed=9)
    got = ops.moe_experts(x, ids, w, qgu.for_kernels(), qdn.for_kernels(), gub, db, "swiglu_oai", 1.702, 7.0)
    ref = swiglu_oai_reference(x, ids, w, fgu, fdn, gub, db, 1.702, 7.0)
    torch.testing.assert_close(got.double(), ref, atol=3e-2 * float(ref.abs().max()), rtol=3e-2)
