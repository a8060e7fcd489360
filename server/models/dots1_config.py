"""dots.llm1 (transformers' Dots1ForCausalLM, llama.cpp's `dots1`): config.json and GGUF metadata ->
ModelConfig. Torch-free.

A Qwen3-style decoder (per-head q/k RMSNorm, attention_bias on all four projections, windows from
layer_types) whose first `first_k_dense_replace` layers have a dense MLP and the rest a
DeepSeek-V3-style mixture of experts: a sigmoid router whose e_score_correction_bias chooses the
experts but does not weight them, optional group-limited choice (n_group / topk_group),
renormalisation (norm_topk_prob) and routed_scaling_factor (server.models.moe_router), computed
in float32 from a float32 router weight in every dtype (Dots1TopkRouter's), plus
`n_shared_experts` x moe_intermediate_size of ungated shared experts (`mlp.shared_experts.*`).
"""
from __future__ import annotations

from typing import Any

from server.models.config import ModelConfig, ModelLoadError
from server.models.gguf_config import gguf_base
from server.models.gguf_file import GGUFFile
from server.models.hf_config import HFFields, hf_base, windows
from server.models.moe_router_config import gguf_router, hf_router


def dots1_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    base = hf_base(raw, source, name)
    p, n = HFFields(raw, source), base["num_layers"]
    experts = p.positive_int("n_routed_experts", None) or p.positive_int("num_local_experts")
    top_k = p.positive_int("num_experts_per_tok")
    if top_k > experts:
        raise ModelLoadError(f"{source}: field 'num_experts_per_tok' must be at most the {experts} experts")
    dense = raw.get("first_k_dense_replace") or 0
    if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense <= n:
        raise ModelLoadError(f"{source}: field 'first_k_dense_replace' must be an integer in [0, {n}], got {dense!r}")
    moe_size = p.positive_int("moe_intermediate_size")
    shared = raw.get("n_shared_experts") or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ModelLoadError(f"{source}: field 'n_shared_experts' must be a non-negative integer, got {shared!r}")
    # transformers' default layer_types: layers from max_window_layers on slide (when there is a window).
    first = raw.get("max_window_layers", n)
    parts: dict[str, Any] = dict(
        windows(p, n, p.window(), [i >= first for i in range(n)]),
        **_moe_parts(n, dense, experts, top_k, moe_size, shared * moe_size, bool(raw.get("norm_topk_prob", False))),
        # transformers' Dots1TopkRouter: always sigmoid scores and the correction bias (its config
        # has no scoring_func; a real config.json's "noaux_tc" there means the same).
        **hf_router(raw, source, experts, top_k, "sigmoid", selection_bias=True),
    )
    return ModelConfig(**{**base, **parts})


def dots1_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    """llama.cpp's `dots1` keys: `leading_dense_block_count`, `expert_count`, `expert_used_count`,
    `expert_feed_forward_length`, `expert_shared_count`, `expert_weights_norm`,
    `expert_weights_scale`, `expert_gating_func` (2: sigmoid, its converter's only value); the
    selection bias is the `exp_probs_b.bias` tensor. llama.cpp runs dots1 without a window."""
    base = gguf_base(f, arch, "Dots1ForCausalLM")
    k, n = arch + ".", base["num_layers"]
    experts, top_k = f.get_int(k + "expert_count"), f.get_int(k + "expert_used_count")
    if top_k > experts:
        raise ModelLoadError(f"{f.path}: metadata key {k + 'expert_used_count'!r} must be at most the "
                             f"{experts} experts")
    dense = f.get_int(k + "leading_dense_block_count", 0, positive=False)
    if dense > n:
        raise ModelLoadError(f"{f.path}: metadata key {k + 'leading_dense_block_count'!r} must be at most {n}")
    moe_size = f.get_int(k + "expert_feed_forward_length")
    shared = f.get_int(k + "expert_shared_count", 0, positive=False)
    parts = dict(_moe_parts(n, dense, experts, top_k, moe_size, shared * moe_size,
                            f.get_bool(k + "expert_weights_norm", False)),
                 **gguf_router(f, arch, experts, top_k, 2))
    return ModelConfig(**{**base, **parts})


def _moe_parts(n: int, dense: int, experts: int, top_k: int, moe_size: int, shared_size: int,
               norm: bool) -> dict[str, Any]:
    return dict(qk_norm=True, layer_mlp_kinds=tuple("dense" if i < dense else "sparse" for i in range(n)),
                num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_size,
                shared_expert_intermediate_size=shared_size, shared_expert_gated=False, norm_topk_prob=norm,
                moe_checkpoint="deepseek", moe_router_fp32=True)
