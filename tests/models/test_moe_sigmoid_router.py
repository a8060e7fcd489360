"""Sigmoid routers (DeepSeek-V3 / dots.llm1 style) against a float64 re-implementation of
transformers' Dots1TopkRouter / Dots1MoE (itself checked against transformers' router, which
computes in float32): server.models.moe_router.route, and the whole SparseMoE layer -- its Python
path (route + pagewire::moe_experts) and its fused pagewire::moe_decode path, float and Q8_0
experts -- over random tiny configs: more experts than top-k,
top-k > 1, renormalisation on and off, expert groups on and off, a scaling factor, and a selection
bias that changes which experts run but not their weights. Deterministic mode: a row alone gives
the same floats as in a batch. Config keys: bad values name the key."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from server.kernels import batch_invariant
from server.models.config import ModelLoadError, UnsupportedModelError
from server.models.moe import SparseMoE
from server.models.moe_router import route, route_torch
from server.models.registry import config_from_hf

H, I_MOE = 64, 32
# (experts, top_k, norm_topk_prob, n_group, topk_group, routed_scaling_factor)
CASES = [(8, 2, True, 1, 1, 1.0), (8, 2, False, 1, 1, 2.5), (16, 3, True, 4, 2, 2.5), (16, 4, False, 2, 1, 1.0)]


def _raw(E: int, k: int, norm: bool, n_group: int, topk_group: int, scale: float, **extra: Any) -> dict[str, Any]:
    return {"architectures": ["Dots1ForCausalLM"], "model_type": "dots1", "hidden_size": H, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
            "vocab_size": 100, "moe_intermediate_size": I_MOE, "n_routed_experts": E, "num_experts_per_tok": k,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": norm, "n_group": n_group,
            "topk_group": topk_group, "routed_scaling_factor": scale, "sliding_window": None, **extra}


def _hf_moe(raw: dict[str, Any], seed: int) -> Any:
    """transformers' Dots1MoE in float64 with random weights (and a random selection bias)."""
    from transformers import Dots1Config
    from transformers.models.dots1.modeling_dots1 import Dots1MoE

    cfg = Dots1Config(**{k: v for k, v in raw.items() if k != "architectures"})
    torch.manual_seed(seed)
    moe = Dots1MoE(cfg).double().eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.15)
        moe.gate.e_score_correction_bias.normal_(0.0, 0.2)
    return moe


