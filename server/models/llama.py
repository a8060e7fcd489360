"""LlamaFamilyForCausalLM: the Llama / Mistral / Qwen2 / Qwen3 decoder running on pagewire's paged KV cache.

One module covers the four architectures because they differ only in switches read from
ModelConfig: q/k/v bias (Qwen2), per-head q/k RMSNorm before RoPE (Qwen3), a sliding attention
window (Mistral, optionally Qwen2/3). Weights are stored fused (one qkv and one gate_up matrix
per layer) so CPU inference runs fewer, larger matmuls; `checkpoint_tensors()` tells the loader
where each Hugging Face tensor lands inside the fused parameters.
"""
from __future__ import annotations

from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from server.kernels import autotune, batch_invariant
from server.kernels.ops import Q8_KERNEL_MAX_ROWS, linear, linear_kind, paged_attention, write_kv_cache
from server.kernels.quant import QUANTIZATIONS, QuantizedWeight
from server.models.attention import AttentionMetadata
from server.models.config import ModelConfig
from server.models.layers import add_norm, gelu_tanh_and_mul, norm, silu_and_mul
from server.models.rope import RopeBatch, RotaryEmbedding


class WeightTarget(NamedTuple):
    """Where one checkpoint tensor goes: `dest` (a view into a parameter) and the shape it must have."""

    dest: torch.Tensor
    shape: tuple[int, ...]


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised on purpose: the loader fills every parameter or fails naming the missing tensor.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder block: attention over the paged cache, then a SiLU-gated MLP.

    Parameters (fused): qkv_weight [q + 2 kv, H], o_weight [H, q], gate_up_weight [2 I, H],
    down_weight [H, I], norms [H], and for Qwen3 qk_norm [num_heads + num_kv_heads, head_dim]
    (q_norm repeated over query heads, then k_norm over kv heads, so one op normalises both).
    """

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.eps = c.rms_norm_eps
        self.scale = c.head_dim**-0.5
        window = c.layer_sliding_windows[layer_idx]
        self.sliding_window = window if window is not None else 0  # the op reads <= 0 as "no window"
        # Attention logit soft-capping (0: off) and the gated MLP's activation ("silu" or
        # "gelu_tanh"): both kernels take them, in forward and in decode_layer alike. The four
        # Llama-family architectures use neither; a family that does sets them from its config.
        self.softcap = 0.0
        self.activation = "silu"

        H, I, qkv = c.hidden_size, c.intermediate_size, c.q_size + 2 * c.kv_size
        self.input_norm = _param((H,), dtype, device)
        # The four matrices may be replaced by QuantizedWeight (quantize_weights) after loading.
        self.qkv_weight: torch.Tensor | QuantizedWeight = _param((qkv, H), dtype, device)
        self.qkv_bias = _param((qkv,), dtype, device) if c.qkv_bias else None
        self.qk_norm = _param((c.num_heads + c.num_kv_heads, c.head_dim), dtype, device) if c.qk_norm else None
        self.o_weight: torch.Tensor | QuantizedWeight = _param((H, c.q_size), dtype, device)
        self.o_bias = _param((H,), dtype, device) if c.o_bias else None
        self.post_norm = _param((H,), dtype, device)
        self.gate_up_weight: torch.Tensor | QuantizedWeight = _param((2 * I, H), dtype, device)
        self.gate_up_bias = _param((2 * I,), dtype, device) if c.mlp_bias else None
        self.down_weight: torch.Tensor | QuantizedWeight = _param((H, I), dtype, device)
        self.down_bias = _param((H,), dtype, device) if c.mlp_bias else None

    def forward(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        rope: RotaryEmbedding,
        rope_batch: RopeBatch,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: hidden [T, H], the residual stream (updated in place); delta [T, H], the previous
        layer's MLP output not yet added to it (None for the first layer).

        Returns (hidden, this layer's MLP output): the add is left to the next norm, which fuses it.
        """
        T = hidden.shape[0]
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim

        if delta is None:
            x = norm(hidden, self.input_norm, self.eps)
        else:
            x = add_norm(hidden, delta, self.input_norm, self.eps)
        qkv = linear(x, self.qkv_weight, self.qkv_bias)  # [T, q + 2 kv]
        # q and k are adjacent in qkv, so norm and RoPE treat them as nh + nkv heads in one pass,
        # in place (query and key stay strided views of qkv; the attention ops take strides).
        qk = qkv[:, : self.q_size + self.kv_size].view(T, nh + nkv, d)
        rope.rotate_(qk, rope_batch, self.qk_norm, self.eps)
        query = qk[:, :nh]
        key = qk[:, nh:]
        value = qkv[:, self.q_size + self.kv_size :].view(T, nkv, d)

        write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        attn = torch.empty((T, nh, d), dtype=hidden.dtype, device=hidden.device)
        paged_attention(
            attn,
            query,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            self.sliding_window,
            meta.max_query_len,
            meta.max_seq_len,
            self.softcap,
        )
        x = add_norm(hidden, linear(attn.view(T, self.q_size), self.o_weight, self.o_bias), self.post_norm, self.eps)
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)
        act = gelu_tanh_and_mul(gate_up) if self.activation == "gelu_tanh" else silu_and_mul(gate_up)
        return hidden, linear(act, self.down_weight, self.down_bias)

    def forward_fused(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        rope: RotaryEmbedding,
        rope_batch: RopeBatch,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        kinds: tuple[str, str, str, str],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() in one C++ call (pagewire::decode_layer: the same ops in the same order, so the
        same floats), for CPU batches of at most 16 tokens; kinds: each matrix's linear path
        (ops.linear_kind), in MATRICES order."""
        mlp_out = torch.ops.pagewire.decode_layer(
            hidden, delta, self.input_norm, self.post_norm, self.eps,
            _weight_data(self.qkv_weight), kinds[0], self.qkv_bias,
            _weight_data(self.o_weight), kinds[1], self.o_bias,
            _weight_data(self.gate_up_weight), kinds[2], self.gate_up_bias,
            _weight_data(self.down_weight), kinds[3], self.down_bias,
            rope_batch.positions, rope.cos, rope.sin, self.qk_norm, key_cache, value_cache,
            meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            self.scale, self.sliding_window, meta.max_query_len, meta.max_seq_len,
            self.num_heads, self.num_kv_heads, self.head_dim, self.softcap, self.activation,
        )
        return hidden, mlp_out

    def linear_kinds(self, dtype: torch.dtype, tokens: int) -> tuple[str, str, str, str] | None:
        """Each matrix's path for `tokens` rows as ops.linear would take it (None: one of them has
        no decode_layer equivalent, so this layer runs forward())."""
        kinds = tuple(linear_kind(dtype, tokens, getattr(self, n), getattr(self, n.replace("weight", "bias")))
                      for n in self.MATRICES)
        return None if None in kinds else cast(tuple[str, str, str, str], kinds)

    MATRICES = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")

    def quantize_weights(self, qtype: str) -> None:
        """Replace the four matrices by QuantizedWeight(qtype) (biases and norms stay as they are)."""
        for name in self.MATRICES:
            _replace_with_quantized(self, name, qtype)

    def checkpoint_tensors(self, prefix: str) -> dict[str, WeightTarget]:
        """HF tensor names under `prefix` (e.g. "model.layers.3.") mapped to slices of the fused parameters."""
        q, kv, d, nh = self.q_size, self.kv_size, self.head_dim, self.num_heads
        assert isinstance(self.qkv_weight, torch.Tensor), "checkpoint_tensors: the layer is already quantised"
        I2, H = self.gate_up_weight.shape
        I = I2 // 2
        assert isinstance(self.o_weight, torch.Tensor) and isinstance(self.down_weight, torch.Tensor)
        assert isinstance(self.gate_up_weight, torch.Tensor)
        a, m = prefix + "self_attn.", prefix + "mlp."
        t: dict[str, WeightTarget] = {
            prefix + "input_layernorm.weight": WeightTarget(self.input_norm, (H,)),
            prefix + "post_attention_layernorm.weight": WeightTarget(self.post_norm, (H,)),
            a + "q_proj.weight": WeightTarget(self.qkv_weight[:q], (q, H)),
            a + "k_proj.weight": WeightTarget(self.qkv_weight[q : q + kv], (kv, H)),
            a + "v_proj.weight": WeightTarget(self.qkv_weight[q + kv :], (kv, H)),
            a + "o_proj.weight": WeightTarget(self.o_weight, (H, q)),
            m + "gate_proj.weight": WeightTarget(self.gate_up_weight[:I], (I, H)),
            m + "up_proj.weight": WeightTarget(self.gate_up_weight[I:], (I, H)),
            m + "down_proj.weight": WeightTarget(self.down_weight, (H, I)),
        }
        if self.qkv_bias is not None:
            t[a + "q_proj.bias"] = WeightTarget(self.qkv_bias[:q], (q,))
            t[a + "k_proj.bias"] = WeightTarget(self.qkv_bias[q : q + kv], (kv,))
            t[a + "v_proj.bias"] = WeightTarget(self.qkv_bias[q + kv :], (kv,))
        if self.o_bias is not None:
            t[a + "o_proj.bias"] = WeightTarget(self.o_bias, (H,))
        if self.qk_norm is not None:
            # A [d] checkpoint vector broadcasts over every head's row when copied in.
            t[a + "q_norm.weight"] = WeightTarget(self.qk_norm[:nh], (d,))
            t[a + "k_norm.weight"] = WeightTarget(self.qk_norm[nh:], (d,))
        if self.gate_up_bias is not None and self.down_bias is not None:
            t[m + "gate_proj.bias"] = WeightTarget(self.gate_up_bias[:I], (I,))
            t[m + "up_proj.bias"] = WeightTarget(self.gate_up_bias[I:], (I,))
            t[m + "down_proj.bias"] = WeightTarget(self.down_bias, (H,))
        return t


class LlamaFamilyForCausalLM(nn.Module):
    """A decoder-only causal LM over a flat batch of new tokens and a paged KV cache.

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
        self.embed_tokens = _param((c.vocab_size, c.hidden_size), dtype, dev)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, i, dtype, dev) for i in range(c.num_layers))
        self.norm = _param((c.hidden_size,), dtype, dev)
        tied = c.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
        # Tied checkpoints store one matrix; the output projection reuses the embedding table.
        self.lm_head: torch.Tensor | QuantizedWeight = (
            self.embed_tokens if tied else _param((c.vocab_size, c.hidden_size), dtype, dev)
        )
        self.rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, dev)
        # Plain list for the hot loop: iterating nn.ModuleList and calling modules via __call__
        # costs hook checks on every layer of every step.
        self._layers: list[LlamaDecoderLayer] = [cast(LlamaDecoderLayer, m) for m in self.layers]
        # Small CPU batches run each layer as one C++ call (_fused_kinds); False forces the Python
        # layers (bench/decode_step.py times both).
        self.fused_decode = True
        # (rows, id(autotune table), batch-invariant) -> (that table, each layer's linear kinds); weights are never
        # swapped after loading (quantize_weights runs before the first step), so kinds stay valid.
        self._fused_cache: dict[tuple[int, int, bool], tuple[object, list[tuple[str, str, str, str] | None]]] = {}
        self.eval()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's key cache (and, separately, its value cache)."""
        return (num_blocks, self.config.num_kv_heads, block_size, self.config.head_dim)

    def kv_cache_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers, at the model's dtype."""
        c = self.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the new tokens of every scheduled sequence through the model, writing their K/V.

        Args:
            input_ids: int64 [T], the flat batch (no padding), sequences in query_start_loc order.
            positions: int64 [T], each token's position in its sequence (< max_position_embeddings).
            kv_caches: per layer (key_cache, value_cache), each kv_cache_shape(num_blocks, block_size);
                layers of different KV groups may share tensors (their blocks never overlap).
            meta: where each token's K/V is written and which blocks each sequence reads (per
                layer: meta.for_layer(i)).
        Returns:
            [T, hidden_size] final-normed hidden states; pass the rows to sample to compute_logits.
        """
        if len(kv_caches) != len(self._layers):
            raise ValueError(f"kv_caches: expected {len(self._layers)} (key, value) pairs, got {len(kv_caches)}")
        hidden = F.embedding(input_ids, self.embed_tokens)
        rope_batch = self.rope.prepare(positions, self.dtype)
        delta: torch.Tensor | None = None
        fused = self._fused_kinds(hidden, rope_batch)
        for i, (layer, (key_cache, value_cache)) in enumerate(zip(self._layers, kv_caches)):
            kinds = fused[i] if fused is not None else None
            m = meta.for_layer(i)  # the layer's KV group's slots and block tables
            if kinds is not None:
                hidden, delta = layer.forward_fused(hidden, delta, self.rope, rope_batch, key_cache, value_cache,
                                                    m, kinds)
            else:
                hidden, delta = layer.forward(hidden, delta, self.rope, rope_batch, key_cache, value_cache, m)
        eps = self.config.rms_norm_eps
        return norm(hidden, self.norm, eps) if delta is None else add_norm(hidden, delta, self.norm, eps)

    def _fused_kinds(self, hidden: torch.Tensor, rope_batch: RopeBatch) -> list[tuple[str, str, str, str] | None] | None:
        """Per layer, the linear paths for pagewire::decode_layer, or None where the layer must run
        in Python: always off the CPU, above 16 tokens (quantised weights switch paths there), with
        RoPE tables gathered in Python, when `fused_decode` is off, or when this module's `linear`
        has been replaced (tests and bench/decode_step.py wrap it to see every call). Cached per
        row count, autotune table and batch-invariant mode: the rules only change with those."""
        T = hidden.shape[0]
        if (not self.fused_decode or hidden.device.type != "cpu" or T > Q8_KERNEL_MAX_ROWS
                or rope_batch.cos is not None or linear is not _LINEAR):
            return None
        table = autotune.active_table()
        key = (T, id(table), batch_invariant.enabled())
        cached = self._fused_cache.get(key)
        if cached is None or cached[0] is not table:
            cached = (table, [layer.linear_kinds(self.dtype, T) for layer in self._layers])
            self._fused_cache[key] = cached
        return cached[1]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Args: hidden [S, hidden_size] rows from forward(). Returns float32 logits [S, vocab_size]."""
        return linear(hidden, self.lm_head).float()

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

    def linear_weights(self) -> list[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Every weight the forward and compute_logits pass to `linear`, named by role (for the
        start-up autotune, server.kernels.autotune)."""
        out: list[tuple[str, torch.Tensor | QuantizedWeight]] = []
        for layer in self._layers:
            out += [("qkv", layer.qkv_weight), ("o", layer.o_weight), ("gate_up", layer.gate_up_weight),
                    ("down", layer.down_weight)]
        out.append(("lm_head", self.lm_head))
        return out

    def tie_lm_head(self) -> None:
        """Drop the separate lm_head and project with the embedding table (frees vocab x hidden)."""
        self.lm_head = self.embed_tokens

    def checkpoint_tensors(self) -> dict[str, WeightTarget]:
        """Every Hugging Face tensor name this model needs, mapped to where it is copied."""
        c = self.config
        targets = {
            "model.embed_tokens.weight": WeightTarget(self.embed_tokens, (c.vocab_size, c.hidden_size)),
            "model.norm.weight": WeightTarget(self.norm, (c.hidden_size,)),
        }
        if self.lm_head is not self.embed_tokens:
            assert isinstance(self.lm_head, torch.Tensor), "checkpoint_tensors: the model is already quantised"
            targets["lm_head.weight"] = WeightTarget(self.lm_head, (c.vocab_size, c.hidden_size))
        for i, layer in enumerate(self._layers):
            targets.update(layer.checkpoint_tensors(f"model.layers.{i}."))
        return targets



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


def _weight_data(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """The tensor a linear kind reads: the float matrix, or a QuantizedWeight's block bytes."""
    return weight.data if isinstance(weight, QuantizedWeight) else weight


# This module's `linear` as imported: _fused_kinds steps aside when something has replaced it.
_LINEAR = linear
