"""The Qwen3-Next / Qwen3.5 / Qwen3.5-MoE HF translation (server/models/qwen3_next_config.py):
layer kinds, the DeltaNet sizes and their state specs, the MoE rules, and bad fields named."""
from __future__ import annotations

from typing import Any

import pytest

from server.models.config import ModelLoadError
from server.models.registry import config_from_hf
from server.models.state_specs import attention_layers, state_slot_bytes, state_specs

_BASE: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 96, "vocab_size": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}


def test_qwen3_5_layers_state_and_rope() -> None:
    c = config_from_hf({**_BASE, "architectures": ["Qwen3_5ForCausalLM"]}, "config.json")
    # transformers' default pattern: every 4th layer is full attention
    assert c.layer_types == ("gated_deltanet",) * 3 + ("attention",)
    assert attention_layers(c) == (3,)
    conv_dim = 2 * 2 * 16 + 4 * 8
    assert [tuple((s.name, s.shape, s.dtype) for s in layer) for layer in state_specs(c)][0] == (
        ("conv", (3, conv_dim), "model"), ("recurrent", (4, 16, 8), "float32"))
    assert state_slot_bytes(c, "float32") == 3 * (3 * conv_dim * 4 + 4 * 16 * 8 * 4)
    assert c.ropes[0].rotary_dim == 8 and c.norm_weight_offset == 1.0 and c.attn_output_gate and c.qk_norm
    assert c.gdn_checkpoint == "split" and not c.is_moe


def test_qwen3_next_and_qwen3_5_moe_experts() -> None:
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
           "shared_expert_intermediate_size": 24}
    nxt = config_from_hf({**_BASE, **moe, "architectures": ["Qwen3NextForCausalLM"], "mlp_only_layers": [1],
                          "norm_topk_prob": False}, "config.json")
    assert nxt.layer_mlp_kinds == ("sparse", "dense", "sparse", "sparse") and not nxt.norm_topk_prob
    assert nxt.gdn_checkpoint == "qkvz" and nxt.shared_expert_intermediate_size == 24
    raw35 = {k: v for k, v in {**_BASE, **moe}.items() if k != "intermediate_size"}
    m35 = config_from_hf({**raw35, "architectures": ["Qwen3_5MoeForCausalLM"]}, "config.json")
    assert m35.layer_mlp_kinds == ("sparse",) * 4 and m35.norm_topk_prob


@pytest.mark.parametrize("field,value,match", [
    ("layer_types", ["linear_attention"] * 3, "layer_types"),
    ("layer_types", ["conv"] * 4, "layer_types"),
    ("linear_num_value_heads", 3, "multiple of linear_num_key_heads"),
    ("linear_conv_kernel_dim", 1, "linear_conv_kernel_dim"),
    ("linear_key_head_dim", None, "linear_key_head_dim"),
])
def test_bad_fields_are_named(field: str, value: Any, match: str) -> None:
    raw = {**_BASE, "architectures": ["Qwen3_5ForCausalLM"], field: value}
    if value is None:
        del raw[field]
    with pytest.raises(ModelLoadError, match=match):
        config_from_hf(raw, "config.json")
