"""Qwen3.5 and Qwen3.5-MoE as released: Qwen3_5(Moe)ForConditionalGeneration folders (the language
model's config under text_config, its tensors under model.language_model., a vision tower beside
them), written by transformers itself, serve their language model: transformers' greedy tokens
from the text model holding the same weights, token for token; the vision tower is not loaded.
And a checkpoint's multi-token-prediction head (`mtp.*`) is skipped, as transformers skips it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from server import LLM
from server.models.loader import load_model
from tests.families.test_families_vs_transformers import _greedy, _prompts, _tokens, _vocab, hf_greedy

_WRAPPERS = {"qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
             "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration")}
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
               temporal_patch_size=2, spatial_merge_size=2)


def _multimodal_folder(hf_dir: Path, arch: str, out: Path) -> Path:
    """transformers' ForConditionalGeneration of hf_dir's text config and a tiny vision tower,
    its language model holding hf_dir's weights, saved with save_pretrained."""
    import transformers as tf

    config_name, model_name = _WRAPPERS[arch]
    text = json.loads((hf_dir / "config.json").read_text())
    config = getattr(tf, config_name)(text_config=text, vision_config=_VISION,
                                      tie_word_embeddings=text["tie_word_embeddings"])
    torch.manual_seed(0)
    model = getattr(tf, model_name)(config).eval()
    # The text model's parameters as transformers holds them in memory (Qwen3.5-MoE: experts fused).
    text_model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    state = {("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
             for k, v in text_model.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("model.visual.") for k in missing), (missing, unexpected)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (hf_dir / name).exists():
            shutil.copy(hf_dir / name, out / name)
    return out


@pytest.mark.parametrize("arch", list(_WRAPPERS))
def test_conditional_generation_folder_serves_its_language_model(
        tiny_model: Callable[..., Path], arch: str, tmp_path: Path) -> None:
    hf_dir = tiny_model(arch)
    out = _multimodal_folder(hf_dir, arch, tmp_path / f"{arch}-mm")
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == [_WRAPPERS[arch][1]] and "text_config" in saved
    model, config = load_model(out)
    plain, p_cfg = load_model(hf_dir)
    assert config.architecture == _WRAPPERS[arch][1]
    assert (config.layer_types, config.layer_mlp_kinds) == (p_cfg.layer_types, p_cfg.layer_mlp_kinds)
    pp = dict(plain.named_parameters())  # type: ignore[attr-defined]
    for name, p in model.named_parameters():  # type: ignore[attr-defined]
        assert torch.equal(p, pp[name]), name
    prompts = _prompts(3, _vocab(hf_dir), 20, 70, seed=31)
    llm = LLM(str(out), max_model_len=256, kv_cache_tokens=4096)
    assert _tokens(llm.generate(prompts, _greedy())) == [hf_greedy(hf_dir, p) for p in prompts]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_the_mtp_head_of_a_checkpoint_is_skipped(tiny_model: Callable[..., Path], arch: str, tmp_path: Path) -> None:
    """The released checkpoints carry a multi-token-prediction head (`mtp.*`, which transformers
    skips too): the folder loads the same parameters without it."""
    from safetensors.torch import load_file, save_file

    hf_dir = tiny_model(arch)
    out = tmp_path / arch
    shutil.copytree(hf_dir, out)
    state = load_file(str(hf_dir / "model.safetensors"))
    hidden = state["model.norm.weight"].shape[0]
    state.update({"mtp.fc.weight": torch.zeros(hidden, 2 * hidden), "mtp.norm.weight": torch.ones(hidden),
                  "mtp.layers.0.input_layernorm.weight": torch.ones(hidden)})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_model(out)
    plain, _ = load_model(hf_dir)
    pp = dict(plain.named_parameters())  # type: ignore[attr-defined]
    for name, p in model.named_parameters():  # type: ignore[attr-defined]
        assert torch.equal(p, pp[name]), name


def test_a_conditional_generation_config_without_text_config_is_refused_naming_it() -> None:
    from server.models import ModelLoadError
    from server.models.registry import config_from_hf

    with pytest.raises(ModelLoadError, match=r"config\.json: field 'text_config' must be an object"):
        config_from_hf({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"})
