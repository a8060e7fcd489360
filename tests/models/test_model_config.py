"""ModelConfig parses transformers-4 and transformers-5 config.json layouts into the same fields."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from server.models.config import ModelConfig, ModelLoadError, RopeScaling, UnsupportedModelError
from server.models.rope import RotaryEmbedding, rope_inv_freq

_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
    "max_position_embeddings": 256,
}
_LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _cfg(**fields: Any) -> ModelConfig:
    return ModelConfig.from_dict({**_LLAMA, **fields})


def test_v4_and_v5_llama3_rope_layouts_parse_the_same() -> None:
    v4 = _cfg(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **_LLAMA3}, torch_dtype="bfloat16")
    v5 = _cfg(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **_LLAMA3}, dtype="bfloat16")
    assert v4 == v5
    assert v5.rope_theta == 500000.0 and v5.torch_dtype == "bfloat16"
    assert v5.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


def test_rope_defaults_and_old_type_key() -> None:
    plain = _cfg()
    assert plain.rope_theta == 10000.0 and plain.rope_scaling is None and plain.torch_dtype == "float32"
    assert _cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e6}).rope_scaling is None
    assert _cfg(rope_scaling={"type": "linear", "factor": 2.0}).rope_scaling == RopeScaling("linear", 2.0)


def test_unsupported_rope_type_names_it() -> None:
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        _cfg(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0})


def test_head_dim_explicit_wins_over_hidden_over_heads() -> None:
    assert _cfg().head_dim == 16
    assert _cfg(head_dim=32).head_dim == 32
    assert _cfg(head_dim=None).head_dim == 16


def test_architecture_switches() -> None:
    qwen2 = _cfg(architectures=["Qwen2ForCausalLM"], sliding_window=32, use_sliding_window=False)
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm, qwen2.sliding_window) == (True, False, False, None)
    qwen3 = _cfg(architectures=["Qwen3ForCausalLM"], attention_bias=False)
    assert (qwen3.qkv_bias, qwen3.qk_norm) == (False, True)
    mistral = _cfg(architectures=["MistralForCausalLM"], sliding_window=24)
    assert mistral.layer_sliding_windows == (24, 24)
    assert _cfg(architectures=["MistralForCausalLM"], sliding_window=None).layer_sliding_windows == (None, None)
    llama_bias = _cfg(attention_bias=True, mlp_bias=True)
    assert (llama_bias.qkv_bias, llama_bias.o_bias, llama_bias.mlp_bias) == (True, True, True)


def test_qwen_sliding_window_only_when_enabled_and_above_max_window_layers() -> None:
    on = dict(architectures=["Qwen2ForCausalLM"], sliding_window=32, use_sliding_window=True, max_window_layers=1)
    assert _cfg(**on).layer_sliding_windows == (None, 32)
    listed = _cfg(**on, layer_types=["sliding_attention", "full_attention"])
    assert listed.layer_sliding_windows == (32, None)


def test_token_ids_and_missing_fields() -> None:
    cfg = _cfg(bos_token_id=1, eos_token_id=[2, 7])
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2, 7)
    assert _cfg(eos_token_id=5).eos_token_ids == (5,)
    raw = dict(_LLAMA)
    del raw["vocab_size"]
    with pytest.raises(ModelLoadError, match="vocab_size"):
        ModelConfig.from_dict(raw, source="/x/config.json")
    with pytest.raises(ModelLoadError, match="hidden_size"):
        _cfg(hidden_size="64")


def test_unsupported_architecture_and_activation() -> None:
    with pytest.raises(UnsupportedModelError, match="Qwen3ForCausalLM"):
        _cfg(architectures=["PhiForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        _cfg(hidden_act="gelu")


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, **_LLAMA3, "original_max_position_embeddings": 64},
    ],
)
def test_rope_tables_equal_transformers_rotary_embedding(rope: dict[str, Any]) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    shape = {k: v for k, v in _LLAMA.items() if k not in ("architectures", "model_type")}
    hf_cfg = LlamaConfig(**shape, rope_parameters=rope)
    ours_cfg = _cfg(rope_parameters=rope)
    hf = LlamaRotaryEmbedding(hf_cfg)
    assert torch.equal(rope_inv_freq(16, ours_cfg.rope_theta, ours_cfg.rope_scaling), hf.inv_freq)
    positions = torch.arange(256)
    cos_hf, sin_hf = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = RotaryEmbedding(16, 256, ours_cfg.rope_theta, ours_cfg.rope_scaling)
    cos, sin = ours.lookup(positions, torch.float32)
    assert torch.equal(torch.cat([cos, cos], -1)[:, 0], cos_hf[0])
    assert torch.equal(torch.cat([sin, sin], -1)[:, 0], sin_hf[0])
