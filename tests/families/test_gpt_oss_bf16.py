"""gpt-oss in bfloat16 rounds where transformers does: its RMSNorm multiplies the weight in float32
and rounds once (GptOssRMSNorm, bitwise), and moe_experts ("swiglu_oai") adds each bias after its
product is rounded, rounds each expert output times its weight, and adds those into the token's row
in expert order with a rounding per add (GptOssExperts' index_add_), checked bitwise against that
order spelled out in torch on the same kernels' products."""
from __future__ import annotations

import pytest
import torch

from server.kernels import ops
from server.models.layers import add_norm, norm, rms_norm_weight_fp32

E, I, H = 6, 32, 64


def test_norm_equals_transformers_gpt_oss_rms_norm() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    g = torch.Generator().manual_seed(1)
    ref = GptOssRMSNorm(H, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(H, generator=g) + 0.5)
    x = (torch.randn(7, H, generator=g) * 3).bfloat16()
    want = ref(x)
    assert torch.equal(rms_norm_weight_fp32(x, ref.weight.data, 1e-5), want)
    assert torch.equal(norm(x, ref.weight.data, 1e-5, weight_fp32=True), want)
    res, delta = x.clone(), torch.randn(7, H, generator=g).bfloat16()
    got = add_norm(res, delta, ref.weight.data, 1e-5, weight_fp32=True)
    assert torch.equal(res, x + delta) and torch.equal(got, ref(x + delta))
    # float32 is the one rounding either way: the fused op's result.
    xf = x.float()
    assert torch.equal(norm(xf, ref.weight.data.float(), 1e-5, weight_fp32=True), norm(xf, ref.weight.data.float(), 1e-5))


def _reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor,
               gub: torch.Tensor, db: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """transformers' GptOssExperts order, its matmuls as pagewire's linear computes them."""
    out = torch.zeros_like(x)
    for e in sorted(set(int(i) for i in ids.flatten().tolist() if i >= 0)):
        tok, slot = torch.where(ids == e)
        h = ops.linear(x[tok], gu[e]) + gub[e]
        gate, up = h[:, :I].clamp(max=limit), h[:, I:].clamp(-limit, limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * alpha))
        y = ops.linear(act, dn[e]) + db[e]
        out.index_add_(0, tok, y * w[tok, slot, None].to(x.dtype))
    return out


@pytest.mark.parametrize("T", [1, 5, 16])
def test_swiglu_oai_experts_round_as_transformers(T: int) -> None:
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).bfloat16()
    gu = (torch.randn(E, 2 * I, H, generator=g) * 0.5).bfloat16()
    dn = (torch.randn(E, H, I, generator=g) * 0.2).bfloat16()
    gub, db = (torch.randn(E, 2 * I, generator=g) * 0.1).bfloat16(), (torch.randn(E, H, generator=g) * 0.1).bfloat16()
    logits = torch.randn(T, E, generator=g)
    top, ids = torch.topk(logits, 3, dim=-1)
    w = torch.softmax(top.bfloat16(), dim=-1).float()  # the router's bf16 softmax, as SparseMoE.route
    ids[0, 1] = -1  # an empty slot is skipped
    got = ops.moe_experts(x, ids, w, gu, dn, gub, db, "swiglu_oai", 1.702, 7.0)
    want = _reference(x, ids, w, gu, dn, gub, db, 1.702, 7.0)
    assert torch.equal(got, want)
