"""GLM-4.5 beyond what every family is checked for (tests/families/test_family_*.py run its tiny
folder -- sigmoid router with a selection bias, 4 expert groups of which 2 are kept, top-3,
renormalised and scaled, a dense first layer, an ungated shared expert, q/k/v biases, half-rotary
heads with per-head q/k norm -- and its F32 GGUF copy against transformers): without q/k norm its
layers run fused (decode_layer, then moe_decode) and still give transformers' greedy tokens; the
checkpoints' multi-token-prediction layers past the last one (HF `model.layers.N.*`, GGUF
`blk.N.*` with `nextn_predict_layers`) are skipped; the GGUF copy's router means the same; and a
config without partial_rotary_factor takes transformers' default of half the head."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from server import LLM, SamplingParams
from server.models.loader import load_model
from server.models.registry import config_from_hf, read_model_config
from tests.families.test_families_vs_transformers import hf_greedy
from tests.gguf_files import write_gguf
from tests.models.paged_harness import PagedRun, random_tokens


@pytest.mark.slow
def test_without_qk_norm_layers_run_fused_and_match_transformers(tiny_model: Callable[..., Path]) -> None:
    hf_dir = tiny_model("glm4_moe", use_qk_norm=False)
    model, _ = load_model(hf_dir)
    assert all(layer.fusable for layer in model._layers)  # type: ignore[attr-defined]
    rng = random.Random(12)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(20, 60))] for _ in range(3)]
    llm = LLM(str(hf_dir), max_model_len=256, kv_cache_tokens=4096)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_dir, p, 12) for p in prompts]


def test_mtp_layers_are_skipped(family_model: Callable[[str, str], Path], tmp_path: Path) -> None:
    """A folder whose checkpoint holds an MTP layer (model.layers.3.*: a decoder layer plus its
    eh_proj / enorm / hnorm / shared_head) and its GGUF copy (blk.3.*, block_count 4,
    nextn_predict_layers 1) load as the 3-layer model, with the same logits."""
    hf_dir = family_model("glm4_moe", "hf")
    out = tmp_path / "with-mtp"
    shutil.copytree(hf_dir, out)
    state = load_file(str(hf_dir / "model.safetensors"))
    layer3 = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in state.items()
              if k.startswith("model.layers.2.")}
    H = int(state["model.norm.weight"].shape[0])
    mtp = dict(layer3)
    mtp.update({"model.layers.3.eh_proj.weight": torch.zeros(H, 2 * H), "model.layers.3.enorm.weight": torch.ones(H),
                "model.layers.3.hnorm.weight": torch.ones(H),
                "model.layers.3.shared_head.norm.weight": torch.ones(H)})
    save_file({**state, **mtp}, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    plain, config = load_model(hf_dir)
    tokens = random_tokens(30, config.vocab_size, seed=3)
    want = PagedRun(plain).step({0: tokens})[0]
    with_mtp, c = load_model(out)
    assert c.num_layers == 3 and c.checkpoint_extra_layers == 1
    assert torch.equal(PagedRun(with_mtp).step({0: tokens})[0], want)
    # The GGUF copy of that folder: its blk.3.* tensors (a decoder layer's, as the converter writes them).
    gguf_src = tmp_path / "gguf-src"
    shutil.copytree(hf_dir, gguf_src)
    save_file({**state, **layer3}, str(gguf_src / "model.safetensors"), metadata={"format": "pt"})
    path = write_gguf(tmp_path / "glm.gguf", gguf_src, "F32")
    g_model, g_config = load_model(path)
    assert g_config.num_layers == 3 and g_config.checkpoint_extra_layers == 1
    assert torch.equal(PagedRun(g_model).step({0: tokens})[0], want)


def test_gguf_router_and_attention_keys(family_model: Callable[[str, str], Path]) -> None:
    hf, gg = read_model_config(family_model("glm4_moe", "hf")), read_model_config(family_model("glm4_moe", "gguf"))
    for field in ("moe_router", "moe_selection_bias", "moe_n_group", "moe_topk_group", "moe_routed_scaling",
                  "norm_topk_prob", "num_experts", "num_experts_per_tok", "layer_mlp_kinds", "num_layers",
                  "shared_expert_intermediate_size", "shared_expert_gated", "moe_checkpoint", "moe_router_fp32",
                  "qkv_bias", "o_bias", "qk_norm", "checkpoint_extra_layers"):
        assert getattr(gg, field) == getattr(hf, field), field
    assert hf.ropes[0].rotary_dim == hf.head_dim // 2 and gg.ropes[0].rotary_dim == hf.head_dim // 2
    assert hf.qkv_bias and not hf.o_bias and hf.qk_norm and hf.moe_topk_group == 2


def test_partial_rotary_factor_defaults_to_half() -> None:
    raw = {"architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96,
           "vocab_size": 100, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
           "n_shared_experts": 1, "first_k_dense_replace": 1, "rope_theta": 10000.0}
    c = config_from_hf(raw)
    assert c.ropes[0].rotary_dim == 16 and c.norm_topk_prob and c.checkpoint_extra_layers == 0
    assert config_from_hf({**raw, "partial_rotary_factor": 1.0}).ropes[0].rotary_dim == 32
