"""Qwen3NextForCausalLM: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE, hybrids of Gated DeltaNet
(linear-attention) layers and gated full-attention layers, three of the first to one of the second.

* A linear-attention layer (`GdnLayer`) is norm -> GatedDeltaNet (server/models/gated_deltanet.py)
  -> add -> norm -> MLP (dense, or the sparse MoE with its sigmoid-gated shared expert). Its conv
  and recurrent states live in the engine's state cache (StateSpec "conv" and "recurrent",
  server/models/state_specs.py), handed in through `meta.state`.
* A full-attention layer (`GatedAttentionLayer`) is the shared DecoderLayer's attention (per-head
  q/k RMSNorm, partial rotary: the leading `partial_rotary_factor` of each head rotates) with
  transformers' output gate: q_proj yields a query and a gate per head, and the attention output
  is multiplied by sigmoid(gate) before o_proj. The gate rows are appended to the fused qkv matrix.
* Every RMSNorm but the DeltaNet's gated one scales by 1 + w (norm_weight_offset 1).
Only the attention layers have KV caches: `kv_caches` and `meta.for_layer` are indexed by a
layer's place among them, as for LFM2 (server/models/lfm2.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, cast

import torch
from torch import nn

from server.inference_mode import hot_inference_mode
from server.kernels import gdn
from server.kernels.linear_route import embedding, linear, linear_kind
from server.kernels.ops import paged_attention, write_kv_cache
from server.kernels.quant import QuantizedWeight
from server.kernels.quant_parts import QuantizedParts
from server.models.attention import AttentionMetadata
from server.models.config import ModelConfig
from server.models.decoder import DecoderForCausalLM
from server.models.decoder_layer import DecoderLayer, _enter, _replace_with_quantized, _weight_data
from server.models.gated_deltanet import GatedDeltaNet, GdnShape
from server.models.layers import add_norm, norm, rms_norm, silu_and_mul
from server.models.moe import SparseMoE, parameter_summary
from server.models.rope import RopeBatch, RotaryEmbedding
from server.models.state_specs import attention_layers
from server.models.weights import WeightTarget, param

if TYPE_CHECKING:
    from server.models.lora import LoraStep


def gdn_shape(c: ModelConfig) -> GdnShape:
    """The config's Gated DeltaNet sizes (every linear-attention layer has the same)."""
    return GdnShape(c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                    c.linear_value_head_dim, c.conv_kernel, c.rms_norm_eps, c.gdn_checkpoint)


