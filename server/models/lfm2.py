"""Lfm2ForCausalLM: LFM2, a hybrid of gated short-convolution layers and full-attention layers.

The attention layers are the shared DecoderLayer (Qwen3's parts: per-head q/k norm, NeoX RoPE;
they run fused in C++ for small batches like any family's). A convolution layer
(`ShortConvLayer`) replaces attention with transformers' Lfm2ShortConv:

    B, C, x = in_proj(norm(h)).chunk(3);  y = C * causal_conv1d(B * x);  h += out_proj(y)

then the same gated MLP. The convolution keeps its last K - 1 inputs per sequence in the state
cache (StateSpec "conv" [K - 1, H], server/models/state_specs.py) and runs as one C++ op over the
whole flat batch (`pagewire::short_conv`: the gate, the convolution over each sequence's new rows
continuing from its slot, the state update). Only the attention layers have a KV cache: the
runner hands `kv_caches` and per-layer metadata for those, in order.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, cast

import torch
from torch import nn

from server.inference_mode import hot_inference_mode
from server.kernels.linear_route import embedding, linear
from server.kernels.ops import short_conv
from server.kernels.quant import QuantizedWeight
from server.kernels.quant_parts import QuantizedParts
from server.models.attention import AttentionMetadata, StateBatch
from server.models.config import ModelConfig, UnsupportedModelError
from server.models.decoder import DecoderForCausalLM
from server.models.decoder_layer import DecoderLayer, _enter, _replace_with_quantized
from server.models.layers import add_norm, norm, silu_and_mul
from server.models.lfm2_config import LFM2_NAMES
from server.models.moe import parameter_summary
from server.models.state_specs import attention_layers
from server.models.weights import WeightTarget, param

if TYPE_CHECKING:
    from server.models.lora import LoraStep


class ShortConvLayer(nn.Module):
    """One LFM2 convolution layer: operator norm, gated short convolution, residual, then the FFN
    norm and gated SiLU MLP (its output left for the next layer's norm to add, as DecoderLayer)."""

    fusable = False  # no decode_layer equivalent: always the Python layer (one C++ op for the conv)
    shares_kv = False  # (what DecoderForCausalLM asks of every layer: no KV at all here)
    moe = None
    MATRICES: tuple[str, ...] = ("in_proj_weight", "out_proj_weight", "gate_up_weight", "down_weight")

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c = config
        H, I, K = c.hidden_size, c.intermediate_of(layer_idx), c.conv_kernel
        self.layer_idx = layer_idx
        self.eps = c.rms_norm_eps
        self.attn_norm = param((H,), dtype, device)  # operator_norm
        self.mlp_norm = param((H,), dtype, device)  # ffn_norm
        self.in_proj_weight: torch.Tensor | QuantizedWeight = param((3 * H, H), dtype, device)
        self.in_proj_bias = param((3 * H,), dtype, device) if c.conv_bias else None
        self.conv_weight = param((H, K), dtype, device)  # the depthwise kernel, [H, 1, K] squeezed
        self.conv_bias = param((H,), dtype, device) if c.conv_bias else None
        self.out_proj_weight: torch.Tensor | QuantizedWeight = param((H, H), dtype, device)
        self.out_proj_bias = param((H,), dtype, device) if c.conv_bias else None
        self.gate_up_weight: torch.Tensor | QuantizedWeight = param((2 * I, H), dtype, device)
        self.down_weight: torch.Tensor | QuantizedWeight = param((H, I), dtype, device)
        # The op's layout of the kernel (fp32 [K, H]) and bias, made once from the loaded weights.
        self._conv_t: Optional[torch.Tensor] = None
        self._conv_b: Optional[torch.Tensor] = None

    def forward(self, hidden: torch.Tensor, delta: torch.Tensor | None, state: StateBatch,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] (updated in place), delta: the previous layer's MLP output not yet added.
        Returns (hidden, this layer's MLP output)."""
        if self._conv_t is None:
            self._conv_t = self.conv_weight.float().t().contiguous()
            self._conv_b = self.conv_bias.float().contiguous() if self.conv_bias is not None else None
        x = _enter(hidden, delta, self.attn_norm, self.eps)
        bcx = linear(x, self.in_proj_weight, self.in_proj_bias)
        y = short_conv(bcx, self._conv_t, self._conv_b, state.layers[self.layer_idx]["conv"], state.slots,
                       meta.query_start_loc)
        x = _enter(hidden, linear(y, self.out_proj_weight, self.out_proj_bias), self.mlp_norm, self.eps)
        return hidden, linear(silu_and_mul(linear(x, self.gate_up_weight)), self.down_weight)

    def linear_kinds(self, dtype: torch.dtype, tokens: int) -> None:
        return None  # never fused

    def quantize_weights(self, qtype: str) -> None:
        for name in self.MATRICES:
            _replace_with_quantized(self, name, qtype)

    def checkpoint_tensors(self, prefix: str) -> dict[str, WeightTarget]:
        H, K = self.conv_weight.shape
        assert isinstance(self.gate_up_weight, torch.Tensor) and isinstance(self.in_proj_weight, torch.Tensor)
        assert isinstance(self.out_proj_weight, torch.Tensor) and isinstance(self.down_weight, torch.Tensor)
        I = self.gate_up_weight.shape[0] // 2
        cv, ff = prefix + "conv.", prefix + "feed_forward."
        t = {
            prefix + "operator_norm.weight": WeightTarget(self.attn_norm, (H,)),
            prefix + "ffn_norm.weight": WeightTarget(self.mlp_norm, (H,)),
            cv + "in_proj.weight": WeightTarget(self.in_proj_weight, (3 * H, H)),
            cv + "conv.weight": WeightTarget(self.conv_weight, (H, 1, K), convert=lambda w: w.reshape(H, K)),
            cv + "out_proj.weight": WeightTarget(self.out_proj_weight, (H, H)),
            ff + "w1.weight": WeightTarget(self.gate_up_weight[:I], (I, H)),
            ff + "w3.weight": WeightTarget(self.gate_up_weight[I:], (I, H)),
            ff + "w2.weight": WeightTarget(self.down_weight, (H, I)),
        }
        if self.in_proj_bias is not None and self.conv_bias is not None and self.out_proj_bias is not None:
            t[cv + "in_proj.bias"] = WeightTarget(self.in_proj_bias, (3 * H,))
            t[cv + "conv.bias"] = WeightTarget(self.conv_bias, (H,))
            t[cv + "out_proj.bias"] = WeightTarget(self.out_proj_bias, (H,))
        return t


class Lfm2ForCausalLM(DecoderForCausalLM):
    """DecoderForCausalLM whose convolution layers are ShortConvLayers and whose KV caches (and
    per-layer metadata) cover its attention layers only; the state cache comes in `meta.state`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                 tie_word_embeddings: bool | None = None) -> None:
        if dtype == torch.float16:
            raise UnsupportedModelError("dtype: LFM2's short convolution runs in float32 or bfloat16, not float16")
        super().__init__(config, dtype, device, tie_word_embeddings)
        attn = attention_layers(config)
        # Per layer: its KV layer index (its place among the attention layers), None for a conv layer.
        self._kv_index: list[Optional[int]] = [attn.index(i) if i in attn else None for i in range(config.num_layers)]

    def _make_layer(self, config: ModelConfig, i: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if config.layer_types[i] == "attention":
            return DecoderLayer(config, i, dtype, device)
        return ShortConvLayer(config, i, dtype, device)

    def summary(self) -> str:
        c = self.config
        n_attn = sum(i is not None for i in self._kv_index)
        fused = sum(layer.fusable for layer in self._layers)
        return (f"{c.architecture}: {c.num_layers} layers ({n_attn} full attention, {c.num_layers - n_attn} short "
                f"convolution, kernel {c.conv_kernel}); fused decode_layer (CPU, up to 16 tokens) for {fused} of "
                f"{c.num_layers}; the others run the Python layers" + parameter_summary(self))

    def kv_cache_bytes_per_token(self) -> int:
        c = self.config
        elems = sum(c.kv_heads_of(i) * c.head_dim_of(i) for i in attention_layers(c))
        return 2 * elems * torch.empty((), dtype=self.dtype).element_size()

    @hot_inference_mode
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                lora: LoraStep | None = None) -> torch.Tensor:
        """As DecoderForCausalLM.forward, with kv_caches (and meta.for_layer) per attention layer and
        meta.state holding the convolution layers' state slots."""
        if lora is not None:  # the hybrid layers have no low-rank path yet (issue 30 meets issue 28)
            raise ValueError("LoRA adapters are not supported on hybrid (recurrent-state) models")
        n_attn = sum(i is not None for i in self._kv_index)
        if len(kv_caches) != n_attn:
            raise ValueError(f"kv_caches: expected {n_attn} (key, value) pairs (the attention layers), got {len(kv_caches)}")
        if meta.state is None:
            raise ValueError("meta.state: LFM2's convolution layers need their state slots (StateBatch)")
        hidden = embedding(input_ids, self.embed_tokens, self.dtype)
        batches = [rope.prepare(positions, self.dtype, None) for rope in self.ropes]
        delta: torch.Tensor | None = None
        fused = self._fused_kinds(hidden, batches)
        for i, layer in enumerate(self._layers):
            a = self._kv_index[i]
            if a is None:
                hidden, delta = cast(ShortConvLayer, layer)(hidden, delta, meta.state, meta)
                continue
            key_cache, value_cache = kv_caches[a]
            r = layer.rope_index
            rope, batch = (self.ropes[r], batches[r]) if r is not None else (None, None)
            kinds = fused[i] if fused is not None else None
            m = meta.for_layer(a)
            if kinds is not None:
                rows = batch.positions if batch is not None else positions
                hidden, delta = layer.forward_fused(hidden, delta, rope, rows, key_cache, value_cache, m, kinds)
            else:
                hidden, delta = layer.forward(hidden, delta, rope, batch, key_cache, value_cache, m)
        eps = self.config.rms_norm_eps
        return norm(hidden, self.norm, eps) if delta is None else add_norm(hidden, delta, self.norm, eps)

    def linear_weights(self) -> list[tuple[str, torch.Tensor | QuantizedWeight | QuantizedParts]]:
        out: list[tuple[str, torch.Tensor | QuantizedWeight | QuantizedParts]] = []
        for layer in self._layers:
            if isinstance(layer, ShortConvLayer):
                out += [("in_proj", layer.in_proj_weight), ("out_proj", layer.out_proj_weight)]
            else:
                out += [("qkv", layer.qkv_weight), ("o", layer.o_weight)]
            out += [("gate_up", layer.gate_up_weight), ("down", layer.down_weight)]
        out.append(("lm_head", self.lm_head))
        return out

    def checkpoint_tensors(self) -> dict[str, WeightTarget]:
        """transformers' Lfm2 names: the attention layers' Llama names renamed (LFM2_NAMES), the
        convolution layers' own, the final norm `model.embedding_norm`."""
        targets = super().checkpoint_tensors()
        out: dict[str, WeightTarget] = {}
        for name, target in targets.items():
            if ".layers." in name and isinstance(self._layers[int(name.split(".")[2])], ShortConvLayer):
                out[name] = target  # ShortConvLayer.checkpoint_tensors' names are LFM2's already
                continue
            out[lfm2_name(name)] = target
        return out


def lfm2_name(llama_name: str) -> str:
    """The transformers Lfm2 name of a tensor the shared decoder names the Llama way."""
    for old, new in LFM2_NAMES:
        if llama_name.endswith(old):
            return llama_name[: -len(old)] + new
    return llama_name
