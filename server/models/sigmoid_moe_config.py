"""The DeepSeek-V3-style mixture-of-experts families without MLA attention: dots.llm1
(transformers' Dots1ForCausalLM, llama.cpp's `dots1`) and GLM-4.5 / GLM-4.5-Air
(Glm4MoeForCausalLM, `glm4moe`). config.json and GGUF metadata -> ModelConfig. Torch-free.

Both are standard GQA decoders whose first `first_k_dense_replace` layers have a dense MLP and the
rest a mixture of experts: a sigmoid router computed in float32 from a float32 weight in every
dtype, whose e_score_correction_bias chooses the experts but does not weight them, optional
group-limited choice (n_group / topk_group), renormalisation (norm_topk_prob) and
routed_scaling_factor (server.models.moe_router), plus `n_shared_experts` x moe_intermediate_size
of ungated shared experts (`mlp.shared_experts.*`). They differ in attention:
  - dots.llm1: Qwen3's (per-head q/k RMSNorm, attention_bias on all four projections, windows
    from layer_types; llama.cpp runs it without a window);
  - GLM-4.5: q/k/v biases (attention_bias) and none on o_proj, partial rotary (half the head by
    default), per-head q/k norm only with use_qk_norm; its checkpoints add
    `num_nextn_predict_layers` multi-token-prediction layers past the last one, which transformers
    and llama.cpp do not run for generation: skipped at load (checkpoint_extra_layers).
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
    # transformers' default layer_types: layers from max_window_layers on slide (when there is a window).
    first = raw.get("max_window_layers", n)
    parts = dict(windows(p, n, p.window(), [i >= first for i in range(n)]), qk_norm=True,
                 **_hf_moe(raw, source, n, default_norm=False))
    return ModelConfig(**{**base, **parts})


def glm4_moe_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    params = raw.get("rope_parameters")
    if "partial_rotary_factor" not in raw and not (isinstance(params, dict) and "partial_rotary_factor" in params):
        raw = {**raw, "partial_rotary_factor": 0.5}  # Glm4MoeConfig's default
    base = hf_base(raw, source, name)
    n = base["num_layers"]
    extra = raw.get("num_nextn_predict_layers") or 0
    if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0:
        raise ModelLoadError(f"{source}: field 'num_nextn_predict_layers' must be a non-negative integer, "
                             f"got {extra!r}")
    parts = dict(o_bias=False, qk_norm=bool(raw.get("use_qk_norm", False)), checkpoint_extra_layers=extra,
                 **_hf_moe(raw, source, n, default_norm=True))
    return ModelConfig(**{**base, **parts})


def dots1_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    """llama.cpp's `dots1` keys (_gguf_moe); it runs dots1 without a window."""
    base = gguf_base(f, arch, "Dots1ForCausalLM")
    return ModelConfig(**{**base, "qk_norm": True, **_gguf_moe(f, arch, base["num_layers"], False)})


def glm4_moe_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    """llama.cpp's `glm4moe`: `block_count` counts the `nextn_predict_layers` MTP layers at the end
    (skipped); `rope.dimension_count` the rotary part; attn_q/k/v biases; q/k norm tensors when the
    model has them (use_qk_norm)."""
    base = gguf_base(f, arch, "Glm4MoeForCausalLM")
    k = arch + "."
    extra = f.get_int(k + "nextn_predict_layers", 0, positive=False)
    n = base["num_layers"] - extra
    if n <= 0:
        raise ModelLoadError(f"{f.path}: metadata key {k + 'nextn_predict_layers'!r} ({extra}) must be below "
                             f"{k + 'block_count'!r} ({base['num_layers']})")
    base.update(num_layers=n, layer_sliding_windows=base["layer_sliding_windows"][:n],
                layer_ropes=base["layer_ropes"][:n])
    parts = dict(o_bias=False, qk_norm="blk.0.attn_q_norm.weight" in f.tensors, checkpoint_extra_layers=extra,
                 **_gguf_moe(f, arch, n, True))
    return ModelConfig(**{**base, **parts})


def _hf_moe(raw: dict[str, Any], source: str, n: int, default_norm: bool) -> dict[str, Any]:
    p = HFFields(raw, source)
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
    return dict(
        **_moe_parts(n, dense, experts, top_k, moe_size, shared * moe_size,
                     bool(raw.get("norm_topk_prob", default_norm))),
        # transformers' routers for these families: always sigmoid scores and the correction bias
        # (their configs have no scoring_func; a real dots.llm1 config.json's "noaux_tc" means the same).
        **hf_router(raw, source, experts, top_k, "sigmoid", selection_bias=True),
    )


def _gguf_moe(f: GGUFFile, arch: str, n: int, default_norm: bool) -> dict[str, Any]:
    """llama.cpp's keys: `leading_dense_block_count`, `expert_count`, `expert_used_count`,
    `expert_feed_forward_length`, `expert_shared_count`, `expert_weights_norm`,
    `expert_weights_scale`, `expert_gating_func` (2: sigmoid, what its converters write); the
    selection bias is the `exp_probs_b.bias` tensor."""
    k = arch + "."
    experts, top_k = f.get_int(k + "expert_count"), f.get_int(k + "expert_used_count")
    if top_k > experts:
        raise ModelLoadError(f"{f.path}: metadata key {k + 'expert_used_count'!r} must be at most the "
                             f"{experts} experts")
    dense = f.get_int(k + "leading_dense_block_count", 0, positive=False)
    if dense > n:
        raise ModelLoadError(f"{f.path}: metadata key {k + 'leading_dense_block_count'!r} must be at most {n}")
    moe_size = f.get_int(k + "expert_feed_forward_length")
    shared = f.get_int(k + "expert_shared_count", 0, positive=False)
    return dict(_moe_parts(n, dense, experts, top_k, moe_size, shared * moe_size,
                           f.get_bool(k + "expert_weights_norm", default_norm)),
                **gguf_router(f, arch, experts, top_k, 2))


def _moe_parts(n: int, dense: int, experts: int, top_k: int, moe_size: int, shared_size: int,
               norm: bool) -> dict[str, Any]:
    return dict(layer_mlp_kinds=tuple("dense" if i < dense else "sparse" for i in range(n)),
                num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_size,
                shared_expert_intermediate_size=shared_size, shared_expert_gated=False, norm_topk_prob=norm,
                moe_checkpoint="deepseek", moe_router_fp32=True)
