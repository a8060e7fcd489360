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
fused parameters. The layer itself, DecoderLayer, is server.models.decoder_layer's; this module owns
the model around it: embeddings, the per-layer inputs, the choice of fused or Python layers per step,
the final norm and lm_head, and the model-wide weight moves (quantisation, the x8 bf16 layout).
"""
from __future__ import annotations

import os
from typing import Optional, cast

import torch
from torch import nn

from server.inference_mode import hot_inference_mode
from server.kernels import autotune, batch_invariant, ops
from server.kernels.linear_route import Q8_KERNEL_MAX_ROWS, embedding, linear
from server.kernels.ops import DecodeStack, cpu_isa, decode_stack
from server.kernels.quant import QUANTIZATIONS, QuantizedWeight
from server.kernels.quant_parts import QuantizedParts
from server.models import decoder_layer
from server.models.attention import AttentionMetadata
from server.models.config import ModelConfig
from server.models.decoder_layer import DecoderLayer, _replace_with_quantized
from server.models.layers import add_norm, norm, rms_norm
from server.models.lora import LoraStep, Slot
from server.models.moe import SparseMoE, parameter_summary
from server.models.rope import RopeBatch, RotaryEmbedding
from server.models.weights import WeightTarget, param


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
        # Every layer of a fused step in one C++ call (_decode_stack); False: one call per layer
        # (tests compare the two). The stacks: (id(fused kinds), id(kv caches), sparse layers' kinds)
        # -> (those kinds, those caches, the stack or None: this step's layers cannot all join one).
        self.stacked_decode = True
        # The sparse layers' MLPs, in layer order: their per-step choices are part of a stack's key.
        self._sparse: list[SparseMoE] = [m for layer in self._layers if (m := getattr(layer, "moe", None)) is not None]
        self._stacks: dict[tuple[int, int, tuple[object, ...]], tuple[object, object, DecodeStack | None]] = {}
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

    @hot_inference_mode
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
        stack = self._decode_stack(fused, kv_caches, hidden) if lora is None and per_layer is None else None
        if stack is not None:
            # Every layer in one C++ call (csrc/cpu/decode_stack.cpp): forward_fused's ops, in order.
            groups = meta.per_layer if meta.per_layer is not None else [meta]
            hidden, delta = stack.run(hidden, None, [b.positions for b in batches],
                                      [m.slot_mapping for m in groups], [m.block_tables for m in groups],
                                      meta.seq_lens, meta.query_start_loc, meta.max_query_len, meta.max_seq_len)
            if not self.config.norm_weight_fp32:
                return hidden  # normed inside the call (_decode_stack gave it the final norm)
        else:
            hidden, delta = self._layer_by_layer(hidden, positions, kv_caches, meta, batches, fused, per_layer, lora)
        eps, fp32 = self.config.rms_norm_eps, self.config.norm_weight_fp32
        return norm(hidden, self.norm, eps, fp32) if delta is None else add_norm(hidden, delta, self.norm, eps, fp32)

    def _layer_by_layer(self, hidden: torch.Tensor, positions: torch.Tensor,
                        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                        batches: list[RopeBatch], fused: list[tuple[str, ...] | None] | None,
                        per_layer: torch.Tensor | None,
                        lora: LoraStep | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward()'s layers one call each: decode_layer where `fused` names the layer's kinds, the
        Python layer elsewhere. Returns (the residual stream, the last layer's output to add)."""
        delta: torch.Tensor | None = None
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
        return hidden, delta

    def _decode_stack(self, fused: list[tuple[str, ...] | None] | None,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      hidden: torch.Tensor) -> DecodeStack | None:
        """The DecodeStack (csrc/cpu/decode_stack.cpp) that runs this step's layers in one call, or
        None where some layer must take its own call: `stacked_decode` off, a layer without fused
        kinds, a subclass's layer (hybrid models), a per-layer input block, or a sparse layer whose
        MLP this step runs without moe_decode. Built once per fused-kinds list (itself cached per
        row count, autotune table and batch-invariant mode), KV cache list and the sparse layers'
        choices, and dropped with the kinds (_forget_kinds). The stack runs the final norm too
        (DecodeStack.set_final_norm) unless the norm takes an fp32 weight."""
        if fused is None or not self.stacked_decode:
            return None
        sparse = tuple(moe.decode_kinds(hidden) for moe in self._sparse)  # (none at all in a dense model)
        key = (id(fused), id(kv_caches), sparse)
        cached = self._stacks.get(key)
        if cached is not None and cached[0] is fused and cached[1] is kv_caches:
            return cached[2]
        chosen = iter(sparse)
        moe_kinds = [next(chosen) if getattr(layer, "moe", None) is not None else None for layer in self._layers]
        stack: DecodeStack | None = None
        if all(kinds is not None and isinstance(layer, DecoderLayer) and layer.stackable()
               and (layer.moe is None or mk is not None)
               for kinds, layer, mk in zip(fused, self._layers, moe_kinds)):
            stack = decode_stack()
            for layer, kinds, mk, (key_cache, value_cache) in zip(self._layers, fused, moe_kinds, kv_caches):
                r = layer.rope_index
                layer.add_to_stack(stack, self.ropes[r] if r is not None else None, cast(tuple[str, ...], kinds),
                                   key_cache, value_cache, mk)
            if not self.config.norm_weight_fp32:  # (gpt-oss's fp32-weight norm stays forward()'s)
                stack.set_final_norm(self.norm, self.config.rms_norm_eps)
        # The key's ids stay valid while the entry holds the objects they name; a process that
        # keeps making autotune tables or cache lists (tests) must not keep every stack alive.
        if len(self._stacks) >= 32:
            self._stacks.clear()
        self._stacks[key] = (fused, kv_caches, stack)
        return stack

    def _forget_kinds(self) -> None:
        """Drop the cached linear kinds and the stacks built from them (the weights' formats changed)."""
        self._fused_cache.clear()
        self._stacks.clear()

    def _per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor | None:
        """Gemma 4's per-layer inputs [T, L, P], as transformers' get_per_layer_inputs and
        project_per_layer_inputs compute them: (norm(embeds @ W * H^-0.5) + table[ids] * sqrt(P)) / sqrt(2)."""
        if self.embed_tokens_per_layer is None or self.per_layer_projection is None:
            return None
        assert self.per_layer_projection_norm is not None and self._ple_scale is not None
        c, T = self.config, input_ids.shape[0]
        shape = (T, c.num_layers, c.per_layer_input_size)
        tokens = (embedding(input_ids, self.embed_tokens_per_layer, self.dtype) * self._ple_scale).view(shape)
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
        Python, when `fused_decode` is off, or when this module's or decoder_layer's `linear` has been
        replaced (tests and bench/decode_step.py wrap it to see every call). Cached per row count,
        autotune table and batch-invariant mode: the rules only change with those."""
        T = hidden.shape[0]
        if (not self.fused_decode or not hidden.is_cpu or T > Q8_KERNEL_MAX_ROWS
                or any(b.cos is not None for b in batches) or linear is not _LINEAR
                or decoder_layer.linear is not _LINEAR):
            return None
        table = autotune.active_table()
        key = (T, id(table), batch_invariant.enabled())
        cached = self._fused_cache.get(key)
        if cached is None or cached[0] is not table:
            cached = (table, [layer.linear_kinds(self.dtype, T) if layer.fusable else None for layer in self._layers])
            self._fused_cache[key] = cached
        return cached[1]

    @hot_inference_mode
    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """Args: hidden [S, hidden_size] rows from forward(). Returns float32 logits [S, vocab_size],
        or with widen=False the logits in the dtype the lm_head (and any scaling) left them: a
        greedy step's argmax needs no float32 copy (24 us a SmolLM2 step, issue 31)."""
        logits = linear(hidden, self.lm_head)
        c = self.config
        if c.logits_divisor != 1.0:  # Granite's logits_scaling
            logits = logits / c.logits_divisor
        if c.final_logit_softcap:  # Gemma 2, in transformers' order
            logits = torch.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
        return ops.to_float32(logits) if widen else logits

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
        self._forget_kinds()  # the layers' linear kinds changed

    def interleave_bf16(self, pack: Optional[bool] = None) -> None:
        """On CPUs whose kernels are a family of BF16_X8_MAX_K (AVX2, AVX512-BF16), move every bf16
        decoder matrix and the lm_head with rows of at most its width into the x8 layout
        (QuantizedWeight.from_bf16), which pagewire::linear_bf16x8 streams as one sequence: the same
        floats as the family's row-layout kernel, bit for bit, at up to 1.6x its decode bandwidth
        (bench/RESULTS.md: AVX2 on short rows, session 18; AVX512-BF16, session 25). The memory is the same: each
        matrix is moved, not copied. A tied lm_head is the embedding table: the table itself is
        moved, and linear_route.embedding gathers its rows from it. (AMX CPUs keep the row layout.)

        With `pack` (None: unless $PAGEWIRE_PACK_BF16=0), on the families of BF16_PACKED
        (AVX2, AVX512-BF16) each matrix, of any width, is packed losslessly instead (QuantizedWeight.pack_bf16: ~12.5 bits
        a value, the same floats bit for bit), where that saves at least PACK_MIN_SAVING of its bytes:
        single-stream decode reads 0.76x the bytes."""
        if pack is None:
            pack = os.environ.get("PAGEWIRE_PACK_BF16", "1") != "0"
        isa = cpu_isa()
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or isa not in BF16_X8_MAX_K:
            return
        max_k = BF16_X8_MAX_K[isa]
        packed = pack and isa in BF16_PACKED
        for layer in self._layers:
            if isinstance(layer, DecoderLayer):
                for name in layer.MATRICES:
                    _replace_with_bf16x8(layer, name, max_k, packed)
        if self.lm_head is not self.embed_tokens:
            _replace_with_bf16x8(self, "lm_head", max_k, packed)
        else:  # tied: one moved table, its rows gathered by linear_route.embedding, the whole projected by lm_head
            _replace_with_bf16x8(self, "embed_tokens", max_k, packed)
            self._parameters.pop("lm_head", None)  # (registered under both names when tied)
            self.lm_head = self.embed_tokens
        self._forget_kinds()  # the layers' linear kinds changed

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


