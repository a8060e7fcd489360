"""The Hugging Face translation of Qwen3-Next, Qwen3.5 and Qwen3.5-MoE configs into ModelConfig
(the model is server/models/qwen3_next.py). Torch-free.

What these configs add to the Llama reading: `layer_types` of "linear_attention" (a Gated DeltaNet
layer, state kind "gated_deltanet") and "full_attention"; the DeltaNet's sizes (`linear_num_key_heads`,
`linear_num_value_heads`, `linear_key_head_dim`, `linear_value_head_dim`, `linear_conv_kernel_dim`);
per-head q/k norms and every norm scaling by 1 + w; partial rotary (`partial_rotary_factor`, read
with the rest of `rope_parameters`); the attention output gate (always on in these families); and
for the MoE variants the Qwen-MoE router with a sigmoid-gated shared expert.
"""
from __future__ import annotations

from typing import Any

from server.models.config import ModelConfig, ModelLoadError, UnsupportedModelError
from server.models.hf_config import HFFields, hf_base
from server.models.state_specs import GATED_DELTANET

# HF architecture -> how its checkpoint spells the DeltaNet in-projections (gated_deltanet.GDN_CHECKPOINTS)
QWEN3_NEXT_ARCHITECTURES = {"Qwen3NextForCausalLM": "qkvz", "Qwen3_5ForCausalLM": "split",
                            "Qwen3_5MoeForCausalLM": "split"}


def qwen3_next_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    p = HFFields(raw, source)
    n = p.positive_int("num_hidden_layers")
    types = raw.get("layer_types")
    if types is None:  # transformers' default: every full_attention_interval-th layer is full attention
        interval = p.positive_int("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if (not isinstance(types, list) or len(types) != n
            or not all(t in ("linear_attention", "full_attention") for t in types)):
        raise ModelLoadError(f"{source}: field 'layer_types' must list {n} entries, each 'linear_attention' or "
                             "'full_attention'")
    rest = {k: v for k, v in raw.items() if k != "layer_types"}
    if "intermediate_size" not in raw:  # Qwen3.5-MoE has no dense MLP: its layers are all sparse
        rest["intermediate_size"] = raw.get("moe_intermediate_size")
    base = hf_base(rest, source, name)
    if base["qkv_bias"]:
        raise UnsupportedModelError(f"{source}: attention_bias is not supported for {name}")
    parts: dict[str, Any] = dict(
        qk_norm=True, norm_weight_offset=1.0, attn_output_gate=True,
        layer_types=tuple(GATED_DELTANET if t == "linear_attention" else "attention" for t in types),
        linear_num_key_heads=p.positive_int("linear_num_key_heads"),
        linear_num_value_heads=p.positive_int("linear_num_value_heads"),
        linear_key_head_dim=p.positive_int("linear_key_head_dim"),
        linear_value_head_dim=p.positive_int("linear_value_head_dim"),
        conv_kernel=p.positive_int("linear_conv_kernel_dim"),
        gdn_checkpoint=QWEN3_NEXT_ARCHITECTURES[name],
    )
    if parts["conv_kernel"] < 2:
        raise ModelLoadError(f"{source}: field 'linear_conv_kernel_dim' must be at least 2")
    if parts["linear_num_value_heads"] % parts["linear_num_key_heads"]:
        raise ModelLoadError(f"{source}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    experts = int(raw.get("num_experts") or 0)
    if experts:
        if name == "Qwen3_5MoeForCausalLM":  # every layer sparse, the router always renormalises
            kinds = ("sparse",) * n
            renorm = True
        else:  # Qwen3-Next: the Qwen-MoE rule (mlp_only_layers, decoder_sparse_step)
            step = p.positive_int("decoder_sparse_step", 1)
            dense = raw.get("mlp_only_layers") or []
            if not isinstance(dense, list):
                raise ModelLoadError(f"{source}: field 'mlp_only_layers' must list layer indices")
            kinds = tuple("sparse" if i not in dense and (i + 1) % step == 0 else "dense" for i in range(n))
            renorm = bool(raw.get("norm_topk_prob", True))
        top_k = p.positive_int("num_experts_per_tok")
        if top_k > experts:
            raise ModelLoadError(f"{source}: field 'num_experts_per_tok' must be at most the {experts} experts")
        parts.update(layer_mlp_kinds=kinds, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=renorm,
                     moe_intermediate_size=p.positive_int("moe_intermediate_size"),
                     shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0))
    return ModelConfig(**{**base, **parts})
