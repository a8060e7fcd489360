"""ERNIE 4.5 MoE beyond what every family is checked for (tests/families/test_family_*.py run its
tiny folder -- interleaved RoPE, a softmax router whose selection bias chooses but does not
weight, top-2 of 8 renormalised, a dense first layer, an ungated shared expert -- and its F32 GGUF
copy against transformers): the router against transformers' Ernie4_5_MoeTopKRouter; the bias
changes which experts the tiny model runs; the checkpoints' MTP head is skipped; bad config
values name their key."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from server.models.config import ModelLoadError, UnsupportedModelError
from server.models.loader import load_model
from server.models.moe_router import route
from server.models.registry import config_from_hf
from tests.models.paged_harness import PagedRun, random_tokens


def _raw(**extra: Any) -> dict[str, Any]:
    return {"architectures": ["Ernie4_5_MoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100,
            "moe_intermediate_size": 32, "moe_num_experts": 16, "moe_k": 4, "moe_num_shared_experts": 2,
            "moe_layer_start_index": 1, "moe_layer_end_index": -1, "moe_layer_interval": 1, **extra}


def test_router_matches_transformers() -> None:
    from transformers import Ernie4_5_MoeConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    raw = _raw()
    hf = Ernie4_5_MoeTopKRouter(Ernie4_5_MoeConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        hf.weight.normal_(0.0, 0.3, generator=g)
        hf.moe_statics.e_score_correction_bias.normal_(0.0, 0.05, generator=g)
    x = torch.randn(256, 64, generator=g)
    _, hf_w, hf_ids = hf(x)
    c = config_from_hf(raw)
    bias = hf.moe_statics.e_score_correction_bias[0]
    ids, w = route(x @ hf.weight.t(), c.moe_router, c.num_experts_per_tok, c.norm_topk_prob, bias)
    plain_ids, _ = route(x @ hf.weight.t(), c.moe_router, c.num_experts_per_tok, c.norm_topk_prob)
    assert torch.equal(ids, hf_ids)  # both sorted by the biased probability
    torch.testing.assert_close(w, hf_w, rtol=1e-6, atol=1e-7)
    assert not torch.equal(ids, plain_ids)  # the bias moved some choices
    probs = torch.softmax(x @ hf.weight.t(), dim=-1).gather(1, ids)
    torch.testing.assert_close(w, probs / probs.sum(-1, keepdim=True))  # ... but weights are unbiased


def test_the_selection_bias_changes_the_tiny_models_choices(family_model: Callable[[str, str], Path]) -> None:
    model, config = load_model(family_model("ernie4_5_moe", "hf"))
    tokens = random_tokens(40, config.vocab_size, seed=8)
    moes = [layer.moe for layer in model._layers if layer.moe is not None]  # type: ignore[attr-defined]
    assert len(moes) == 2 and all(m.selection_bias is not None for m in moes)
    base = PagedRun(model).step({0: tokens})[0]
    x = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(9))
    chosen = moes[0].route(x)[0]
    saved = [m.selection_bias for m in moes]
    for m in moes:
        m.selection_bias = None
    try:
        assert not torch.equal(moes[0].route(x)[0], chosen)
        assert not torch.allclose(PagedRun(model).step({0: tokens})[0], base, atol=1e-3)
    finally:
        for m, b in zip(moes, saved):
            m.selection_bias = b


def test_the_mtp_head_is_skipped(family_model: Callable[[str, str], Path], tmp_path: Path) -> None:
    hf_dir = family_model("ernie4_5_moe", "hf")
    out = tmp_path / "with-mtp"
    shutil.copytree(hf_dir, out)
    state = load_file(str(hf_dir / "model.safetensors"))
    H = int(state["model.norm.weight"].shape[0])
    mtp = {"model.mtp_block.0.input_layernorm.weight": torch.ones(H), "model.mtp_emb_norm.0.weight": torch.ones(H),
           "model.mtp_linear_proj.0.weight": torch.zeros(H, 2 * H)}
    save_file({**state, **mtp}, str(out / "model.safetensors"), metadata={"format": "pt"})
    plain, config = load_model(hf_dir)
    with_mtp, _ = load_model(out)
    tokens = random_tokens(30, config.vocab_size, seed=3)
    assert torch.equal(PagedRun(with_mtp).step({0: tokens})[0], PagedRun(plain).step({0: tokens})[0])


def test_config_translation_and_errors() -> None:
    c = config_from_hf(_raw(moe_layer_interval=2))
    assert c.layer_mlp_kinds == ("dense", "sparse", "dense", "sparse")
    assert (c.moe_router, c.moe_selection_bias, c.norm_topk_prob, c.moe_router_fp32) == ("softmax_topk", True, True,
                                                                                         True)
    assert c.shared_expert_intermediate_size == 64 and not c.shared_expert_gated and c.rope_interleaved_checkpoint
    assert config_from_hf(_raw(moe_layer_end_index=2)).layer_mlp_kinds == ("dense", "sparse", "sparse", "dense")
    bad = [({"use_bias": True}, UnsupportedModelError, "use_bias"),
           ({"moe_k": 17}, ModelLoadError, "moe_k"),
           ({"moe_layer_start_index": 9}, ModelLoadError, "moe_layer_start_index"),
           ({"moe_layer_end_index": "x"}, ModelLoadError, "moe_layer_end_index"),
           ({"moe_norm_min": 0.0}, ModelLoadError, "moe_norm_min"),
           ({"moe_num_shared_experts": -1}, ModelLoadError, "moe_num_shared_experts")]
    for extra, error, key in bad:
        with pytest.raises(error, match=key):
            config_from_hf(_raw(**extra))