# Per kernel family that interleaves, the widest rows the x8 layout pays for. AVX2: the row-layout
# kernel reads eight rows side by side, each a stream of K * 2 bytes: short rows (SmolLM2's 576,
# 1,152 bytes) end before the hardware prefetcher is up to speed, and there one sequential stream
# moved 1.2-1.4x the bytes at M = 1; from K = 1536 the eight row streams kept up (1.0x) and at
# K = 5632 beat it (0.8x). bench/RESULTS.md, session 18. AVX512-BF16 (linear_bf16x8_avx512.cpp, on
# a Zen 5): every width; against the row layout's kernel 1.2-1.6x at one row, 1.1-1.4x at 8-16, and
# from 24 to 128 rows 0.70-1.02x the time of the GEMM the row layout takes there, at the cost of
# 0.76-1.25x at two rows, 0.92-1.22x at four and 5-20 % on prefill chunks of 256-512 rows
# (session 25). AMX CPUs keep the row layout, which their tile kernels read from 4 rows.
BF16_X8_MAX_K: dict[str, int] = {"avx2": 1024, "avx512bf16": 1 << 62}
# The kernel families that pack bf16 matrices, at every width (pagewire::linear_bf16z has AVX512-BF16
# and AVX2 kernels; below AVX2 its op unpacks). On a Zen 4 the AVX512-BF16 kernel took 0.54-0.92x
# the x8 kernel's time on matrices from memory at one to four rows, and 0.95-1.19x from 8 to 64
# rows, where a step no longer waits on memory alone; single-stream decode of bf16 files 1.27-1.64x.
# The AVX2 kernel (the same CPU, the avx2 family): a SmolLM2-shaped and a Llama-1B-shaped stack of
# matrices at one row in 0.81-0.82x the x8 layout's time and 0.52-0.68x the row layout's (which
# the avx2 family keeps past K = 1,024), 0.98x at two rows, 1.04-1.16x at eight (bench/RESULTS.md,
# session 46).
BF16_PACKED: tuple[str, ...] = ("avx2", "avx512bf16")
# Pack a matrix only where that saves at least this share of its bytes (a matrix of values spread
# over more than ~15 binades per row keeps many 16-bit steps).
PACK_MIN_SAVING = 0.1


def _replace_with_bf16x8(module: nn.Module, name: str, max_k: int, pack: bool = False) -> None:
    """module.<name>, a bf16 matrix, becomes its x8 QuantizedWeight where the layout applies and
    pays (at least one group of eight rows, K a multiple of 16 and at most max_k), or with `pack`
    its packed one (any K) where that saves PACK_MIN_SAVING; anything else stays as it is."""
    weight = getattr(module, name)
    if (not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16 or weight.dim() != 2
            or weight.shape[0] < 8 or weight.shape[1] == 0 or weight.shape[1] % 16
            or (weight.shape[1] > max_k and not pack)):
        return
    moved = None
    if pack:
        moved = QuantizedWeight.pack_bf16(weight)
        if moved.nbytes > (1 - PACK_MIN_SAVING) * weight.numel() * 2:
            moved = None
    if moved is None:
        if weight.shape[1] > max_k:
            return
        moved = QuantizedWeight.from_bf16(weight)
    module._parameters.pop(name, None)  # as _replace_with_quantized: the row-layout matrix is freed
    setattr(module, name, moved)


# `linear` as imported: _fused_kinds steps aside when something has replaced it here or in
# server.models.decoder_layer (whose module global the Python layers call).
_LINEAR = linear
