"""The MoE router's scoring and selection as torch ops.

A router turns a token's logits [E] (x @ router^T, + its bias for gpt-oss) into the k experts it
runs and their weights. Three scorings (ModelConfig.moe_router):
  - "softmax_topk" (Qwen-MoE, Mixtral, OLMoE): softmax over all E in fp32, the k best,
    renormalised to sum 1 when norm_topk_prob;
  - "topk_softmax" (gpt-oss): the k best logits, softmaxed among themselves in the logits' dtype;
  - "sigmoid_topk" (DeepSeek-V3, dots.llm1, GLM-4.5): sigmoid(logit) per expert in fp32, each
    expert scored independently, renormalised over the k when norm_topk_prob (+ 1e-20, as
    transformers' DeepseekV3TopkRouter divides).
For the two fp32 scorings a selection bias (e_score_correction_bias, [E] fp32) may be added to the
scores to choose the k -- the weights stay the unbiased scores -- and the choice may be limited to
groups of experts: the E experts split into n_group equal groups, each scored by the sum of its two
best biased scores, and only the topk_group best groups' experts compete. The weights are finally
multiplied by routed_scaling_factor. On the CPU, route() is one op per layer, pagewire::moe_route
(csrc/cpu/moe_route_op.cpp: the C++ router pagewire::moe_decode also runs for decode steps);
elsewhere (and for float64 logits) route_torch() computes it vectorised over the step's tokens, a
handful of torch ops per layer, never a loop over experts.

The config keys that set these fields are read by server.models.moe_router_config.
"""
from __future__ import annotations

import torch

from server.kernels.ops import moe_route

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_topk")
# The logits' dtypes pagewire::moe_route takes (it scores in fp32, as route_torch does).
_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def route(logits: torch.Tensor, router: str, top_k: int, norm_topk_prob: bool,
          selection_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
          routed_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (ids int64 [T, k], weights float32 [T, k]) by `router` (module docstring):
    pagewire::moe_route for CPU logits, route_torch's ops elsewhere. The two choose the same experts
    for logits without ties; their weights may differ in the last bit (tests/kernels/test_moe_route_op.py)."""
    if router not in ROUTERS:
        raise ValueError(f"router: expected 'softmax_topk', 'topk_softmax' or 'sigmoid_topk', got {router!r}")
    if logits.device.type == "cpu" and logits.dtype in _OP_DTYPES and logits.dim() == 2:
        return moe_route(logits, router, top_k, norm_topk_prob, selection_bias, n_group, topk_group, routed_scaling)
    return route_torch(logits, router, top_k, norm_topk_prob, selection_bias, n_group, topk_group, routed_scaling)


def route_torch(logits: torch.Tensor, router: str, top_k: int, norm_topk_prob: bool,
                selection_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                routed_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """route() as torch ops, on any device."""
    if router == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1).float()
    if router == "sigmoid_topk":
        scores = torch.sigmoid(logits.float())
    elif router == "softmax_topk":
        scores = torch.softmax(logits.float(), dim=-1)
    else:
        raise ValueError(f"router: expected 'softmax_topk', 'topk_softmax' or 'sigmoid_topk', got {router!r}")
    if selection_bias is None and n_group == 1:
        weights, ids = torch.topk(scores, top_k, dim=-1)
    else:
        choice = scores if selection_bias is None else scores + selection_bias.float()
        if n_group > 1:
            T, E = choice.shape
            grouped = choice.view(T, n_group, E // n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, torch.topk(group_scores, topk_group, dim=-1)[1], True)
            choice = choice.masked_fill(~keep.unsqueeze(-1).expand_as(grouped).reshape(T, E), float("-inf"))
        ids = torch.topk(choice, top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    if norm_topk_prob:
        # transformers' sigmoid routers add 1e-20 (a token whose k scores all underflow); the
        # softmax ones divide by the sum alone.
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if router == "sigmoid_topk" else 0.0))
    if routed_scaling != 1.0:
        weights = weights * routed_scaling
    return ids, weights
