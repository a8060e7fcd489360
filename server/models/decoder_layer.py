"""DecoderLayer: one decoder block of DecoderForCausalLM (server.models.decoder), built from the
parts ModelConfig names, and the helpers it and the hybrid models' layers share.

It owns the layer's fused parameters and where each Hugging Face tensor lands in them
(`checkpoint_tensors`), its Python forward (attention over the paged cache, then a gated MLP or a
sparse MoE, norms where `norm_placement` puts them, Gemma 4's end of layer), the same layer as one
pagewire::decode_layer call (`forward_fused`, for the layers `fusable` names) with each matrix's
linear path for it (`linear_kinds`), its LoRA layout and in-place quantisation. Helpers: `_enter`
(a sub-block's input: residual add + norm), `_replace_with_quantized` (a matrix becomes its
QuantizedWeight) and `_weight_data` (the tensor a linear kind reads), which models/lfm2.py and
models/qwen3_next.py use too.
"""
from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from server.kernels.linear_route import linear, linear_kind
from server.kernels.ops import DecodeStack, paged_attention, write_kv_cache
from server.kernels.quant import QuantizedWeight
from server.kernels.quant_parts import QuantizedParts
from server.models.attention import AttentionMetadata
from server.models.config import ModelConfig
from server.models.layers import add_norm, gelu_tanh_and_mul, norm, rms_norm, silu_and_mul
from server.models.lora import LoraStep, Slot
from server.models.moe import SparseMoE
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
        # projection or per head (also on a NoPE or partial-rotary layer, GLM-4.5's with
        # use_qk_norm: the same torch-op norm as forward() there), full, partial or no RoPE,
        # residual multipliers, SiLU or GELU-tanh, soft-capping or not, and Gemma 4's parts (KV read
        # from another layer, values from the key projection, the value norm, the per-layer input
        # block, the layer scalar). Not a projection q/k norm on a layer with no keys of its own (no
        # family has one): that runs forward().
        self.fusable = not (self.shares_kv and self.q_norm is not None)
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
        path (linear_route.linear_kind), in MATRICES order, then the per-layer input block's gate and
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

    def stackable(self) -> bool:
        """Whether this layer can join a pagewire DecodeStack (DecoderForCausalLM._decode_stack):
        this class's forward_fused (not a subclass's), without a per-layer input block (its input
        is per step), and a sparse layer only without a layer scalar (forward_fused ends such a
        layer in Python)."""
        return (type(self) is DecoderLayer and self.ple_gate is None
                and not (self.moe is not None and self.layer_scalar is not None))

    def add_to_stack(self, stack: DecodeStack, rope: RotaryEmbedding | None, kinds: tuple[str, ...],
                     key_cache: torch.Tensor, value_cache: torch.Tensor,
                     moe_kinds: tuple[str, str, str, str] | None) -> None:
        """Append this layer's static forward_fused arguments to a DecodeStack
        (csrc/cpu/decode_stack.cpp), in decode_layer's order; a sparse layer also its
        SparseMoE._decode arguments (moe_kinds: SparseMoE.decode_kinds); rope: this layer's table
        (None: NoPE), whose rows run() takes per table index. The stack then runs the same ops in
        the same order as forward_fused, so the same floats."""
        gate_up_kind, down_kind = ("none", "none") if self.moe is not None else (kinds[2], kinds[3])
        stack.add_layer(
            self.attn_norm, self.attn_post_norm, self.mlp_norm, self.mlp_post_norm, self.eps, self.residual_multiplier,
            _weight_data(self.qkv_weight), kinds[0], self.qkv_bias, self.q_norm, self.k_norm,
            _weight_data(self.o_weight), kinds[1], self.o_bias,
            _weight_data(self.gate_up_weight), gate_up_kind, self.gate_up_bias,
            _weight_data(self.down_weight), down_kind, self.down_bias,
            -1 if self.rope_index is None else self.rope_index, rope.cos if rope is not None else None,
            rope.sin if rope is not None else None, self.qk_norm, key_cache, value_cache,
            self.scale, self.sliding_window, self.num_heads, self.num_kv_heads, self.head_dim, self.softcap,
            self.activation, self.v_norm, self.shares_kv, self.value_from_key, self.layer_scalar, self.sinks)
        if self.moe is not None:
            assert moe_kinds is not None, "add_to_stack: a sparse layer needs its router's kinds"
            self.moe.add_to_stack(stack, moe_kinds)

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


def _weight_data(weight: torch.Tensor | QuantizedWeight | QuantizedParts) -> torch.Tensor:
    """The tensor a linear kind reads: the float matrix, or a QuantizedWeight's (QuantizedParts')
    block bytes."""
    return weight if isinstance(weight, torch.Tensor) else weight.data
