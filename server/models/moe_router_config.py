"""The MoE router's config keys -> ModelConfig fields (moe_router, moe_selection_bias, moe_n_group,
moe_topk_group, moe_routed_scaling; what they mean: server.models.moe_router). Torch-free.

transformers' keys: `scoring_func`, `topk_method`, `n_group`, `topk_group`, `routed_scaling_factor`
(norm_topk_prob is read by each family, whose defaults differ). llama.cpp's: `{arch}.expert_gating_func`,
`expert_weights_scale`, `expert_group_count`, `expert_group_used_count` and the `blk.N.exp_probs_b.bias`
tensor. Every error names the key.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from server.models.config import ModelLoadError, UnsupportedModelError
from server.models.gguf_file import GGUFFile

# transformers' scoring_func spellings -> moe_router. dots.llm1's config.json writes "noaux_tc"
# (DeepSeek-V3's topk_method name) there, which llama.cpp's converter also reads as sigmoid.
_SCORING = {"softmax": "softmax_topk", "sigmoid": "sigmoid_topk", "noaux_tc": "sigmoid_topk"}
_TOPK_METHODS = ("greedy", "noaux_tc")
# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 1 softmax, 2 sigmoid.
_GATING_FUNCS = {1: "softmax_topk", 2: "sigmoid_topk"}


def hf_router(raw: dict[str, Any], source: str, experts: int, top_k: int, scoring: str,
              selection_bias: bool) -> dict[str, Any]:
    """ModelConfig's router fields from a config.json, for a family whose transformers router
    scores by `scoring` ("softmax" or "sigmoid") with (`selection_bias`) or without a correction
    bias: `n_group` / `topk_group`, `routed_scaling_factor`; `scoring_func` and `topk_method`, where
    a config has them, must say what that router does (transformers' DeepseekV3-style routers do
    not read them: a config that asks for another router is refused, naming the key)."""
    given = raw.get("scoring_func")
    if given is not None and given not in _SCORING:
        raise ModelLoadError(f"{source}: field 'scoring_func' must be 'softmax' or 'sigmoid', got {given!r}")
    if given is not None and _SCORING[given] != _SCORING[scoring]:
        raise UnsupportedModelError(f"{source}: field 'scoring_func' is {given!r}, but this family's router "
                                    f"scores by {scoring}")
    method = raw.get("topk_method")
    if method == "group_limited_greedy":  # DeepSeek-V2: groups scored by their best softmax score
        raise UnsupportedModelError(f"{source}: topk_method 'group_limited_greedy' is not supported "
                                    "(only 'greedy' and 'noaux_tc')")
    if method is not None and method not in _TOPK_METHODS:
        raise ModelLoadError(f"{source}: field 'topk_method' must be 'greedy' or 'noaux_tc', got {method!r}")
    n_group, topk_group = _int_field(raw, source, "n_group"), _int_field(raw, source, "topk_group")
    scaling = raw.get("routed_scaling_factor")
    scaling = 1.0 if scaling is None else scaling
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling) or scaling <= 0:
        raise ModelLoadError(f"{source}: field 'routed_scaling_factor' must be a positive number, got {scaling!r}")
    if method == "greedy" and n_group > 1:  # "greedy" (no groups, no bias) contradicts a group limit
        raise ModelLoadError(f"{source}: field 'topk_method' is 'greedy' (no expert groups), but n_group is {n_group}")
    if method == "greedy" and selection_bias:
        raise UnsupportedModelError(f"{source}: field 'topk_method' is 'greedy', but this family's router "
                                    "chooses with e_score_correction_bias ('noaux_tc')")
    check_groups(experts, top_k, n_group, topk_group, lambda key, what: ModelLoadError(f"{source}: field {key!r} {what}"),
                 ("n_group", "topk_group"))
    return dict(moe_router=_SCORING[scoring], moe_selection_bias=selection_bias, moe_n_group=n_group,
                moe_topk_group=topk_group, moe_routed_scaling=float(scaling))


def gguf_router(f: GGUFFile, arch: str, experts: int, top_k: int, default_gating: int) -> dict[str, Any]:
    """ModelConfig's router fields from llama.cpp's keys: `{arch}.expert_gating_func` (1 softmax,
    2 sigmoid; else `default_gating`), `expert_weights_scale` (absent: 1), `expert_group_count` /
    `expert_group_used_count`, and a selection bias when the file has `blk.N.exp_probs_b.bias`."""
    k = arch + "."
    gating = f.get_int(k + "expert_gating_func", default_gating, positive=False)
    if gating not in _GATING_FUNCS:
        raise UnsupportedModelError(f"{f.path}: metadata key {k + 'expert_gating_func'!r} is {gating}; "
                                    "supported: 1 (softmax), 2 (sigmoid)")
    scaling = f.get_float(k + "expert_weights_scale", 1.0)
    if not math.isfinite(scaling) or scaling <= 0:
        raise ModelLoadError(f"{f.path}: metadata key {k + 'expert_weights_scale'!r} must be a positive number, "
                             f"got {scaling!r}")
    n_group = f.get_int(k + "expert_group_count", 1)
    topk_group = f.get_int(k + "expert_group_used_count", 1)
    check_groups(experts, top_k, n_group, topk_group,
                 lambda key, what: ModelLoadError(f"{f.path}: metadata key {key!r} {what}"),
                 (k + "expert_group_count", k + "expert_group_used_count"))
    bias = any(t.name.endswith("exp_probs_b.bias") for t in f.tensors.values())
    return dict(moe_router=_GATING_FUNCS[gating], moe_selection_bias=bias, moe_n_group=n_group,
                moe_topk_group=topk_group, moe_routed_scaling=float(scaling))


def check_groups(experts: int, top_k: int, n_group: int, topk_group: int, error: Callable[[str, str], Exception],
                 keys: tuple[str, str]) -> None:
    """Group-limited selection must be well formed: equal groups of at least two experts (a group
    scores by its two best), topk_group <= n_group, and enough experts in the kept groups for top_k."""
    if n_group > 1:
        if experts % n_group or experts // n_group < 2:
            raise error(keys[0], f"must split the {experts} experts into equal groups of at least 2, got {n_group}")
        if topk_group > n_group:
            raise error(keys[1], f"must be at most {keys[0]} = {n_group}, got {topk_group}")
        if topk_group * (experts // n_group) < top_k:
            raise error(keys[1], f"keeps {topk_group * (experts // n_group)} experts, fewer than the {top_k} chosen")


def _int_field(raw: dict[str, Any], source: str, key: str) -> int:
    v = raw.get(key)
    if v is None:
        return 1
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ModelLoadError(f"{source}: field {key!r} must be a positive integer, got {v!r}")
    return v
