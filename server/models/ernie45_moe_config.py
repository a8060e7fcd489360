"""ERNIE 4.5 MoE (transformers' Ernie4_5_MoeForCausalLM, llama.cpp's `ernie4_5-moe`): config.json and
GGUF metadata -> ModelConfig. Torch-free.

A Llama-style GQA decoder whose RoPE rotates interleaved pairs (GPT-J style: the HF checkpoint's
q/k rows are reordered at load into rotate-half's layout, ModelConfig.rope_interleaved_checkpoint;
llama.cpp's files hold the same rows, undone as for its permuted architectures). Layers
`moe_layer_start_index` .. `moe_layer_end_index`, every `moe_layer_interval`-th, are sparse: a
softmax router computed in float32 from a float32 weight, whose `moe_statics.e_score_correction_bias`
is added to the probabilities to choose the `moe_k` experts but not to weight them, the weights
always renormalised (divided by max(sum, moe_norm_min): the sum of k softmax probabilities never
comes near 1e-12); plus `moe_num_shared_experts` x moe_intermediate_size of ungated shared experts.
The checkpoints' multi-token-prediction head (`model.mtp*`, which transformers ignores) is skipped.
"""
from __future__ import annotations

from typing import Any

from server.models.config import ModelConfig, ModelLoadError, UnsupportedModelError
from server.models.gguf_config import gguf_base
from server.models.gguf_file import GGUFFile
from server.models.hf_config import HFFields, hf_base


def ernie45_moe_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    if raw.get("use_bias"):
        raise UnsupportedModelError(f"{source}: use_bias is not supported (biases on every projection and lm_head)")
    base = hf_base(raw, source, name)
    p, n = HFFields(raw, source), base["num_layers"]
    experts = p.positive_int("moe_num_experts", None) or p.positive_int("num_experts")
    top_k = p.positive_int("moe_k", None) or p.positive_int("num_experts_per_tok")
    if top_k > experts:
        raise ModelLoadError(f"{source}: field 'moe_k' must be at most the {experts} experts")
    start = _index(raw, source, "moe_layer_start_index", 1, n)
    end = _index(raw, source, "moe_layer_end_index", -1, n)
    end = n - 1 if end == -1 else end
    interval = p.positive_int("moe_layer_interval", 1)
    norm_min = p.number("moe_norm_min", 1e-12)
    if not norm_min > 0:
        raise ModelLoadError(f"{source}: field 'moe_norm_min' must be a positive number, got {norm_min!r}")
    moe_size = p.positive_int("moe_intermediate_size")
    shared = raw.get("moe_num_shared_experts") or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ModelLoadError(f"{source}: field 'moe_num_shared_experts' must be a non-negative integer, got {shared!r}")
    kinds = tuple("sparse" if (i + 1) % interval == 0 and start <= i <= end else "dense" for i in range(n))
    parts = dict(_parts(kinds, experts, top_k, moe_size, shared * moe_size), rope_interleaved_checkpoint=True,
                 checkpoint_skipped_prefixes=("model.mtp",))
    return ModelConfig(**{**base, **parts})


def ernie45_moe_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    """llama.cpp's keys: `expert_count`, `expert_used_count`, `expert_shared_count`,
    `expert_feed_forward_length`; a layer is sparse when it has `ffn_gate_inp` (llama.cpp's
    `leading_dense_block_count` / `interleave_moe_layer_step` say the same); the bias is the
    `exp_probs_b.bias` tensor."""
    base = gguf_base(f, arch, "Ernie4_5_MoeForCausalLM")
    k, n = arch + ".", base["num_layers"]
    experts, top_k = f.get_int(k + "expert_count"), f.get_int(k + "expert_used_count")
    if top_k > experts:
        raise ModelLoadError(f"{f.path}: metadata key {k + 'expert_used_count'!r} must be at most the "
                             f"{experts} experts")
    kinds = tuple("sparse" if f"blk.{i}.ffn_gate_inp.weight" in f.tensors else "dense" for i in range(n))
    moe_size = f.get_int(k + "expert_feed_forward_length")
    shared = f.get_int(k + "expert_shared_count", 0, positive=False)
    return ModelConfig(**{**base, **_parts(kinds, experts, top_k, moe_size, shared * moe_size)})


def _parts(kinds: tuple[str, ...], experts: int, top_k: int, moe_size: int, shared_size: int) -> dict[str, Any]:
    return dict(layer_mlp_kinds=kinds, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_size,
                shared_expert_intermediate_size=shared_size, shared_expert_gated=False, norm_topk_prob=True,
                moe_router="softmax_topk", moe_selection_bias=True, moe_router_fp32=True, moe_checkpoint="ernie")


def _index(raw: dict[str, Any], source: str, key: str, default: int, n: int) -> int:
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not (v == -1 or 0 <= v < n):
        raise ModelLoadError(f"{source}: field {key!r} must be a layer index in [0, {n}) or -1, got {v!r}")
    return v
