"""DecoderForCausalLM: the decoder of every supported family, built from the parts ModelConfig
names, running on pagewire's paged KV cache.

No class per model: the families (server.models.families) differ only in parts read from
ModelConfig -- norm placement (pre, post, both) and `1 + w` weights, SiLU or GELU-tanh, q/k/v
bias, q/k RMSNorm per head or over the projection, per-layer sliding windows and RoPE tables
(NoPE layers, partial rotary, scaled frequencies), logit soft-capping, attention scale and
Granite's multipliers, Gemma 4's per-layer shapes, KV sharing, value norm, per-layer inputs and
layer scalar. Layers the fused C++ layer expresses (DecoderLayer.fusable) run as one
pagewire::decode_layer call for small CPU batches; the others run the Python layer. Weights are
stored fused (one qkv and one gate_up matrix per layer) so CPU inference runs fewer, larger
matmuls; `checkpoint_tensors()` tells the loader where each Hugging Face tensor lands inside the
fused parameters.
"""
from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from server.kernels import autotune, batch_invariant
from server.kernels.ops import (
    Q8_KERNEL_MAX_ROWS,
    cpu_isa,
    embedding,
    linear,
    linear_kind,
    paged_attention,
    write_kv_cache,
)
from server.kernels.quant import QUANTIZATIONS, QuantizedWeight
from server.kernels.quant_parts import QuantizedParts
from server.models.attention import AttentionMetadata
from server.models.config import ModelConfig
from server.models.layers import add_norm, gelu_tanh_and_mul, norm, rms_norm, silu_and_mul
from server.models.lora import LoraStep, Slot
from server.models.moe import SparseMoE, parameter_summary
from server.models.rope import RopeBatch, RotaryEmbedding
from server.models.weights import WeightTarget, param


