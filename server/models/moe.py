"""SparseMoE: the MLP of a mixture-of-experts layer (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, gpt-oss).

A router scores each token's hidden row against every expert (softmax over `num_experts` logits,
or DeepSeek-V3-style sigmoid scores with a selection bias, expert groups and a scaling factor:
server.models.moe_router), keeps the top `num_experts_per_tok`, optionally renormalises their
weights to sum to 1 (`norm_topk_prob`), and the token's output is the weighted sum of those experts'
gated MLPs (gate_up -> SiLU(gate) * up -> down). Qwen2-MoE adds a shared expert that every token
runs, scaled by a sigmoid gate of the token's row; dots.llm1's shared experts ("deepseek" names)
are added ungated. gpt-oss differs in three parts: its router and experts
have biases, it softmaxes only the top k logits (`moe_router` "topk_softmax"), and its experts'
activation is the clamped SwiGLU ("swiglu_oai", in moe_experts); its checkpoint stacks the experts
transposed with gate and up columns interleaved, which the load de-interleaves into our gate-then-up
rows, and may ship them as MXFP4 blocks (server.models.mxfp4), decoded at load.

A CPU step of at most 16 tokens (decode) runs the whole MLP -- router, experts, shared expert -- as
one C++ op, pagewire::moe_decode (server.kernels.ops.moe_decode, csrc/cpu/moe_decode.cpp): quantised
experts are read by both cores at once in one OpenMP region. Larger steps (prefill), other devices,
and router or shared-expert matrices whose linear path decode_layer has no name for, run the router
as a linear and moe_router.route (on the CPU one op, pagewire::moe_route; elsewhere a few vectorised
torch ops) and the experts as one C++ op per layer,
pagewire::moe_experts (server.kernels.ops.moe_experts, csrc/cpu/moe.cpp): tokens grouped by
expert, each expert used run once over its rows, experts no token chose never read. The experts'
matrices are stacked per layer -- gate_up [E, 2I, H] (gate rows, then up rows, per expert) and
down [E, H, I] -- float, or kept in GGUF blocks (QuantizedExperts: `--quantization gguf` keeps a
file's `ffn_*_exps` blocks, int8/int4 quantise at load). The router and the shared expert's gate
stay float: they are small, and routing is where precision decides which weights are read.

DecoderLayer owns one of these per sparse layer (ModelConfig.mlp_kind); in a fused step such a layer
runs pagewire::decode_layer's attention half (gate_up kind "none") and then this module
(DecoderLayer.forward_fused).
"""
from __future__ import annotations

import math
from typing import Callable, cast

import torch
from torch import nn

from server.kernels import batch_invariant, linear_plan
from server.kernels.linear_route import Q8_KERNEL_MAX_ROWS, linear, linear_kind
from server.kernels.ops import DecodeStack, moe_decode, moe_experts
from server.kernels.quant import QuantizedExperts, QuantizedWeight
from server.kernels.quant_parts import QuantizedParts
from server.models.config import ModelConfig
from server.models.layers import silu_and_mul
from server.models.moe_router import route
from server.models.mxfp4 import decode_mxfp4
from server.models.weights import WeightTarget, param