class GatedAttentionLayer(DecoderLayer):
    """DecoderLayer whose qkv matrix has the output gate's rows appended ([q, k, v, gate]) and whose
    attention output is multiplied by sigmoid(gate). decode_layer has no gate, so small CPU batches
    run it as pagewire::gated_attention_decode_layer instead (forward_decode), when the MLP is dense."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, layer_idx, dtype, device)
        H = config.hidden_size
        self.qkv_weight = param((2 * self.q_size + 2 * self.kv_size, H), dtype, device)
        # What gated_attention_decode_layer expresses: per-head q/k norm, RoPE, no softcap, sinks or MoE.
        self.fusable = (self.moe is None and self.qk_norm is not None and self.rope_index is not None
                        and not self.softcap and self.sinks is None)

    def forward(self, hidden: torch.Tensor, delta: torch.Tensor | None, rope: RotaryEmbedding | None,
                rope_batch: RopeBatch | None, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, per_layer_input: torch.Tensor | None = None,
                lora: LoraStep | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As DecoderLayer.forward (the same arguments and result; no LoRA term: see the model's forward)."""
        T = hidden.shape[0]
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, kv = self.q_size, self.kv_size
        x = _enter(hidden, delta, self.attn_norm, self.eps)
        qkv = linear(x, self.qkv_weight, self.qkv_bias)  # [T, q + 2 kv + q]
        qk = qkv[:, : q + kv].view(T, nh + nkv, d)
        if self.qk_norm is not None:
            qk.copy_(rms_norm(qk, self.qk_norm, self.eps))
        if rope is not None and rope_batch is not None:  # the leading rotary_dim of each head
            rope.rotate_(qk if self.rotary_dim == d else qk[..., : self.rotary_dim], rope_batch)
        write_kv_cache(qk[:, nh:], qkv[:, q + kv : q + 2 * kv].view(T, nkv, d), key_cache, value_cache,
                       meta.slot_mapping)
        attn = torch.empty((T, nh, d), dtype=hidden.dtype, device=hidden.device)
        paged_attention(attn, qk[:, :nh], key_cache, value_cache, meta.block_tables, meta.seq_lens,
                        meta.query_start_loc, self.scale, self.sliding_window, meta.max_query_len, meta.max_seq_len,
                        self.softcap, self.sinks)
        gated = attn.view(T, q) * torch.sigmoid(qkv[:, q + 2 * kv :])
        x = _enter(hidden, linear(gated, self.o_weight, self.o_bias), self.mlp_norm, self.eps)
        if self.moe is not None:
            return hidden, self.moe(x)
        return hidden, linear(silu_and_mul(linear(x, self.gate_up_weight, self.gate_up_bias)), self.down_weight,
                              self.down_bias)

    def forward_decode(self, hidden: torch.Tensor, delta: torch.Tensor | None, rope: RotaryEmbedding,
                       positions: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       meta: AttentionMetadata, kinds: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() in one C++ call (the same ops in the same order, so the same floats) for CPU
        batches of at most 16 tokens; positions: the rows of rope's tables (RopeBatch.positions);
        kinds: linear_kinds(), for qkv, o, gate_up and down."""
        args = self.decode_args(hidden, delta, rope, positions, key_cache, value_cache, meta, kinds)
        return hidden, torch.ops.pagewire.gated_attention_decode_layer(*args)

    def decode_args(self, hidden: torch.Tensor, delta: torch.Tensor | None, rope: RotaryEmbedding,
                    positions: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, kinds: tuple[str, ...]) -> tuple[object, ...]:
        """pagewire::gated_attention_decode_layer's arguments for forward_decode's."""
        assert self.qk_norm is not None
        return (hidden, delta, self.attn_norm, self.mlp_norm, self.eps, _weight_data(self.qkv_weight), kinds[0],
                self.qk_norm, _weight_data(self.o_weight), kinds[1], _weight_data(self.gate_up_weight), kinds[2],
                _weight_data(self.down_weight), kinds[3], positions, rope.cos, rope.sin, key_cache, value_cache,
                meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale,
                self.sliding_window, meta.max_query_len, meta.max_seq_len, self.num_heads, self.num_kv_heads,
                self.head_dim)

    def checkpoint_tensors(self, prefix: str) -> dict[str, WeightTarget]:
        """DecoderLayer's names, with q_proj [nh x (query, gate), H] split into the query rows and
        the gate rows at the end of qkv (one strided view over both)."""
        t = super().checkpoint_tensors(prefix)
        w = self.qkv_weight
        assert isinstance(w, torch.Tensor), "checkpoint_tensors: the layer is already quantised"
        nh, d, H = self.num_heads, self.head_dim, w.shape[1]
        both = w.as_strided((2, nh, d, H), ((self.q_size + 2 * self.kv_size) * H, d * H, H, 1), w.storage_offset())
        q, kv = self.q_size, self.kv_size
        t[prefix + "self_attn.q_proj.weight"] = WeightTarget(
            both, (2 * q, H), convert=lambda x: x.reshape(nh, 2, d, H).transpose(0, 1))
        t[prefix + "self_attn.v_proj.weight"] = WeightTarget(w[q + kv : q + 2 * kv], (kv, H))
        return t


class GdnLayer(nn.Module):
    """One linear-attention layer: input norm, GatedDeltaNet, residual, post-attention norm, MLP
    (its output left for the next layer's norm to add, as DecoderLayer does)."""

    rope_index: Optional[int] = None
    shares_kv = False  # read by DecoderForCausalLM.ignored_checkpoint_tensors

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c = config
        H, I = c.hidden_size, c.intermediate_of(layer_idx)
        self.layer_idx = layer_idx
        self.eps = c.rms_norm_eps
        self.norm_offset = c.norm_weight_offset
        self.attn_norm = param((H,), dtype, device)
        self.mlp_norm = param((H,), dtype, device)
        self.gdn = GatedDeltaNet(gdn_shape(c), dtype, device)
        self.moe: SparseMoE | None = SparseMoE(c, dtype, device) if c.mlp_kind(layer_idx) == "sparse" else None
        dense = self.moe is None
        self.gate_up_weight: torch.Tensor | QuantizedWeight | QuantizedParts = param((2 * I if dense else 0, H), dtype, device)
        self.down_weight: torch.Tensor | QuantizedWeight = param((H, I if dense else 0), dtype, device)
        self.fusable = dense  # pagewire::gdn_decode_layer has the dense MLP only

    def forward(self, hidden: torch.Tensor, delta: torch.Tensor | None, meta: AttentionMetadata,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] (updated in place), delta: the previous layer's MLP output not yet added;
        meta.state: this layer's "conv" and "recurrent" pools and the batch's slots."""
        state = meta.state
        assert state is not None, "meta.state: a Gated DeltaNet layer needs its state slots"
        pools = state.layers[self.layer_idx]
        x = _enter(hidden, delta, self.attn_norm, self.eps)
        out = self.gdn(x, pools["conv"], pools["recurrent"], state.slots, meta.query_start_loc)
        x = _enter(hidden, out, self.mlp_norm, self.eps)
        if self.moe is not None:
            return hidden, self.moe(x)
        return hidden, linear(silu_and_mul(linear(x, self.gate_up_weight)), self.down_weight)

    def forward_decode(self, hidden: torch.Tensor, delta: torch.Tensor | None, meta: AttentionMetadata,
                       kinds: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() in one C++ call, pagewire::gdn_decode_layer (the same ops in the same order, so
        the same floats), for CPU batches of at most 16 tokens; kinds: linear_kinds()."""
        return hidden, torch.ops.pagewire.gdn_decode_layer(*self.decode_args(hidden, delta, meta, kinds))

    def decode_args(self, hidden: torch.Tensor, delta: torch.Tensor | None, meta: AttentionMetadata,
                    kinds: tuple[str, ...]) -> tuple[object, ...]:
        """pagewire::gdn_decode_layer's arguments for forward_decode's."""
        state = meta.state
        assert state is not None, "meta.state: a Gated DeltaNet layer needs its state slots"
        pools = state.layers[self.layer_idx]
        g, s = self.gdn, self.gdn.shape
        return (hidden, delta, self.attn_norm, self.mlp_norm, self.eps, _weight_data(g.in_proj), kinds[0],
                g.conv_weight_f32(), g.A_log, g.dt_bias, g.norm_weight, s.eps, _weight_data(g.out_proj), kinds[1],
                _weight_data(self.gate_up_weight), kinds[2], _weight_data(self.down_weight), kinds[3], pools["conv"],
                pools["recurrent"], state.slots, meta.query_start_loc, s.num_key_heads, s.num_value_heads,
                s.key_head_dim, s.value_head_dim, gdn.CHUNK_SIZE, g.out_columns)

    def linear_kinds(self, dtype: torch.dtype, tokens: int) -> tuple[str, ...] | None:
        """Each matrix's path for `tokens` rows as ops.linear would take it (in_proj, out_proj,
        gate_up, down); None where one has no fused equivalent (this layer then runs forward())."""
        kinds = [linear_kind(dtype, tokens, w, None)
                 for w in (self.gdn.in_proj, self.gdn.out_proj, self.gate_up_weight, self.down_weight)]
        return None if None in kinds else tuple(cast(list[str], kinds))

    def quantize_weights(self, qtype: str) -> None:
        _replace_with_quantized(self.gdn, "in_proj", qtype)
        _replace_with_quantized(self.gdn, "out_proj", qtype)
        if self.moe is not None:
            self.moe.quantize_weights(qtype)
        else:
            _replace_with_quantized(self, "gate_up_weight", qtype)
            _replace_with_quantized(self, "down_weight", qtype)

    def checkpoint_tensors(self, prefix: str) -> dict[str, WeightTarget]:
        H = self.attn_norm.shape[0]
        t = {prefix + "input_layernorm.weight": WeightTarget(self.attn_norm, (H,), self.norm_offset),
             prefix + "post_attention_layernorm.weight": WeightTarget(self.mlp_norm, (H,), self.norm_offset)}
        t.update(self.gdn.checkpoint_tensors(prefix + "linear_attn."))
        if self.moe is not None:
            t.update(self.moe.checkpoint_tensors(prefix))
            return t
        gu, dn = self.gate_up_weight, self.down_weight
        assert isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor)
        I, m = dn.shape[1], prefix + "mlp."
        t[m + "gate_proj.weight"] = WeightTarget(gu[:I], (I, H))
        t[m + "up_proj.weight"] = WeightTarget(gu[I:], (I, H))
        t[m + "down_proj.weight"] = WeightTarget(dn, (H, I))
        return t


class Qwen3NextForCausalLM(DecoderForCausalLM):
    """DecoderForCausalLM whose linear-attention layers are GdnLayers and whose attention layers
    are GatedAttentionLayers; KV caches (and per-layer metadata) cover the attention layers only."""

    # The checkpoints' multi-token-prediction head (transformers skips it too): not run here.
    ignored_checkpoint_prefixes = ("mtp.",)

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                 tie_word_embeddings: bool | None = None) -> None:
        super().__init__(config, dtype, device, tie_word_embeddings)
        attn = attention_layers(config)
        self._kv_index: list[Optional[int]] = [attn.index(i) if i in attn else None for i in range(config.num_layers)]
        # Small CPU batches run each layer with a dense MLP as one C++ call (forward_decode: the
        # Gated DeltaNet and gated-attention layer ops); False forces the Python layers.
        self.fused_decode = True

    def _make_layer(self, config: ModelConfig, i: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if config.layer_types[i] == "attention":
            return GatedAttentionLayer(config, i, dtype, device)
        return GdnLayer(config, i, dtype, device)

    def summary(self) -> str:
        c = self.config
        n_attn = sum(i is not None for i in self._kv_index)
        fused = sum(layer.fusable for layer in self._layers)
        return (f"{c.architecture}: {c.num_layers} layers ({n_attn} gated full attention, {c.num_layers - n_attn} "
                f"Gated DeltaNet); fused decode layers (CPU, up to 16 tokens) for {fused} of {c.num_layers}, "
                f"the others run the Python layers" + parameter_summary(self))

    def kv_cache_bytes_per_token(self) -> int:
        c = self.config
        elems = sum(c.kv_heads_of(i) * c.head_dim_of(i) for i in attention_layers(c))
        return 2 * elems * torch.empty((), dtype=self.dtype).element_size()

    @hot_inference_mode
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                lora: LoraStep | None = None) -> torch.Tensor:
        """As DecoderForCausalLM.forward, with kv_caches (and meta.for_layer) per attention layer and
        meta.state holding the Gated DeltaNet layers' state slots."""
        if lora is not None:  # the hybrid layers have no low-rank path yet (issue 30 meets issue 28)
            raise ValueError("LoRA adapters are not supported on hybrid (recurrent-state) models")
        n_attn = sum(i is not None for i in self._kv_index)
        if len(kv_caches) != n_attn:
            raise ValueError(f"kv_caches: expected {n_attn} (key, value) pairs (the attention layers), "
                             f"got {len(kv_caches)}")
        if meta.state is None:
            raise ValueError("meta.state: the Gated DeltaNet layers need their state slots (StateBatch)")
        hidden = embedding(input_ids, self.embed_tokens, self.dtype)
        batches = [rope.prepare(positions, self.dtype, None) for rope in self.ropes]
        delta: torch.Tensor | None = None
        fused = self._fused_kinds(hidden, batches)
        for i, layer in enumerate(self._layers):
            a = self._kv_index[i]
            kinds = fused[i] if fused is not None else None
            if a is None:
                gdn_layer = cast(GdnLayer, layer)
                hidden, delta = (gdn_layer.forward_decode(hidden, delta, meta, kinds) if kinds is not None
                                 else gdn_layer(hidden, delta, meta))
                continue
            r = layer.rope_index
            rope, batch = (self.ropes[r], batches[r]) if r is not None else (None, None)
            key_cache, value_cache = kv_caches[a]
            if kinds is not None and rope is not None and batch is not None:
                hidden, delta = cast(GatedAttentionLayer, layer).forward_decode(
                    hidden, delta, rope, batch.positions, key_cache, value_cache, meta.for_layer(a), kinds)
                continue
            hidden, delta = layer.forward(hidden, delta, rope, batch, key_cache, value_cache, meta.for_layer(a))
        eps = self.config.rms_norm_eps
        return norm(hidden, self.norm, eps) if delta is None else add_norm(hidden, delta, self.norm, eps)

    def linear_weights(self) -> list[tuple[str, torch.Tensor | QuantizedWeight | QuantizedParts]]:
        out: list[tuple[str, torch.Tensor | QuantizedWeight | QuantizedParts]] = []
        for layer in self._layers:
            if isinstance(layer, GdnLayer):
                out += layer.gdn.linear_weights()
            else:
                out += [("qkv", layer.qkv_weight), ("o", layer.o_weight)]
            if layer.moe is not None:
                out += layer.moe.linear_weights()
            else:
                out += [("gate_up", layer.gate_up_weight), ("down", layer.down_weight)]
        out.append(("lm_head", self.lm_head))
        return out
