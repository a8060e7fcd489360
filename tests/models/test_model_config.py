"""ModelConfig parses transformers-4 and transformers-5 config.json layouts into the same fields."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from server.models.config import ModelConfig, ModelLoadError, RopeScaling, UnsupportedModelError
from server.models.registry import config_from_hf
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
    return config_from_hf({**_LLAMA, **fields})


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
        config_from_hf(raw, source="/x/config.json")
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
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
         "beta_fast": 16, "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.5},
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


def test_longrope_partial_rotary_tables_equal_transformers() -> None:
    """Phi-3's longrope: short factors while the sequence is within original_max_position_embeddings,
    long beyond, both scaled by the attention factor; over the leading rotary dims only."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.2, 1.4, 1.6], "long_factor": [2.0, 3.0, 4.0, 5.0],
            "original_max_position_embeddings": 64}
    shape = {k: v for k, v in _LLAMA.items() if k not in ("architectures", "model_type")}
    hf_cfg = Phi3Config(**{**shape, "max_position_embeddings": 256, "pad_token_id": 0}, rope_parameters=rope)
    ours_cfg = config_from_hf({**_LLAMA, "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 256,
                               "rope_parameters": rope})
    spec = ours_cfg.ropes[0]
    assert spec.rotary_dim == 8
    ours = RotaryEmbedding(spec.rotary_dim, 256, spec.theta, spec.scaling)
    hf = Phi3RotaryEmbedding(hf_cfg)
    for seq_len in (40, 64, 65, 200):  # transformers picks the table by the forward's longest sequence
        positions = torch.arange(seq_len)
        cos_hf, sin_hf = hf(torch.zeros(1, dtype=torch.float32), positions[None])
        batch = ours.prepare(positions, torch.float32, torch.full((seq_len,), seq_len))
        cos, sin = ours.lookup(batch.positions, torch.float32)
        assert torch.equal(torch.cat([cos, cos], -1)[:, 0], cos_hf[0]), seq_len
        assert torch.equal(torch.cat([sin, sin], -1)[:, 0], sin_hf[0]), seq_len


def test_registry_names_translations_and_kv_specs() -> None:
    from server.models.registry import architectures, by_gguf_name, by_hf_name, kv_specs

    for arch in architectures():
        assert all(by_hf_name(n) is arch for n in arch.hf_names)
        assert all(by_gguf_name(n) is arch for n in arch.gguf_names)
    gemma3 = config_from_hf({**_LLAMA, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6,
                             "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 8,
                             "query_pre_attn_scalar": 64, "rope_theta": 1e6, "rope_local_base_freq": 1e4})
    assert [s.sliding_window for s in kv_specs(gemma3)] == [8, 8, 8, 8, 8, None]
    assert [gemma3.ropes[r].theta for r in gemma3.layer_ropes if r is not None] == [1e4] * 5 + [1e6]
    assert gemma3.attention_scale == 64**-0.5 and gemma3.norm_placement == "both"
    smol = config_from_hf({**_LLAMA, "architectures": ["SmolLM3ForCausalLM"], "num_hidden_layers": 8})
    assert smol.layer_ropes == (0, 0, 0, None, 0, 0, 0, None)
    with pytest.raises(UnsupportedModelError, match="hidden_act 'silu'.*gelu_pytorch_tanh"):
        config_from_hf({**_LLAMA, "architectures": ["Gemma2ForCausalLM"]})


def test_gemma4_refuses_its_mixture_of_experts_variant_naming_the_field() -> None:
    raw = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "enable_moe_block": True,
           "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
           "vocab_size": 128}
    with pytest.raises(UnsupportedModelError, match="enable_moe_block"):
        config_from_hf(raw, "config.json")
    text = {k: v for k, v in raw.items() if k not in ("architectures", "enable_moe_block")}
    wrapped = config_from_hf({"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                              "text_config": {**text, "head_dim": 16, "global_head_dim": 32}})
    assert wrapped.layer_head_dims == (16, 32) and wrapped.layer_sliding_windows == (512, None)