def reference_route(hf: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dots1TopkRouter.forward in float64: (weights [T, k], ids [T, k])."""
    g = hf.gate
    scores = torch.sigmoid(x.double() @ g.weight.double().t())
    choice = scores + g.e_score_correction_bias.double()
    T, E = choice.shape
    group_scores = choice.view(T, g.num_group, E // g.num_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=g.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(-1, g.num_group, E // g.num_group).reshape(-1, E)
    ids = torch.topk(choice.masked_fill(~mask.bool(), float("-inf")), k=g.top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    if g.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * g.routed_scaling_factor, ids


def reference_moe(hf: Any, x: torch.Tensor) -> torch.Tensor:
    """Dots1MoE.forward in float64, a token at a time: the routed experts' weighted sum plus the
    ungated shared expert."""
    sd = {k: v.double() for k, v in hf.state_dict().items()}
    w, ids = reference_route(hf, x)
    x64 = x.double()
    out = torch.zeros_like(x64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (sd["experts.gate_up_proj"][e] @ x64[t]).chunk(2)
            out[t] += w[t, j] * (sd["experts.down_proj"][e] @ (torch.nn.functional.silu(gate) * up))
        s = "shared_experts."
        h = torch.nn.functional.silu(sd[s + "gate_proj.weight"] @ x64[t]) * (sd[s + "up_proj.weight"] @ x64[t])
        out[t] += sd[s + "down_proj.weight"] @ h
    return out


def _same_choice(ids: torch.Tensor, ref_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asserts each row chose the same experts (top-k order aside); returns both rows' sort orders."""
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    return order.indices, ref_order.indices


def _ours(raw: dict[str, Any], hf: Any) -> SparseMoE:
    """SparseMoE from the config translation, filled with the transformers block's weights."""
    config = config_from_hf(raw)
    moe = SparseMoE(config, torch.float32, torch.device("cpu"))
    E = config.num_experts
    sd = {k: v.float() for k, v in hf.state_dict().items()}
    with torch.no_grad():
        moe.router_weight.copy_(sd["gate.weight"])
        assert moe.selection_bias is not None
        moe.selection_bias.copy_(sd["gate.e_score_correction_bias"])
        gate_up = moe.experts_gate_up
        down = moe.experts_down
        assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
        gate_up.copy_(sd["experts.gate_up_proj"].view(E, 2 * I_MOE, H))
        down.copy_(sd["experts.down_proj"])
        assert moe.shared_gate_weight is None and isinstance(moe.shared_gate_up_weight, torch.Tensor)
        moe.shared_gate_up_weight.copy_(torch.cat([sd["shared_experts.gate_proj.weight"],
                                                    sd["shared_experts.up_proj.weight"]]))
        assert isinstance(moe.shared_down_weight, torch.Tensor)
        moe.shared_down_weight.copy_(sd["shared_experts.down_proj.weight"])
    return moe


def _x(T: int, seed: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
def test_route_matches_transformers_router_in_float64(case: tuple[int, int, bool, int, int, float]) -> None:
    raw = _raw(*case)
    hf = _hf_moe(raw, seed=1)
    x = _x(64, seed=2)
    ref_w, ref_ids = reference_route(hf, x)
    _, hf_w, hf_ids = hf.gate(x.double())  # transformers' own router (it computes in float32)
    hf_order, ref_order = _same_choice(hf_ids, ref_ids)
    torch.testing.assert_close(hf_w.double().gather(1, hf_order), ref_w.gather(1, ref_order), rtol=1e-5, atol=1e-6)
    c = config_from_hf(raw)
    bias = hf.gate.e_score_correction_bias.float()
    ids, w = route(x @ hf.gate.weight.float().t(), c.moe_router, c.num_experts_per_tok, c.norm_topk_prob, bias,
                   c.moe_n_group, c.moe_topk_group, c.moe_routed_scaling)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    order, ref_order = _same_choice(ids, ref_ids)  # top-k order aside: transformers' is unsorted
    torch.testing.assert_close(w.gather(1, order).double(), ref_w.gather(1, ref_order), rtol=1e-5, atol=1e-6)


def test_selection_bias_changes_the_choice_but_not_the_weights() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(256, 16, generator=g)
    bias = torch.randn(16, generator=g) * 0.3
    plain_ids, _ = route(logits, "sigmoid_topk", 4, False)
    ids, w = route(logits, "sigmoid_topk", 4, False, bias)
    assert not torch.equal(ids.sort(-1).values, plain_ids.sort(-1).values)  # the bias moved some choices
    # ... the weights are the unbiased scores (CPU logits take pagewire::moe_route, whose sigmoid is
    # std::exp's: a few ulps from torch's; route_torch's are torch's bit for bit)
    torch.testing.assert_close(w, torch.sigmoid(logits).gather(1, ids), rtol=1e-6, atol=0)
    torch_ids, torch_w = route_torch(logits, "sigmoid_topk", 4, False, bias)
    assert torch.equal(torch_ids, ids) and torch.equal(torch_w, torch.sigmoid(logits).gather(1, ids))
    chosen = (torch.sigmoid(logits) + bias).gather(1, ids)
    # the choice is the biased top-k: every chosen expert beats every other one
    others = (torch.sigmoid(logits) + bias).scatter(1, ids, float("-inf"))
    assert bool((chosen.min(-1).values >= others.max(-1).values).all())
    ids2, w2 = route(logits, "sigmoid_topk", 4, True, bias, routed_scaling=2.5)
    assert torch.equal(ids2, ids)
    torch.testing.assert_close(w2, 2.5 * w / w.sum(-1, keepdim=True))
    # Groups: 4 of 4 experts, only the best 2 groups' experts can be chosen.
    ids3, _ = route(logits, "sigmoid_topk", 4, False, bias, n_group=4, topk_group=2)
    assert max(len(set(r)) for r in (ids3 // 4).tolist()) <= 2


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", ["python", "fused", "fused_q8"])
def test_sparse_moe_matches_transformers_dots1_moe_in_float64(case: tuple[int, int, bool, int, int, float],
                                                              path: str) -> None:
    raw = _raw(*case)
    hf = _hf_moe(raw, seed=4)
    moe = _ours(raw, hf)
    x = _x(16 if path != "python" else 40, seed=5)  # moe_decode takes at most 16 rows
    with torch.no_grad():
        ref = reference_moe(hf, x)
        if path == "fused_q8":
            moe.quantize_weights("q8_0")
        moe.fused_decode = path != "python"
        assert (moe.decode_kinds(x) is not None) == (path != "python")
        out = moe(x)
    if path == "fused_q8":
        # Q8_0 routed and shared experts, fed Q8 activations twice (input, then SiLU(gate) * up):
        # each row within a few percent (a wrong choice, weight or scale is off by tens of percent).
        assert float(((out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max()) < 4e-2
    else:
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantize", [False, True])
def test_deterministic_mode_a_row_alone_equals_the_row_in_a_batch(quantize: bool) -> None:
    raw = _raw(16, 3, True, 4, 2, 2.5)
    moe = _ours(raw, _hf_moe(raw, seed=6))
    if quantize:
        moe.quantize_weights("q8_0")
    x = _x(40, seed=7)
    with torch.no_grad(), batch_invariant.mode(True):
        batch = moe(x)
        for i in (0, 17, 39):
            assert torch.equal(moe(x[i:i + 1]), batch[i:i + 1])


def test_config_keys_and_their_errors() -> None:
    c = config_from_hf(_raw(16, 3, True, 4, 2, 2.5))
    assert (c.moe_router, c.moe_selection_bias, c.moe_n_group, c.moe_topk_group, c.moe_routed_scaling) == (
        "sigmoid_topk", True, 4, 2, 2.5)
    assert c.layer_mlp_kinds == ("dense", "sparse") and c.shared_expert_intermediate_size == I_MOE
    assert not c.shared_expert_gated and c.moe_checkpoint == "deepseek" and c.qk_norm
    assert config_from_hf(_raw(8, 2, True, 1, 1, 1.0, scoring_func="noaux_tc")).moe_router == "sigmoid_topk"
    assert config_from_hf(_raw(8, 2, True, 1, 1, 1.0, scoring_func="sigmoid", topk_method="noaux_tc")).moe_n_group == 1
    # transformers' Dots1TopkRouter is sigmoid with the bias whatever the config says: asking for
    # another router is refused, not followed.
    bad = [({"scoring_func": "relu"}, ModelLoadError, "scoring_func"),
           ({"scoring_func": "softmax"}, UnsupportedModelError, "scoring_func"),
           ({"topk_method": "random"}, ModelLoadError, "topk_method"),
           ({"topk_method": "greedy"}, UnsupportedModelError, "topk_method"),
           ({"topk_method": "greedy", "n_group": 2}, ModelLoadError, "topk_method"),
           ({"topk_method": "group_limited_greedy"}, UnsupportedModelError, "group_limited_greedy"),
           ({"routed_scaling_factor": -1.0}, ModelLoadError, "routed_scaling_factor"),
           ({"routed_scaling_factor": "2"}, ModelLoadError, "routed_scaling_factor"),
           ({"n_group": 3}, ModelLoadError, "n_group"),
           ({"n_group": 0}, ModelLoadError, "n_group"),
           ({"n_group": 2, "topk_group": 3}, ModelLoadError, "topk_group"),
           ({"n_group": 8, "topk_group": 1}, ModelLoadError, "n_group"),  # groups of one expert
           ({"n_group": 4, "topk_group": 1}, ModelLoadError, "topk_group"),  # 2 experts kept < top_k 3
           ({"first_k_dense_replace": 5}, ModelLoadError, "first_k_dense_replace")]
    for extra, error, key in bad:
        with pytest.raises(error, match=key):
            config_from_hf({**_raw(8, 3, True, 1, 1, 1.0), **extra})


def test_bf16_model_routes_in_float32_as_transformers() -> None:
    """In a bf16 model the router weight stays float32 and the logits are computed from the rows
    cast up (transformers keeps Dots1TopkRouter's weight in float32): the same experts and weights
    as transformers' bf16 Dots1MoE chooses; and the fused layer (moe_decode's C++ router, x cast
    up there too) gives the Python layer's output."""
    raw = _raw(16, 3, True, 4, 2, 2.5)
    hf = _hf_moe(raw, seed=8)
    ours = _ours(raw, hf)
    gate = {k: v.float().clone() for k, v in hf.gate.state_dict().items()}
    hf = hf.to(torch.bfloat16)
    hf.gate.float().load_state_dict(gate)  # what from_pretrained keeps: _keep_in_fp32_modules_strict
    moe = SparseMoE(config_from_hf(raw), torch.bfloat16, torch.device("cpu"))
    assert moe.router_weight.dtype == torch.float32 and moe.selection_bias is not None
    with torch.no_grad():
        for name, p in ours.named_parameters():
            getattr(moe, name).copy_(p)
    x = _x(16, seed=9).bfloat16()
    _, hf_w, hf_ids = hf.gate(x)
    ids, w = moe.route(x)
    order, hf_order = _same_choice(ids, hf_ids)
    torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, hf_order), rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        moe.fused_decode = False
        python = moe(x)
        moe.fused_decode = True
        assert moe.decode_kinds(x) is not None
        torch.testing.assert_close(moe(x), python)
