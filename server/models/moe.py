"""SparseMoE: the MLP of a mixture-of-experts layer (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE).

A router scores each token's hidden row against every expert (softmax over `num_experts` logits),
keeps the top `num_experts_per_tok`, optionally renormalises their weights to sum to 1
(`norm_topk_prob`), and the token's output is the weighted sum of those experts' gated MLPs
(gate_up -> SiLU(gate) * up -> down). Qwen2-MoE adds a shared expert that every token runs,
scaled by a sigmoid gate of the token's row.

The router is three per-row torch ops (a linear, softmax, top-k); the experts run as one C++ op per
layer, pagewire::moe_experts (server.kernels.ops.moe_experts, csrc/cpu/moe.cpp): tokens grouped by
expert, each expert used run once over its rows, experts no token chose never read. The experts'
matrices are stacked per layer -- gate_up [E, 2I, H] (gate rows, then up rows, per expert) and
down [E, H, I] -- float, or kept in GGUF blocks (QuantizedExperts: `--quantization gguf` keeps a
file's `ffn_*_exps` blocks, int8/int4 quantise at load). The router and the shared expert's gate
stay float: they are small, and routing is where precision decides which weights are read.

DecoderLayer owns one of these per sparse layer (ModelConfig.mlp_kind); layers with one run the
Python layer (DecoderLayer.fusable is False): pagewire::decode_layer has no experts.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from server.kernels.ops import linear, moe_experts
from server.kernels.quant import QuantizedExperts, QuantizedWeight
from server.models.config import ModelConfig
from server.models.layers import silu_and_mul
from server.models.weights import WeightTarget, param


class SparseMoE(nn.Module):
    """Router [E, H], experts gate_up [E, 2I, H] and down [E, H, I], and optionally a shared
    expert (gate_up [2S, H], down [H, S]) with its sigmoid gate [1, H]."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c = config
        E, I, H, S = c.num_experts, c.moe_intermediate_size, c.hidden_size, c.shared_expert_intermediate_size
        self.num_experts, self.top_k, self.norm_topk_prob = E, c.num_experts_per_tok, c.norm_topk_prob
        self.intermediate_size = I
        self.checkpoint_layout = c.moe_checkpoint
        self.router_weight = param((E, H), dtype, device)
        self.experts_gate_up: torch.Tensor | QuantizedExperts = param((E, 2 * I, H), dtype, device)
        self.experts_down: torch.Tensor | QuantizedExperts = param((E, H, I), dtype, device)
        self.shared_gate_up_weight: torch.Tensor | QuantizedWeight | None = (
            param((2 * S, H), dtype, device) if S else None)
        self.shared_down_weight: torch.Tensor | QuantizedWeight | None = param((H, S), dtype, device) if S else None
        self.shared_gate_weight = param((1, H), dtype, device) if S else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids int64 [T, k], topk_weights float32 [T, k]) as transformers' routers compute
        them: softmax of the logits in float32, top-k, renormalised when norm_topk_prob."""
        probs = torch.softmax(linear(x, self.router_weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (the MLP's normed input) -> [T, H] in x's dtype."""
        ids, weights = self.route(x)
        out = moe_experts(x, ids, weights, self.experts_gate_up, self.experts_down)
        if self.shared_gate_up_weight is not None and self.shared_down_weight is not None:
            assert self.shared_gate_weight is not None
            shared = linear(silu_and_mul(linear(x, self.shared_gate_up_weight)), self.shared_down_weight)
            out = out + torch.sigmoid(linear(x, self.shared_gate_weight)) * shared
        return out

    def quantize_weights(self, qtype: str) -> None:
        """Keep the experts (and the shared expert's matrices) in `qtype` blocks; router and gate stay float."""
        for name in ("experts_gate_up", "experts_down"):
            w = getattr(self, name)
            if isinstance(w, QuantizedExperts):
                continue
            self._parameters.pop(name, None)
            setattr(self, name, QuantizedExperts.quantize(w, qtype).for_kernels())
        for name in ("shared_gate_up_weight", "shared_down_weight"):
            w = getattr(self, name)
            if isinstance(w, torch.Tensor):
                self._parameters.pop(name, None)
                setattr(self, name, QuantizedWeight.quantize(w, qtype).for_kernels())

    def linear_weights(self) -> list[tuple[str, torch.Tensor | QuantizedWeight]]:
        """The matrices this MLP passes to `linear` (the experts go through moe_experts instead)."""
        out: list[tuple[str, torch.Tensor | QuantizedWeight]] = [("router", self.router_weight)]
        if self.shared_gate_up_weight is not None and self.shared_down_weight is not None:
            out += [("shared_gate_up", self.shared_gate_up_weight), ("shared_down", self.shared_down_weight)]
        return out

    def active_parameters(self) -> int:
        """Parameters one token reads: the router, its top-k experts and the shared expert."""
        E, I = self.num_experts, self.intermediate_size
        H = self.router_weight.shape[1]
        shared = 0 if self.shared_gate_weight is None else self.shared_gate_weight.numel()
        if self.shared_down_weight is not None:
            shared += 3 * int(self.shared_down_weight.shape[0]) * int(self.shared_down_weight.shape[1])
        return E * H + self.top_k * 3 * I * H + shared

    def checkpoint_tensors(self, prefix: str) -> dict[str, WeightTarget]:
        """HF names under `prefix` ("model.layers.3.") -> slices of the stacked parameters:
        `mlp.experts.N.{gate,up,down}_proj` (Qwen-MoE, OLMoE) or Mixtral's
        `block_sparse_moe.experts.N.{w1,w3,w2}` (gate, up, down), the router `*.gate.weight`, and
        Qwen2-MoE's `mlp.shared_expert.*` and `mlp.shared_expert_gate.weight`."""

        gu, dn = self.experts_gate_up, self.experts_down
        assert isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor), "checkpoint_tensors: already quantised"
        E, I, H = self.num_experts, self.intermediate_size, self.router_weight.shape[1]
        mixtral = self.checkpoint_layout == "mixtral"
        m = prefix + ("block_sparse_moe." if mixtral else "mlp.")
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        t = {m + "gate.weight": WeightTarget(self.router_weight, (E, H))}
        for e in range(E):
            x = f"{m}experts.{e}."
            t[x + names[0] + ".weight"] = WeightTarget(gu[e, :I], (I, H))
            t[x + names[1] + ".weight"] = WeightTarget(gu[e, I:], (I, H))
            t[x + names[2] + ".weight"] = WeightTarget(dn[e], (H, I))
        sgu, sdn, sg = self.shared_gate_up_weight, self.shared_down_weight, self.shared_gate_weight
        if sgu is not None and sdn is not None and sg is not None:
            assert isinstance(sgu, torch.Tensor) and isinstance(sdn, torch.Tensor)
            S = sdn.shape[1]
            t[m + "shared_expert.gate_proj.weight"] = WeightTarget(sgu[:S], (S, H))
            t[m + "shared_expert.up_proj.weight"] = WeightTarget(sgu[S:], (S, H))
            t[m + "shared_expert.down_proj.weight"] = WeightTarget(sdn, (H, S))
            t[m + "shared_expert_gate.weight"] = WeightTarget(sg, (1, H))
        return t


def parameter_summary(model: nn.Module) -> str:
    """"; 3.1B parameters, 0.8B active per token (8 of 128 experts in 48 of 48 layers)" for a model
    with sparse layers, "" for a dense one: what the engine's start-up line adds (DecoderForCausalLM.summary)."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers:
        return ""
    total = sum(p.numel() for p in model.parameters())
    for m in model.modules():  # matrices kept quantised are plain attributes, counted by their logical shape
        for v in vars(m).values():
            if isinstance(v, (QuantizedWeight, QuantizedExperts)):
                total += math.prod(v.shape)
    active = total - sum(3 * (m.num_experts - m.top_k) * m.intermediate_size * m.router_weight.shape[1]
                         for m in layers)

    def n(x: int) -> str:
        return f"{x / 1e9:.1f}B" if x >= 1e9 else f"{x / 1e6:.1f}M" if x >= 1e6 else f"{x / 1e3:.1f}K"

    first = layers[0]
    return (f"; {n(total)} parameters, {n(active)} active per token ({first.top_k} of {first.num_experts} experts "
            f"in {len(layers)} of {len(getattr(model, '_layers', layers))} layers)")