class DecoderLayer(nn.Module):
    """One decoder block built from the config's parts: attention over the paged cache, then a
    gated MLP, with norms where `norm_placement` puts them.

    Parameters (fused): qkv_weight [q + 2 kv, H], o_weight [H, q], gate_up_weight [2 I, H],
    down_weight [H, I]; norms [H]: attn_norm / mlp_norm before each sub-block ("pre", "both"),
    attn_post_norm / mlp_post_norm on each sub-block's output ("post", "both"). Per-head q/k norm
    is qk_norm [num_heads + num_kv_heads, head_dim] (q_norm repeated over query heads, then k_norm
    over kv heads, so one op normalises both); over the projection it is q_norm [q] and k_norm [kv].
    """

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        # Per-layer shapes (Gemma 4's global layers have their own head size and KV heads).
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.kv_heads_of(layer_idx), c.head_dim_of(layer_idx)
        self.q_size, self.kv_size = c.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Gemma 4: a layer may attend over an earlier layer's KV cache, projecting no keys or values
        # of its own; another may take its values from the key projection (attention_k_eq_v).
        self.shares_kv = c.kv_source(layer_idx) != layer_idx
        self.value_from_key = c.value_from_key(layer_idx) and not self.shares_kv
        self.eps = c.rms_norm_eps
        self.norm_fp32 = c.norm_weight_fp32  # gpt-oss's norm rounding (layers.rms_norm_weight_fp32)
        self.scale = c.attention_scale
        self.softcap = c.attn_logit_softcap
        window = c.layer_sliding_windows[layer_idx]
        self.sliding_window = window if window is not None else 0  # the op reads <= 0 as "no window"
        self.rope_index = c.layer_ropes[layer_idx]  # None: a NoPE layer
        self.rotary_dim = c.ropes[self.rope_index].rotary_dim if self.rope_index is not None else 0
        self.activation = c.activation  # "silu" or "gelu_tanh"; the kernels and decode_layer take both
        self.residual_multiplier = c.residual_multiplier

        H, I = c.hidden_size, c.intermediate_of(layer_idx)
        self.hidden_size = H
        own_kv = 0 if self.shares_kv else (1 if self.value_from_key else 2) * self.kv_size
        qkv = self.q_size + own_kv  # q, then k and v rows unless shared (k only when v is k)
        pre, post = c.norm_placement in ("pre", "both"), c.norm_placement in ("post", "both")
        self.attn_norm = param((H,), dtype, device) if pre else None
        self.attn_post_norm = param((H,), dtype, device) if post else None
        self.mlp_norm = param((H,), dtype, device) if pre else None
        self.mlp_post_norm = param((H,), dtype, device) if post else None
        # The four matrices may be replaced by QuantizedWeight (quantize_weights) after loading, and
        # the fused ones by QuantizedParts (a GGUF file's parts of different block types).
        self.qkv_weight: torch.Tensor | QuantizedWeight | QuantizedParts = param((qkv, H), dtype, device)
        self.qkv_bias = param((qkv,), dtype, device) if c.qkv_bias else None
        per_head, whole = c.qk_norm and c.qk_norm_over == "head", c.qk_norm and c.qk_norm_over == "projection"
        kv_heads_normed = 0 if self.shares_kv else self.num_kv_heads
        self.qk_norm = param((c.num_heads + kv_heads_normed, self.head_dim), dtype, device) if per_head else None
        self.q_norm = param((self.q_size,), dtype, device) if whole else None
        self.k_norm = param((self.kv_size,), dtype, device) if whole else None
        # Gemma 4's value norm: RMSNorm of each value head with no weight (ones: x * r * 1 == x * r).
        self.v_norm = (torch.ones(self.head_dim, dtype=dtype, device=device)
                       if c.value_norm and not self.shares_kv else None)
        self.o_weight: torch.Tensor | QuantizedWeight = param((H, self.q_size), dtype, device)
        self.o_bias = param((H,), dtype, device) if c.o_bias else None
        # gpt-oss's attention sinks [num_heads], float32 as the attention ops take them.
        self.sinks = param((c.num_heads,), torch.float32, device) if c.attention_sinks else None
        self.gate_up_weight: torch.Tensor | QuantizedWeight | QuantizedParts = param((2 * I, H), dtype, device)
        self.gate_up_bias = param((2 * I,), dtype, device) if c.mlp_bias else None
        self.down_weight: torch.Tensor | QuantizedWeight = param((H, I), dtype, device)
        self.down_bias = param((H,), dtype, device) if c.mlp_bias else None
        # Gemma 4's end of layer: a gated block over the per-layer input embedding (PLE), then the
        # whole residual stream scaled by the layer's scalar.
        P = c.per_layer_input_size
        self.ple_gate = param((P, H), dtype, device) if P else None
        self.ple_proj = param((H, P), dtype, device) if P else None
        self.ple_norm = param((H,), dtype, device) if P else None
        self.layer_scalar = param((1,), dtype, device) if c.layer_scalar else None
        self.norm_offset = c.norm_weight_offset
        self.fused_checkpoint = c.fused_checkpoint
        # The layers pagewire::decode_layer expresses: every norm placement, q/k norm over the
        # projection, full, partial or no RoPE, residual multipliers, SiLU or GELU-tanh, soft-capping
        # or not, and Gemma 4's parts (KV read from another layer, values from the key projection,
        # the value norm, the per-layer input block, the layer scalar). Not a per-head q/k norm on a
        # NoPE or partial-rotary layer (GLM-4.5 with use_qk_norm has one): there forward() norms with torch ops,
        # where the C++ layer's norm rides on the rotation; nor a projection q/k norm on a layer with
        # no keys of its own (no family has one either). Those run forward().
        self.fusable = ((self.qk_norm is None or (self.rope_index is not None and self.rotary_dim == self.head_dim))
                        and not (self.shares_kv and self.q_norm is not None))
        # Gemma 4's layers end by adding their MLP output themselves (_finish): nothing is left over.
        self.finishes = self.ple_gate is not None or self.layer_scalar is not None
        # Mixture of experts: a sparse layer's MLP is its router and experts (server.models.moe); fused,
        # decode_layer runs its attention half and pagewire::moe_decode the rest (forward_fused).
        self.moe: SparseMoE | None = None
        _attach_moe(self, c, layer_idx, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        rope: RotaryEmbedding | None,
        rope_batch: RopeBatch | None,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        per_layer_input: torch.Tensor | None = None,
        lora: LoraStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Args: hidden [T, H], the residual stream (updated in place); delta [T, H], the previous
        layer's MLP output not yet added to it (None for the first layer); rope and rope_batch:
        this layer's table (None for a NoPE layer); per_layer_input [T, P], this layer's slice of
        the per-layer input embeddings (models with them only); lora: the step's LoRA terms, added
        to each projection's output for the rows that use an adapter (server.models.lora).

        Returns (hidden, this layer's MLP output): the add is left to the next norm, which fuses it
        (None when the layer ends by adding it itself: the per-layer input block, the layer scalar).
        """
        T = hidden.shape[0]
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        nk = 0 if self.shares_kv else nkv  # key heads this layer projects

        x = _enter(hidden, delta, self.attn_norm, self.eps, self.norm_fp32)
        qkv = linear(x, self.qkv_weight, self.qkv_bias)  # [T, q + 2 kv] (q + kv, q: see own_kv)
        if lora is not None:
            lora.add(self.layer_idx, "qkv", x, qkv)
        q, kv = self.q_size, self.kv_size
        if self.q_norm is not None and self.k_norm is not None:  # OLMo 2: over the whole projection
            qkv[:, :q] = norm(qkv[:, :q].contiguous(), self.q_norm, self.eps)
            qkv[:, q : q + kv] = norm(qkv[:, q : q + kv].contiguous(), self.k_norm, self.eps)
        # q and k are adjacent in qkv, so norm and RoPE treat them as nh + nkv heads in one pass,
        # in place (query and key stay strided views of qkv; the attention ops take strides).
        value = None
        if self.value_from_key:  # attention_k_eq_v: the values are the key projection, before norm and RoPE
            value = qkv[:, q : q + kv].clone(memory_format=torch.contiguous_format).view(T, nkv, d)
        elif not self.shares_kv:
            value = qkv[:, q + kv :].view(T, nkv, d)
        qk = qkv[:, : self.q_size + nk * d].view(T, nh + nk, d)
        if rope is not None and rope_batch is not None and self.rotary_dim == d:
            rope.rotate_(qk, rope_batch, self.qk_norm, self.eps)
        else:
            if self.qk_norm is not None:
                qk.copy_(rms_norm(qk, self.qk_norm, self.eps))
            if rope is not None and rope_batch is not None:  # partial rotary: the leading dims
                rope.rotate_(qk[..., : self.rotary_dim], rope_batch)
        query = qk[:, :nh]
        if value is not None:  # a sharing layer reads the KV its source layer wrote this step
            if self.v_norm is not None:
                value = rms_norm(value, self.v_norm, self.eps)
            write_kv_cache(qk[:, nh:], value, key_cache, value_cache, meta.slot_mapping)
        attn = torch.empty((T, nh, d), dtype=hidden.dtype, device=hidden.device)
        paged_attention(attn, query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                        self.scale, self.sliding_window, meta.max_query_len, meta.max_seq_len, self.softcap,
                        self.sinks)
        out = linear(attn.view(T, self.q_size), self.o_weight, self.o_bias)
        if lora is not None:
            lora.add(self.layer_idx, "o", attn.view(T, self.q_size), out)
        x = _enter(hidden, self._leave(out, self.attn_post_norm), self.mlp_norm, self.eps, self.norm_fp32)
        if self.moe is not None:  # a sparse layer: the router, then pagewire::moe_experts
            return hidden, self._leave(self.moe(x), self.mlp_post_norm)
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)
        if lora is not None:
            lora.add(self.layer_idx, "gate_up", x, gate_up)
        act = gelu_tanh_and_mul(gate_up) if self.activation == "gelu_tanh" else silu_and_mul(gate_up)
        down = linear(act, self.down_weight, self.down_bias)
        if lora is not None:
            lora.add(self.layer_idx, "down", act, down)
        mlp = self._leave(down, self.mlp_post_norm)
        if not self.finishes:
            return hidden, mlp
        return self._finish(hidden, mlp, per_layer_input), None

    def _finish(self, hidden: torch.Tensor, mlp: torch.Tensor, per_layer_input: torch.Tensor | None) -> torch.Tensor:
        """Gemma 4's end of layer, in transformers' order: add the MLP output; add the per-layer
        input block's output, norm(proj(act(gate(h)) * per_layer_input)); scale the stream."""
        hidden.add_(mlp)
        if self.ple_gate is not None and self.ple_proj is not None and self.ple_norm is not None:
            assert per_layer_input is not None, "per_layer_input: this model has per-layer input embeddings"
            gate = linear(hidden, self.ple_gate)
            gate = (F.gelu(gate, approximate="tanh") if self.activation == "gelu_tanh" else F.silu(gate))
            hidden.add_(norm(linear(gate.mul_(per_layer_input), self.ple_proj), self.ple_norm, self.eps))
        if self.layer_scalar is not None:
            hidden.mul_(self.layer_scalar)
        return hidden

    def _leave(self, out: torch.Tensor, post_norm: torch.Tensor | None) -> torch.Tensor:
        """A sub-block's output as it joins the residual stream: post-normed (OLMo 2, Gemma) and
        scaled by the residual multiplier (Granite: residual + out * m)."""
        if post_norm is not None:
            out = norm(out, post_norm, self.eps)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return out

    def forward_fused(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        rope: RotaryEmbedding | None,
        positions: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        kinds: tuple[str, ...],
        per_layer_input: torch.Tensor | None = None,
        lora: LoraStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward() in one C++ call (pagewire::decode_layer: the same ops in the same order, so the
        same floats), for CPU batches of at most 16 tokens; rope: this layer's table (None: NoPE)
        and positions the rows to read from it (RopeBatch.positions); kinds: each matrix's linear
        path (ops.linear_kind), in MATRICES order, then the per-layer input block's gate and
        projection (linear_kinds); per_layer_input as forward()'s; lora: the step's stacked LoRA
        terms (LoraStep.fusable), added by decode_layer as forward() adds them."""
        ple = self.ple_gate is not None
        # A sparse layer: decode_layer stops at the MLP's input (gate_up kind "none"), the experts follow.
        gate_up_kind, down_kind = ("none", "none") if self.moe is not None else (kinds[2], kinds[3])
        lora_tensors, lora_spec = lora.fused_args(self.layer_idx) if lora is not None else (None, None)
        mlp_out = torch.ops.pagewire.decode_layer(
            hidden, delta, self.attn_norm, self.attn_post_norm, self.mlp_norm, self.mlp_post_norm, self.eps,
            self.residual_multiplier,
            _weight_data(self.qkv_weight), kinds[0], self.qkv_bias, self.q_norm, self.k_norm,
            _weight_data(self.o_weight), kinds[1], self.o_bias,
            _weight_data(self.gate_up_weight), gate_up_kind, self.gate_up_bias,
            _weight_data(self.down_weight), down_kind, self.down_bias,
            positions, rope.cos if rope is not None else None, rope.sin if rope is not None else None,
            self.qk_norm, key_cache, value_cache,
            meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            self.scale, self.sliding_window, meta.max_query_len, meta.max_seq_len,
            self.num_heads, self.num_kv_heads, self.head_dim, self.softcap, self.activation,
            self.v_norm, self.shares_kv, self.value_from_key, per_layer_input,
            self.ple_gate, kinds[4] if ple else "torch", self.ple_proj, kinds[5] if ple else "torch",
            self.ple_norm, self.layer_scalar, self.sinks, lora_tensors, lora_spec,
        )
        if self.moe is not None:
            return hidden, self._leave(self.moe(mlp_out), self.mlp_post_norm)
        return hidden, (None if self.finishes else mlp_out)

    def linear_kinds(self, dtype: torch.dtype, tokens: int) -> tuple[str, ...] | None:
        """Each matrix's path for `tokens` rows as ops.linear would take it, in MATRICES order, then
        the per-layer input block's gate and projection where the layer has one (None: one of them
        has no decode_layer equivalent, so this layer runs forward())."""
        kinds = [linear_kind(dtype, tokens, getattr(self, n), getattr(self, n.replace("weight", "bias")))
                 for n in self.MATRICES]
        if self.ple_gate is not None and self.ple_proj is not None:
            kinds += [linear_kind(dtype, tokens, self.ple_gate, None), linear_kind(dtype, tokens, self.ple_proj, None)]
        return None if None in kinds else tuple(cast(list[str], kinds))

    MATRICES: tuple[str, ...] = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")

    def lora_layout(self) -> dict[str, Slot]:
        """The PEFT modules a LoRA adapter may target in this layer and where each lands in the
        fused matrices (server.models.lora): q/k/v in qkv (k and v only where the layer projects
        its own), o, and gate/up/down where the MLP is dense."""
        H, q, kv = self.hidden_size, self.q_size, self.kv_size
        out = {"q_proj": Slot("qkv", 0, q, H), "o_proj": Slot("o", 0, H, q)}
        if not self.shares_kv:
            out["k_proj"] = Slot("qkv", q, kv, H)
            if not self.value_from_key:
                out["v_proj"] = Slot("qkv", q + kv, kv, H)
        if self.moe is None:
            I = self.down_weight.shape[1]
            out.update(gate_proj=Slot("gate_up", 0, I, H), up_proj=Slot("gate_up", I, I, H),
                       down_proj=Slot("down", 0, H, I))
        return out

    def quantize_weights(self, qtype: str) -> None:
        """Replace the four matrices by QuantizedWeight(qtype) (biases and norms stay as they are)."""
        for name in self.MATRICES:
            _replace_with_quantized(self, name, qtype)
        if self.moe is not None:
            self.moe.quantize_weights(qtype)

    def checkpoint_tensors(self, prefix: str) -> dict[str, WeightTarget]:
        """HF tensor names under `prefix` (e.g. "model.layers.3.") mapped to slices of the fused parameters."""
        q, kv, d, nh = self.q_size, self.kv_size, self.head_dim, self.num_heads
        assert isinstance(self.qkv_weight, torch.Tensor), "checkpoint_tensors: the layer is already quantised"
        I2, H = self.gate_up_weight.shape
        I = I2 // 2
        assert isinstance(self.o_weight, torch.Tensor) and isinstance(self.down_weight, torch.Tensor)
        assert isinstance(self.gate_up_weight, torch.Tensor)
        a, m = prefix + "self_attn.", prefix + "mlp."
        off = self.norm_offset
        t: dict[str, WeightTarget] = {a + "o_proj.weight": WeightTarget(self.o_weight, (H, q)),
                                      m + "down_proj.weight": WeightTarget(self.down_weight, (H, I))}
        # HF's norm names by placement: Llama's post_attention_layernorm is the MLP's input norm;
        # Gemma's and OLMo 2's is the attention output's.
        norms = {"input_layernorm": self.attn_norm,
                 "post_attention_layernorm": self.attn_post_norm if self.attn_post_norm is not None
                 else self.mlp_norm,
                 "pre_feedforward_layernorm": self.mlp_norm if self.attn_post_norm is not None else None,
                 "post_feedforward_layernorm": self.mlp_post_norm}
        for name, w in norms.items():
            if w is not None:
                t[prefix + name + ".weight"] = WeightTarget(w, (H,), off)
        if self.fused_checkpoint:  # Phi-3: one qkv_proj and one gate_up_proj, rows in our order
            t[a + "qkv_proj.weight"] = WeightTarget(self.qkv_weight, (q + 2 * kv, H))
            t[m + "gate_up_proj.weight"] = WeightTarget(self.gate_up_weight, (2 * I, H))
        else:
            t[a + "q_proj.weight"] = WeightTarget(self.qkv_weight[:q], (q, H))
            if not self.shares_kv:
                t[a + "k_proj.weight"] = WeightTarget(self.qkv_weight[q : q + kv], (kv, H))
            if not self.shares_kv and not self.value_from_key:
                t[a + "v_proj.weight"] = WeightTarget(self.qkv_weight[q + kv :], (kv, H))
            t[m + "gate_proj.weight"] = WeightTarget(self.gate_up_weight[:I], (I, H))
            t[m + "up_proj.weight"] = WeightTarget(self.gate_up_weight[I:], (I, H))
        if self.qkv_bias is not None:
            t[a + "q_proj.bias"] = WeightTarget(self.qkv_bias[:q], (q,))
            t[a + "k_proj.bias"] = WeightTarget(self.qkv_bias[q : q + kv], (kv,))
            t[a + "v_proj.bias"] = WeightTarget(self.qkv_bias[q + kv :], (kv,))
        if self.o_bias is not None:
            t[a + "o_proj.bias"] = WeightTarget(self.o_bias, (H,))
        if self.sinks is not None:
            t[a + "sinks"] = WeightTarget(self.sinks, (self.num_heads,))
        if self.qk_norm is not None:
            # A [d] checkpoint vector broadcasts over every head's row when copied in.
            t[a + "q_norm.weight"] = WeightTarget(self.qk_norm[:nh], (d,), off)
            if not self.shares_kv:
                t[a + "k_norm.weight"] = WeightTarget(self.qk_norm[nh:], (d,), off)
        if self.q_norm is not None and self.k_norm is not None:
            t[a + "q_norm.weight"] = WeightTarget(self.q_norm, (q,), off)
            t[a + "k_norm.weight"] = WeightTarget(self.k_norm, (kv,), off)
        if self.gate_up_bias is not None and self.down_bias is not None:
            t[m + "gate_proj.bias"] = WeightTarget(self.gate_up_bias[:I], (I,))
            t[m + "up_proj.bias"] = WeightTarget(self.gate_up_bias[I:], (I,))
            t[m + "down_proj.bias"] = WeightTarget(self.down_bias, (H,))
        if self.layer_scalar is not None:
            t[prefix + "layer_scalar"] = WeightTarget(self.layer_scalar, (1,))
        if self.ple_gate is not None and self.ple_proj is not None and self.ple_norm is not None:
            P = self.ple_gate.shape[0]
            t[prefix + "per_layer_input_gate.weight"] = WeightTarget(self.ple_gate, (P, H))
            t[prefix + "per_layer_projection.weight"] = WeightTarget(self.ple_proj, (H, P))
            t[prefix + "post_per_layer_input_norm.weight"] = WeightTarget(self.ple_norm, (H,), off)
        if self.moe is not None:  # the MLP's tensors are the router's and the experts'
            for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight", "gate_up_proj.weight"):
                t.pop(m + n, None)
            t.update(self.moe.checkpoint_tensors(prefix))
        return t


def _attach_moe(layer: DecoderLayer, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                device: torch.device) -> None:
    """Give DecoderLayer `layer` its sparse MLP when config says layer_idx is sparse: `layer.moe`
    (else None). A sparse layer has no dense gate_up/down (they become empty [0, H] / [H, 0]) and
    its MATRICES are the attention's only; fused, it runs decode_layer's attention half and then
    the MoE (forward_fused), except with gpt-oss's fp32-weight norm in bf16/fp16, which
    decode_layer's norms do not round as (the Python layer then)."""
    if config.mlp_kind(layer_idx) != "sparse":
        return
    H = config.hidden_size
    layer.moe = SparseMoE(config, dtype, device)
    layer.gate_up_weight = param((0, H), dtype, device)
    layer.down_weight = param((H, 0), dtype, device)
    layer.MATRICES = ("qkv_weight", "o_weight")
    layer.fusable = layer.fusable and not (config.norm_weight_fp32 and dtype != torch.float32)


def _enter(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None,
           eps: float, weight_fp32: bool = False) -> torch.Tensor:
    """A sub-block's input: the residual stream with `delta` (the previous sub-block's output)
    added in place, then RMSNorm'ed by `weight` (one fused op), or the stream itself when the
    block has no input norm (OLMo 2's post-norm layers). weight_fp32: gpt-oss's norm rounding."""
    if weight is None:
        return hidden if delta is None else hidden.add_(delta)
    if delta is None:
        return norm(hidden, weight, eps, weight_fp32)
    return add_norm(hidden, delta, weight, eps, weight_fp32)


class DecoderForCausalLM(nn.Module):
    """A decoder-only causal LM over a flat batch of new tokens and a paged KV cache; every
    architecture of server.models.families is this class with a different ModelConfig.

    Build it with `server.models.loader.load_model`; the constructor leaves weights uninitialised.
    dtype and device are fixed at construction (the RoPE tables and `dtype` attribute follow them),
    so load on the target device rather than calling `.to()` afterwards.
    Attributes the engine reads: `config`, `dtype`, `device`, `kv_cache_shape()`,
    `kv_cache_bytes_per_token()`.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        tie_word_embeddings: bool | None = None,
    ) -> None:
        """tie_word_embeddings overrides the config (the loader unties when a checkpoint marked
        tied still stores its own lm_head.weight, as transformers 5 does)."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c, dev = config, self.device
        # A tied bf16 table may be moved into the x8 layout after loading (interleave_bf16).
        self.embed_tokens: torch.Tensor | QuantizedWeight = param((c.vocab_size, c.hidden_size), dtype, dev)
        self.layers = nn.ModuleList(self._make_layer(c, i, dtype, dev) for i in range(c.num_layers))
        self.norm = param((c.hidden_size,), dtype, dev)
        # Per-layer input embeddings (Gemma 4): a token table of num_layers x P per token, and a
        # projection of the (scaled) embeddings to the same size, RMSNorm'ed per layer slice.
        P, L = c.per_layer_input_size, c.num_layers
        self.embed_tokens_per_layer = param((c.per_layer_vocab_size, L * P), dtype, dev) if P else None
        self.per_layer_projection = param((L * P, c.hidden_size), dtype, dev) if P else None
        self.per_layer_projection_norm = param((P,), dtype, dev) if P else None
        self._ple_scale = torch.tensor(P**0.5, dtype=dtype, device=dev) if P else None
        tied = c.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
        # Tied checkpoints store one matrix; the output projection reuses the embedding table.
        self.lm_head: torch.Tensor | QuantizedWeight = (
            self.embed_tokens if tied else param((c.vocab_size, c.hidden_size), dtype, dev)
        )
        # One table per distinct RoPE (Gemma 3: local and global bases); layers index into it.
        self.ropes = [RotaryEmbedding(r.rotary_dim, c.max_position_embeddings, r.theta, r.scaling, dev)
                      for r in c.ropes]
        self._longrope = any(r.long_offset for r in self.ropes)
        # Gemma scales embeddings by sqrt(hidden) rounded to the model dtype, Granite by its
        # embedding_multiplier.
        self._embed_scale = (torch.tensor(c.embedding_multiplier, dtype=dtype, device=dev)
                             if c.embedding_multiplier != 1.0 else None)
        # Plain list for the hot loop: iterating nn.ModuleList and calling modules via __call__
        # costs hook checks on every layer of every step.
        self._layers: list[DecoderLayer] = [cast(DecoderLayer, m) for m in self.layers]
        # Small CPU batches run each layer as one C++ call (_fused_kinds); False forces the Python
        # layers (bench/decode_step.py times both).
        self.fused_decode = True
        # (rows, id(autotune table), batch-invariant) -> (that table, each layer's linear kinds); weights are never
        # swapped after loading (quantize_weights runs before the first step), so kinds stay valid.
        self._fused_cache: dict[tuple[int, int, bool], tuple[object, list[tuple[str, ...] | None]]] = {}
        self.eval()

    def _make_layer(self, config: ModelConfig, i: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """Layer i (a hybrid model's subclass builds its recurrent layers here: models/lfm2.py)."""
        return DecoderLayer(config, i, dtype, device)

    def summary(self) -> str:
        """e.g. "Gemma3ForCausalLM: 26 layers (22 with a 512-token window, 4 full, 0 NoPE);
        fused decode_layer (CPU, up to 16 tokens) for 26 of 26; the others run the Python layers"."""
        c = self.config
        windows = [w for w in c.layer_sliding_windows if w is not None]
        kinds = f"{len(windows)} with a {max(windows)}-token window, " if windows else ""
        nope = sum(r is None for r in c.layer_ropes)
        fused = sum(layer.fusable for layer in self._layers)
        return (f"{c.architecture}: {c.num_layers} layers ({kinds}{c.num_layers - len(windows)} full, {nope} NoPE); "
                f"fused decode_layer (CPU, up to 16 tokens) for {fused} of {c.num_layers}; the others run the Python layers"
                + parameter_summary(self))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's key cache (and, separately, its value cache)."""
        return (num_blocks, self.config.num_kv_heads, block_size, self.config.head_dim)

    def kv_cache_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers that write their own, at the model's dtype."""
        c = self.config
        elems = sum(c.kv_heads_of(i) * c.head_dim_of(i) for i in range(c.num_layers) if c.kv_source(i) == i)
        return 2 * elems * torch.empty((), dtype=self.dtype).element_size()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """Run the new tokens of every scheduled sequence through the model, writing their K/V.

        Args:
            input_ids: int64 [T], the flat batch (no padding), sequences in query_start_loc order.
            positions: int64 [T], each token's position in its sequence (< max_position_embeddings).
            kv_caches: per layer (key_cache, value_cache), each kv_cache_shape(num_blocks, block_size);
                layers of different KV groups may share tensors (their blocks never overlap).
            meta: where each token's K/V is written and which blocks each sequence reads (per
                layer: meta.for_layer(i)).
            lora: the step's LoRA terms (server.models.lora.LoraSet.step), None when no row uses
                an adapter. A step with one runs the Python layers: pagewire::decode_layer has no
                low-rank term, so the fused path is taken only by steps without adapter rows.
        Returns:
            [T, hidden_size] final-normed hidden states; pass the rows to sample to compute_logits.
        """
        if len(kv_caches) != len(self._layers):
            raise ValueError(f"kv_caches: expected {len(self._layers)} (key, value) pairs, got {len(kv_caches)}")
        hidden = embedding(input_ids, self.embed_tokens, self.dtype)
        if self._embed_scale is not None:
            hidden = hidden * self._embed_scale
        context_lens = self._context_lens(positions, meta) if self._longrope else None
        batches = [rope.prepare(positions, self.dtype, context_lens) for rope in self.ropes]
        per_layer = self._per_layer_inputs(input_ids, hidden)  # [T, L, P] or None
        delta: torch.Tensor | None = None
        # A step with LoRA rows stays fused when its terms are stacked (decode_layer adds them);
        # deterministic mode's per-adapter terms run the Python layers.
        fused = self._fused_kinds(hidden, batches) if lora is None or lora.fusable else None
        for i, (layer, (key_cache, value_cache)) in enumerate(zip(self._layers, kv_caches)):
            r = layer.rope_index
            rope, batch = (self.ropes[r], batches[r]) if r is not None else (None, None)
            kinds = fused[i] if fused is not None else None
            m = meta.for_layer(i)  # the layer's KV group's slots and block tables
            ple = per_layer[:, i] if per_layer is not None else None
            if kinds is not None:
                rows = batch.positions if batch is not None else positions
                hidden, delta = layer.forward_fused(hidden, delta, rope, rows, key_cache, value_cache, m, kinds, ple,
                                                    lora)
            else:
                hidden, delta = layer.forward(hidden, delta, rope, batch, key_cache, value_cache, m, ple, lora)
        eps, fp32 = self.config.rms_norm_eps, self.config.norm_weight_fp32
        return norm(hidden, self.norm, eps, fp32) if delta is None else add_norm(hidden, delta, self.norm, eps, fp32)

    def _per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor | None:
        """Gemma 4's per-layer inputs [T, L, P], as transformers' get_per_layer_inputs and
        project_per_layer_inputs compute them: (norm(embeds @ W * H^-0.5) + table[ids] * sqrt(P)) / sqrt(2)."""
        if self.embed_tokens_per_layer is None or self.per_layer_projection is None:
            return None
        assert self.per_layer_projection_norm is not None and self._ple_scale is not None
        c, T = self.config, input_ids.shape[0]
        shape = (T, c.num_layers, c.per_layer_input_size)
        tokens = (F.embedding(input_ids, self.embed_tokens_per_layer) * self._ple_scale).view(shape)
        proj = (linear(embeds, self.per_layer_projection) * c.hidden_size**-0.5).view(shape)
        proj = rms_norm(proj, self.per_layer_projection_norm, c.rms_norm_eps)
        return (proj + tokens) * 2.0**-0.5

    @staticmethod
    def _context_lens(positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Per token, max(its sequence's prompt length, position + 1): what longrope's table
        choice reads (RotaryEmbedding.long_rows)."""
        q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
        prompt = meta.prompt_lens if meta.prompt_lens is not None else meta.seq_lens
        per_token = torch.repeat_interleave(prompt.to(positions.dtype), q_lens)
        return torch.maximum(per_token, positions + 1)

    def _fused_kinds(self, hidden: torch.Tensor, batches: list[RopeBatch]) -> list[tuple[str, ...] | None] | None:
        """Per layer, the linear paths for pagewire::decode_layer, or None where the layer must run
        in Python: a layer the C++ layer cannot express (DecoderLayer.fusable), always off the CPU,
        above 16 tokens (quantised weights switch paths there), with RoPE tables gathered in
        Python, when `fused_decode` is off, or when this module's `linear` has been replaced
        (tests and bench/decode_step.py wrap it to see every call). Cached per row count,
        autotune table and batch-invariant mode: the rules only change with those."""
        T = hidden.shape[0]
        if (not self.fused_decode or hidden.device.type != "cpu" or T > Q8_KERNEL_MAX_ROWS
                or any(b.cos is not None for b in batches) or linear is not _LINEAR):
            return None
        table = autotune.active_table()
        key = (T, id(table), batch_invariant.enabled())
        cached = self._fused_cache.get(key)
        if cached is None or cached[0] is not table:
            cached = (table, [layer.linear_kinds(self.dtype, T) if layer.fusable else None for layer in self._layers])
            self._fused_cache[key] = cached
        return cached[1]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Args: hidden [S, hidden_size] rows from forward(). Returns float32 logits [S, vocab_size]."""
        logits = linear(hidden, self.lm_head)
        c = self.config
        if c.logits_divisor != 1.0:  # Granite's logits_scaling
            logits = logits / c.logits_divisor
        if c.final_logit_softcap:  # Gemma 2, in transformers' order
            logits = torch.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
        return logits.float()

    def quantize_weights(self, quantization: str) -> None:
        """Keep every decoder matrix and the output projection quantised (`quantization` is a key
        of QUANTIZATIONS, e.g. "int8" -> GGUF Q8_0 blocks). The embedding table stays in the model
        dtype (only the rows of this step's tokens are read); a tied lm_head gets its own
        quantised copy, since projecting reads the whole matrix every step."""
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
        if self.device.type != "cpu":
            raise ValueError(f"quantization: {quantization!r} runs on CPU only, the model is on {self.device}")
        qtype = QUANTIZATIONS[quantization]
        for layer in self._layers:
            layer.quantize_weights(qtype)
        _replace_with_quantized(self, "lm_head", qtype)
        self._fused_cache.clear()  # the layers' linear kinds changed

    def interleave_bf16(self) -> None:
        """On CPUs whose kernels are the AVX2 family, move every bf16 decoder matrix and the lm_head
        with rows of at most BF16_X8_MAX_K values into the x8 layout (QuantizedWeight.from_bf16),
        which pagewire::linear_bf16x8 streams as one sequence: the same floats as the row-layout
        kernel, bit for bit, at up to 1.6x its decode bandwidth on short rows (bench/RESULTS.md,
        session 18). The memory is the same: each matrix is moved, not copied. A tied lm_head is the
        embedding table: the table itself is moved, and ops.embedding gathers its rows from it."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or cpu_isa() != "avx2":
            return
        for layer in self._layers:
            if isinstance(layer, DecoderLayer):
                for name in layer.MATRICES:
                    _replace_with_bf16x8(layer, name)
        if self.lm_head is not self.embed_tokens:
            _replace_with_bf16x8(self, "lm_head")
        else:  # tied: one moved table, its rows gathered by ops.embedding, the whole projected by lm_head
            _replace_with_bf16x8(self, "embed_tokens")
            self._parameters.pop("lm_head", None)  # (registered under both names when tied)
            self.lm_head = self.embed_tokens
        self._fused_cache.clear()  # the layers' linear kinds changed

    def linear_weights(self) -> list[tuple[str, torch.Tensor | QuantizedWeight | QuantizedParts]]:
        """Every weight the forward and compute_logits pass to `linear`, named by role (for the
        start-up autotune, server.kernels.autotune)."""
        out: list[tuple[str, torch.Tensor | QuantizedWeight | QuantizedParts]] = []
        for layer in self._layers:
            out += [("qkv", layer.qkv_weight), ("o", layer.o_weight)]
            if layer.moe is None:
                out += [("gate_up", layer.gate_up_weight), ("down", layer.down_weight)]
            else:
                out += layer.moe.linear_weights()
        out.append(("lm_head", self.lm_head))
        return out

    def lora_layout(self) -> list[dict[str, Slot]]:
        """Per layer, the modules a LoRA adapter may target and where they land (server.models.lora)."""
        return [layer.lora_layout() for layer in self._layers]

    def tie_lm_head(self) -> None:
        """Drop the separate lm_head and project with the embedding table (frees vocab x hidden)."""
        self.lm_head = self.embed_tokens

    def checkpoint_tensors(self) -> dict[str, WeightTarget]:
        """Every Hugging Face tensor name this model needs, mapped to where it is copied."""
        c = self.config
        assert isinstance(self.embed_tokens, torch.Tensor), "checkpoint_tensors: the table is already moved"
        targets = {
            "model.embed_tokens.weight": WeightTarget(self.embed_tokens, (c.vocab_size, c.hidden_size)),
            "model.norm.weight": WeightTarget(self.norm, (c.hidden_size,), c.norm_weight_offset),
        }
        if self.lm_head is not self.embed_tokens:
            assert isinstance(self.lm_head, torch.Tensor), "checkpoint_tensors: the model is already quantised"
            targets["lm_head.weight"] = WeightTarget(self.lm_head, (c.vocab_size, c.hidden_size))
        for i, layer in enumerate(self._layers):
            targets.update(layer.checkpoint_tensors(f"model.layers.{i}."))
        if self.embed_tokens_per_layer is not None and self.per_layer_projection is not None:
            assert self.per_layer_projection_norm is not None
            targets["model.embed_tokens_per_layer.weight"] = WeightTarget(
                self.embed_tokens_per_layer, tuple(self.embed_tokens_per_layer.shape))
            targets["model.per_layer_model_projection.weight"] = WeightTarget(
                self.per_layer_projection, tuple(self.per_layer_projection.shape))
            targets["model.per_layer_projection_norm.weight"] = WeightTarget(
                self.per_layer_projection_norm, (c.per_layer_input_size,), c.norm_weight_offset)
        return targets

    @property
    def ignored_checkpoint_prefixes(self) -> tuple[str, ...]:
        """Checkpoint layers past the model's (ModelConfig.checkpoint_extra_layers: GLM-4.5's MTP
        layers) and other parts it does not run (checkpoint_skipped_prefixes: Ernie 4.5's MTP head)."""
        n = self.config.num_layers
        extra = tuple(f"model.layers.{n + i}." for i in range(self.config.checkpoint_extra_layers))
        return extra + self.config.checkpoint_skipped_prefixes

    def ignored_checkpoint_tensors(self) -> frozenset[str]:
        """Tensors a checkpoint may hold that this model has no use for: the K/V projections and
        key norm of layers that read another layer's KV (Gemma 4 checkpoints keep them; transformers
        ignores them too)."""
        names = ("k_proj.weight", "v_proj.weight", "k_norm.weight", "k_proj.bias", "v_proj.bias")
        return frozenset(f"model.layers.{i}.self_attn.{n}" for i, layer in enumerate(self._layers)
                         if getattr(layer, "shares_kv", False) for n in names)  # recurrent layers have no KV



def _replace_with_quantized(module: nn.Module, name: str, qtype: str) -> None:
    """module.<name> (a parameter, or an attribute aliasing one) becomes its QuantizedWeight."""
    weight = getattr(module, name)
    if isinstance(weight, QuantizedWeight):
        return
    quantized = QuantizedWeight.quantize(weight, qtype).for_kernels()  # this CPU's fastest layout
    # A registered parameter can only be reassigned to a Parameter: unregister it first, so the
    # quantised container becomes a plain attribute and the float matrix is freed.
    module._parameters.pop(name, None)
    setattr(module, name, quantized)


# The widest rows the x8 layout pays for. The row-layout kernel reads eight rows side by side, each
# a stream of K * 2 bytes: short rows (SmolLM2's 576, 1,152 bytes) end before the hardware prefetcher
# is up to speed, and there one sequential stream moved 1.2-1.4x the bytes at M = 1; from K = 1536
# the eight row streams kept up (1.0x) and at K = 5632 beat it (0.8x). bench/RESULTS.md, session 18.
BF16_X8_MAX_K = 1024


def _replace_with_bf16x8(module: nn.Module, name: str) -> None:
    """module.<name>, a bf16 matrix, becomes its x8 QuantizedWeight where the layout applies and
    pays (at least one group of eight rows, K a multiple of 16 and at most BF16_X8_MAX_K); anything
    else stays as it is."""
    weight = getattr(module, name)
    if (not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16 or weight.dim() != 2
            or weight.shape[0] < 8 or weight.shape[1] == 0 or weight.shape[1] % 16
            or weight.shape[1] > BF16_X8_MAX_K):
        return
    moved = QuantizedWeight.from_bf16(weight)
    module._parameters.pop(name, None)  # as _replace_with_quantized: the row-layout matrix is freed
    setattr(module, name, moved)


def _weight_data(weight: torch.Tensor | QuantizedWeight | QuantizedParts) -> torch.Tensor:
    """The tensor a linear kind reads: the float matrix, or a QuantizedWeight's (QuantizedParts')
    block bytes."""
    return weight if isinstance(weight, torch.Tensor) else weight.data


# This module's `linear` as imported: _fused_kinds steps aside when something has replaced it.
_LINEAR = linear