class SparseMoE(nn.Module):
    """Router [E, H], experts gate_up [E, 2I, H] and down [E, H, I], and optionally a shared
    expert (gate_up [2S, H], down [H, S]) with, when gated (Qwen2-MoE), its sigmoid gate [1, H]; a
    sigmoid router's selection bias is a float32 [E] whatever the model's dtype (transformers keeps it so)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c = config
        E, I, H, S = c.num_experts, c.moe_intermediate_size, c.hidden_size, c.shared_expert_intermediate_size
        self.num_experts, self.top_k, self.norm_topk_prob = E, c.num_experts_per_tok, c.norm_topk_prob
        self.intermediate_size = I
        self.checkpoint_layout = c.moe_checkpoint
        self.router = c.moe_router
        self.activation, self.alpha, self.limit = c.moe_activation, c.swiglu_alpha, c.swiglu_limit
        self.mxfp4 = c.experts_quantization == "mxfp4"
        # float32 for DeepSeek-V3-style routers whatever the dtype (route() casts the rows up to it)
        self.router_weight = param((E, H), torch.float32 if c.moe_router_fp32 else dtype, device)
        self.router_bias = param((E,), dtype, device) if c.moe_bias else None
        self.selection_bias = param((E,), torch.float32, device) if c.moe_selection_bias else None
        self.n_group, self.topk_group, self.routed_scaling = c.moe_n_group, c.moe_topk_group, c.moe_routed_scaling
        self.experts_gate_up: torch.Tensor | QuantizedExperts = param((E, 2 * I, H), dtype, device)
        self.experts_down: torch.Tensor | QuantizedExperts = param((E, H, I), dtype, device)
        self.experts_gate_up_bias = param((E, 2 * I), dtype, device) if c.moe_bias else None
        self.experts_down_bias = param((E, H), dtype, device) if c.moe_bias else None
        self.shared_gate_up_weight: torch.Tensor | QuantizedWeight | QuantizedParts | None = (
            param((2 * S, H), dtype, device) if S else None)
        self.shared_down_weight: torch.Tensor | QuantizedWeight | None = param((H, S), dtype, device) if S else None
        self.shared_gate_weight = param((1, H), dtype, device) if S and c.shared_expert_gated else None
        # pagewire::moe_decode for CPU steps of at most 16 tokens (tests turn it off to compare);
        # decode_kinds' cache: (T, dtype, plan table id, invariant) -> (table, kinds).
        self.fused_decode = True
        self._kinds_cache: dict[tuple[int, torch.dtype, int, bool], tuple[object, tuple[str, str, str, str] | None]] = {}

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids int64 [T, k], topk_weights float32 [T, k]) as transformers' routers compute
        them (server.models.moe_router): softmax of the logits in float32, top-k, renormalised when
        norm_topk_prob; gpt-oss's top-k of the logits (with the router's bias), softmax over those
        k in x's dtype; or sigmoid scores chosen with the selection bias and groups, scaled."""
        logits = linear(x.to(self.router_weight.dtype), self.router_weight, self.router_bias)
        return route(logits, self.router, self.top_k, self.norm_topk_prob, self.selection_bias, self.n_group,
                     self.topk_group, self.routed_scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (the MLP's normed input) -> [T, H] in x's dtype."""
        kinds = self.decode_kinds(x)
        if kinds is not None:
            return self._decode(x, kinds)
        if batch_invariant.enabled() and x.device.type == "cpu" and x.dim() == 2:
            # A row's floats must not depend on its step's size: moe_decode's arithmetic (its
            # router, fp32 activations) for every row, 16 rows a call (the kinds there do not depend
            # on the row count).
            kinds = self.decode_kinds(x[:Q8_KERNEL_MAX_ROWS])
            if kinds is not None:
                return torch.cat([self._decode(rows, kinds) for rows in x.split(Q8_KERNEL_MAX_ROWS)])
        ids, weights = self.route(x)
        out = moe_experts(x, ids, weights, self.experts_gate_up, self.experts_down, self.experts_gate_up_bias,
                          self.experts_down_bias, self.activation, self.alpha, self.limit)
        if self.shared_gate_up_weight is not None and self.shared_down_weight is not None:
            shared = linear(silu_and_mul(linear(x, self.shared_gate_up_weight)), self.shared_down_weight)
            if self.shared_gate_weight is not None:
                shared = torch.sigmoid(linear(x, self.shared_gate_weight)) * shared
            out = out + shared
        return out

    def _decode(self, x: torch.Tensor, kinds: tuple[str, str, str, str]) -> torch.Tensor:
        """forward() for at most 16 CPU rows: one pagewire::moe_decode call."""
        shared = None
        if self.shared_gate_up_weight is not None and self.shared_down_weight is not None:
            shared = (_data(self.shared_gate_up_weight), kinds[1], _data(self.shared_down_weight), kinds[2],
                      self.shared_gate_weight, kinds[3])
        return moe_decode(x, self.router_weight, kinds[0], self.router_bias, self.router, self.top_k,
                          self.norm_topk_prob, self.experts_gate_up, self.experts_down, self.experts_gate_up_bias,
                          self.experts_down_bias, self.activation, self.alpha, self.limit, shared,
                          self.selection_bias, self.n_group, self.topk_group, self.routed_scaling)

    def add_to_stack(self, stack: DecodeStack, kinds: tuple[str, str, str, str]) -> None:
        """Make the stack's last layer sparse with _decode's arguments (DecoderLayer.add_to_stack)."""
        gu, dn = self.experts_gate_up, self.experts_down
        gk, gw = (gu.op_qtype, gu.data) if isinstance(gu, QuantizedExperts) else ("float", gu)
        dk, dw = (dn.op_qtype, dn.data) if isinstance(dn, QuantizedExperts) else ("float", dn)
        sgu, sdn = self.shared_gate_up_weight, self.shared_down_weight
        shared = sgu is not None and sdn is not None
        stack.set_moe(self.router_weight, kinds[0], self.router_bias, self.router, self.top_k, self.norm_topk_prob,
                      gw, str(gk), dw, str(dk), self.experts_gate_up_bias, self.experts_down_bias, self.activation,
                      self.alpha, self.limit,
                      _data(sgu) if sgu is not None and shared else None, kinds[1] if shared else "",
                      _data(sdn) if sdn is not None and shared else None, kinds[2] if shared else "",
                      self.shared_gate_weight if shared else None, kinds[3] if shared else "",
                      self.selection_bias, self.n_group, self.topk_group, self.routed_scaling)

    def decode_kinds(self, x: torch.Tensor) -> tuple[str, str, str, str] | None:
        """The linear paths (linear_route.linear_kind) of the router, shared gate_up, shared down and shared
        gate for pagewire::moe_decode ("" where there is no shared expert), or None where this step
        runs route() and moe_experts instead: off the CPU, above 16 rows, `fused_decode` off, or a
        matrix whose path decode_layer has no name for. Cached per row count, dtype, linear plan
        table and batch-invariant mode, as DecoderForCausalLM caches decode_layer's kinds."""
        T = x.shape[0]
        if not self.fused_decode or x.device.type != "cpu" or x.dim() != 2 or T > Q8_KERNEL_MAX_ROWS:
            return None
        table = linear_plan.active_table()
        key = (T, x.dtype, id(table), batch_invariant.enabled())
        cached = self._kinds_cache.get(key)
        if cached is None or cached[0] is not table:
            found: list[str | None] = [linear_kind(self.router_weight.dtype, T, self.router_weight, self.router_bias)]
            if self.shared_gate_up_weight is not None and self.shared_down_weight is not None:
                found += [linear_kind(x.dtype, T, self.shared_gate_up_weight, None),
                          linear_kind(x.dtype, T, self.shared_down_weight, None),
                          linear_kind(x.dtype, T, self.shared_gate_weight, None)
                          if self.shared_gate_weight is not None else ""]
            else:
                found += ["", "", ""]
            kinds = None if None in found else cast(tuple[str, str, str, str], tuple(str(k) for k in found))
            cached = (table, kinds)
            self._kinds_cache[key] = cached
        return cached[1]

    def quantize_weights(self, qtype: str) -> None:
        """Keep the experts (and the shared expert's matrices) in `qtype` blocks; router and gate stay float."""
        self._kinds_cache.clear()  # the shared expert's linear kinds change with its format
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

    def linear_weights(self) -> list[tuple[str, torch.Tensor | QuantizedWeight | QuantizedParts]]:
        """The matrices this MLP passes to `linear` (the experts go through moe_experts instead)."""
        out: list[tuple[str, torch.Tensor | QuantizedWeight | QuantizedParts]] = [
            ("router", self.router_weight)]  # (its bias: linear's)
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
        Qwen2-MoE's `mlp.shared_expert.*` and `mlp.shared_expert_gate.weight`; "deepseek" (dots.llm1)
        adds `mlp.gate.e_score_correction_bias` and names its ungated shared experts `mlp.shared_experts.*`."""

        gu, dn = self.experts_gate_up, self.experts_down
        assert isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor), "checkpoint_tensors: already quantised"
        E, I, H = self.num_experts, self.intermediate_size, self.router_weight.shape[1]
        if self.checkpoint_layout == "gpt_oss":
            return self._gpt_oss_tensors(prefix + "mlp.", gu, dn)
        mixtral = self.checkpoint_layout == "mixtral"
        m = prefix + ("block_sparse_moe." if mixtral else "mlp.")
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        t = {m + "gate.weight": WeightTarget(self.router_weight, (E, H))}
        for e in range(E):
            x = f"{m}experts.{e}."
            t[x + names[0] + ".weight"] = WeightTarget(gu[e, :I], (I, H))
            t[x + names[1] + ".weight"] = WeightTarget(gu[e, I:], (I, H))
            t[x + names[2] + ".weight"] = WeightTarget(dn[e], (H, I))
        if self.selection_bias is not None and self.checkpoint_layout == "ernie":
            t[m + "moe_statics.e_score_correction_bias"] = WeightTarget(self.selection_bias.view(1, E), (1, E))
        elif self.selection_bias is not None:
            t[m + "gate.e_score_correction_bias"] = WeightTarget(self.selection_bias, (E,))
        sgu, sdn, sg = self.shared_gate_up_weight, self.shared_down_weight, self.shared_gate_weight
        if sgu is not None and sdn is not None:
            assert isinstance(sgu, torch.Tensor) and isinstance(sdn, torch.Tensor)
            S = sdn.shape[1]
            s = m + ("shared_experts." if self.checkpoint_layout in ("deepseek", "ernie") else "shared_expert.")
            t[s + "gate_proj.weight"] = WeightTarget(sgu[:S], (S, H))
            t[s + "up_proj.weight"] = WeightTarget(sgu[S:], (S, H))
            t[s + "down_proj.weight"] = WeightTarget(sdn, (H, S))
            if sg is not None:
                t[m + "shared_expert_gate.weight"] = WeightTarget(sg, (1, H))
        return t

    def _gpt_oss_tensors(self, m: str, gu: torch.Tensor, dn: torch.Tensor) -> dict[str, WeightTarget]:
        """gpt-oss's names under `m` ("model.layers.3.mlp."): router.{weight,bias}, and the experts
        stacked as transformers keeps them -- experts.gate_up_proj [E, H, 2I] (x @ W, gate and up
        in alternate columns), experts.down_proj [E, I, H], their biases [E, 2I] (alternating) and
        [E, H] -- or, in an MXFP4 checkpoint, experts.{gate_up,down}_proj_{blocks,scales} with rows
        as output features ([E, 2I, H / 32, 16]: rows alternate gate and up)."""
        E, I, H = self.num_experts, self.intermediate_size, self.router_weight.shape[1]
        assert self.router_bias is not None and self.experts_gate_up_bias is not None
        assert self.experts_down_bias is not None
        x = m + "experts."
        t = {m + "router.weight": WeightTarget(self.router_weight, (E, H)),
             m + "router.bias": WeightTarget(self.router_bias, (E,)),
             x + "gate_up_proj_bias": WeightTarget(self.experts_gate_up_bias, (E, 2 * I), convert=_split_gate_up),
             x + "down_proj_bias": WeightTarget(self.experts_down_bias, (E, H))}
        if not self.mxfp4:
            t[x + "gate_up_proj"] = WeightTarget(gu, (E, H, 2 * I), convert=lambda w: _split_gate_up(w).transpose(1, 2))
            t[x + "down_proj"] = WeightTarget(dn, (E, I, H), convert=lambda w: w.transpose(1, 2))
            return t
        for name, dest, rows, cols, convert in (("gate_up_proj", gu, 2 * I, H, _split_gate_up_rows),
                                                ("down_proj", dn, H, I, None)):
            blocks = torch.empty((E, rows, cols // 32, 16), dtype=torch.uint8)
            scales = torch.empty((E, rows, cols // 32), dtype=torch.uint8)
            done = _PairDecoder(dest, blocks, scales, convert)
            t[x + name + "_blocks"] = WeightTarget(blocks, tuple(blocks.shape), after=done.arrived)
            t[x + name + "_scales"] = WeightTarget(scales, tuple(scales.shape), after=done.arrived)
        return t

    def gguf_tensors(self, layer: int) -> dict[str, WeightTarget]:
        """llama.cpp's gpt-oss names for this layer's MLP (`blk.N.ffn_gate_inp.{weight,bias}`, and
        `ffn_{gate,up,down}_exps.{weight,bias}` stacked [E, I, H] / [E, H, I], gate and up apart)."""
        gu, dn = self.experts_gate_up, self.experts_down
        gub, db = self.experts_gate_up_bias, self.experts_down_bias
        assert isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor), "gguf_tensors: already quantised"
        assert self.router_bias is not None and gub is not None and db is not None
        E, I, H = self.num_experts, self.intermediate_size, self.router_weight.shape[1]
        b = f"blk.{layer}."
        return {b + "ffn_gate_inp.weight": WeightTarget(self.router_weight, (E, H)),
                b + "ffn_gate_inp.bias": WeightTarget(self.router_bias, (E,)),
                b + "ffn_gate_exps.weight": WeightTarget(gu[:, :I], (E, I, H)),
                b + "ffn_up_exps.weight": WeightTarget(gu[:, I:], (E, I, H)),
                b + "ffn_down_exps.weight": WeightTarget(dn, (E, H, I)),
                b + "ffn_gate_exps.bias": WeightTarget(gub[:, :I], (E, I)),
                b + "ffn_up_exps.bias": WeightTarget(gub[:, I:], (E, I)),
                b + "ffn_down_exps.bias": WeightTarget(db, (E, H))}


def _data(weight: torch.Tensor | QuantizedWeight | QuantizedParts) -> torch.Tensor:
    """The tensor a linear kind reads: the float matrix, or a QuantizedWeight's (QuantizedParts') block bytes."""
    return weight if isinstance(weight, torch.Tensor) else weight.data


def _split_gate_up(w: torch.Tensor) -> torch.Tensor:
    """gpt-oss's alternating gate/up columns [..., 2I] -> gate columns then up columns."""
    return torch.cat((w[..., 0::2], w[..., 1::2]), dim=-1)


def _split_gate_up_rows(w: torch.Tensor) -> torch.Tensor:
    """The same over the rows of [E, 2I, K] (MXFP4 blocks are stored by output feature)."""
    return torch.cat((w[:, 0::2], w[:, 1::2]), dim=1)


class _PairDecoder:
    """Decodes an MXFP4 blocks/scales pair into `dest` once both tensors have been copied in."""

    def __init__(self, dest: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 convert: "Callable[[torch.Tensor], torch.Tensor] | None") -> None:
        self.dest, self.blocks, self.scales, self.convert, self.count = dest, blocks, scales, convert, 0

    def arrived(self) -> None:
        self.count += 1
        if self.count == 2:
            # One expert at a time: the float32 decode of a whole layer's experts (and its
            # de-interleaved copy) would be twice the layer's experts in the model's dtype on top of
            # them, the load's peak; one expert's is a few megabytes.
            for e in range(self.dest.shape[0]):
                w = decode_mxfp4(self.blocks[e:e + 1], self.scales[e:e + 1])  # [1, rows, cols] float32
                self.dest[e:e + 1].copy_(self.convert(w) if self.convert is not None else w)
            self.blocks = self.scales = torch.empty(0, dtype=torch.uint8)  # the staging bytes are freed


def parameter_summary(model: nn.Module) -> str:
    """"; 3.1B parameters, 0.8B active per token (8 of 128 experts in 48 of 48 layers)" for a model
    with sparse layers, "" for a dense one: what the engine's start-up line adds (DecoderForCausalLM.summary)."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers:
        return ""
    total = sum(p.numel() for p in model.parameters())
    for m in model.modules():  # matrices kept quantised are plain attributes, counted by their logical shape
        for v in vars(m).values():
            if isinstance(v, (QuantizedWeight, QuantizedExperts, QuantizedParts)):
                total += math.prod(v.shape)
    active = total - sum(3 * (m.num_experts - m.top_k) * m.intermediate_size * m.router_weight.shape[1]
                         for m in layers)

    def n(x: int) -> str:
        return f"{x / 1e9:.1f}B" if x >= 1e9 else f"{x / 1e6:.1f}M" if x >= 1e6 else f"{x / 1e3:.1f}K"

    first = layers[0]
    return (f"; {n(total)} parameters, {n(active)} active per token ({first.top_k} of {first.num_experts} experts "
            f"in {len(layers)} of {len(getattr(model, '_layers', layers))} layers)")
