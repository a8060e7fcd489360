"""ModelConfig: the shared description of a decoder every architecture translates into.

A Hugging Face `config.json` and a GGUF file's metadata are each translated into this one
torch-free dataclass by the architecture's entry in the registry (`server.models.registry`
reads a model path; the translations live in `server.models.families`). The model code reads
only these fields: the decoder layer is described by its parts (norm placement and weight
offset, activation, attention variant, RoPE per layer) rather than by the architecture's name.
This module also owns the model-loading error types, so callers can catch one family of
exceptions.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

NORM_PLACEMENTS = ("pre", "post", "both")
ACTIVATIONS = ("silu", "gelu_tanh")
QK_NORMS = ("head", "projection")
MLP_KINDS = ("dense", "sparse")
MOE_CHECKPOINTS = ("mlp", "mixtral", "gpt_oss", "deepseek", "ernie")
MOE_ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_topk")
MOE_ACTIVATIONS = ("silu", "swiglu_oai")


class ModelLoadError(Exception):
    """A model folder could not be turned into a runnable model; the message names the file/field."""


class ModelFileNotFoundError(ModelLoadError, FileNotFoundError):
    """A required file or folder (config.json, weights) does not exist; `path` names it."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"{what} not found: {path}")
        self.path = path


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture or one of its features is outside what pagewire implements."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as transformers applies it to `inv_freq` (server.models.rope).

    rope_type: "linear" divides every frequency by `factor`; "llama3" divides only low
    frequencies by `factor` and interpolates the band between low/high_freq_factor; "yarn"
    blends interpolated and extrapolated frequencies between beta_fast and beta_slow rotations;
    "longrope" divides by `short_factor` per frequency while a sequence is within
    original_max_position_embeddings and by `long_factor` beyond it. yarn and longrope also
    scale cos/sin by `attention_factor`. "proportional" rotates the first `proportion` of the
    head's frequency pairs and leaves the others still (Gemma 4's global layers).
    """

    rope_type: str
    factor: float
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    original_max_position_embeddings: Optional[int] = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # "proportional" (Gemma 4's global layers): the table spans the whole head, but only the first
    # `proportion` of its frequencies rotate (base ** (-2i / head_dim)); the rest are 0 (identity).
    proportion: float = 1.0


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: base `theta`, optional scaling, and how many leading dims of each head
    rotate (`rotary_dim` < head_dim is partial rotary; the rest pass through)."""

    theta: float
    scaling: Optional[RopeScaling]
    rotary_dim: int


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape and numerics, per layer where layers differ.

    `layer_sliding_windows[i]`: layer i's attention window (None = full attention).
    `layer_ropes[i]`: index into `ropes` of layer i's RoPE table (None = a NoPE layer).
    `norm_placement`: "pre" (norm before attention and MLP, Llama), "post" (norm of each
    sub-block's output before the residual add, OLMo 2), "both" (Gemma 2/3: pre and post).
    `norm_weight_offset`: the checkpoint stores w and the layer scales by offset + w (Gemma: 1).
    `qk_norm_over`: "head" (RMSNorm of each q/k head, Qwen3/Gemma 3) or "projection" (of the
    whole q and k projections, OLMo 2).
    `attention_scale`: the softmax scale (head_dim ** -0.5 unless the family says otherwise).
    """

    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: Optional[int]
    layer_sliding_windows: tuple[Optional[int], ...]
    torch_dtype: str
    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]
    ropes: tuple[RopeSpec, ...]
    layer_ropes: tuple[Optional[int], ...]
    attention_scale: float
    norm_placement: str = "pre"
    norm_weight_offset: float = 0.0
    activation: str = "silu"
    qk_norm_over: str = "head"
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0
    # Phi-3 checkpoints store qkv_proj and gate_up_proj already fused (HF names only).
    fused_checkpoint: bool = False
    # Mixture of experts (server.models.moe): each layer's MLP is "dense" (the gated MLP) or
    # "sparse" (a softmax router over num_experts, the top num_experts_per_tok of them, weights
    # renormalised when norm_topk_prob; experts of moe_intermediate_size; Qwen2-MoE's shared expert
    # of shared_expert_intermediate_size with a sigmoid gate, 0 = none). () = every layer dense.
    layer_mlp_kinds: tuple[str, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    # HF expert names: "mlp" (mlp.experts.N.{gate,up,down}_proj), "mixtral" (block_sparse_moe.experts.N.w1/w3/w2)
    # or "gpt_oss" (mlp.router, mlp.experts.{gate_up,down}_proj stacked, gate/up columns interleaved)
    # or "deepseek" ("mlp" names plus mlp.gate.e_score_correction_bias and mlp.shared_experts.*)
    # or "ernie" (as "deepseek", the bias as mlp.moe_statics.e_score_correction_bias [1, E]).
    moe_checkpoint: str = "mlp"
    # gpt-oss's MoE: "topk_softmax" takes the top k router logits and softmaxes those k (the others
    # softmax over all E, then take the top k); moe_bias: the router and the experts have biases;
    # "swiglu_oai": (clamp(up, +-swiglu_limit) + 1) * g * sigmoid(swiglu_alpha * g), g = min(gate, swiglu_limit).
    moe_router: str = "softmax_topk"
    moe_bias: bool = False
    moe_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # DeepSeek-V3-style routers (server.models.moe_router; dots.llm1): "sigmoid_topk" scores each
    # expert by sigmoid(logit); moe_selection_bias adds a per-expert bias (e_score_correction_bias)
    # to the scores for choosing the top k only; with moe_n_group > 1 the choice is limited to the
    # moe_topk_group groups whose two best biased scores sum highest; the chosen weights (renormalised
    # when norm_topk_prob) are multiplied by moe_routed_scaling. shared_expert_gated: Qwen2-MoE's
    # shared expert has a sigmoid gate; DeepSeek-style shared experts ("deepseek" names) have none.
    moe_selection_bias: bool = False
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_routed_scaling: float = 1.0
    # The router's weight and logits in float32 whatever the model's dtype (the activations cast up):
    # transformers' DeepSeek-V3-style routers keep gate.weight in float32 (_keep_in_fp32_modules_strict).
    moe_router_fp32: bool = False
    # Layers a checkpoint holds past num_layers that the model does not run (GLM-4.5's multi-token
    # prediction layers: HF's model.layers.{num_layers + i}.*, GGUF's blk.{num_layers + i}.*); skipped at load.
    checkpoint_extra_layers: int = 0
    # Other checkpoint tensors the model does not run, by name prefix (Ernie 4.5's "model.mtp*").
    checkpoint_skipped_prefixes: tuple[str, ...] = ()
    # The HF checkpoint's q/k rows rotate interleaved pairs (GPT-J style; Ernie 4.5): reordered at
    # load into rotate-half's [first half | second half] per head (gguf_blocks.unpermute_qk).
    rope_interleaved_checkpoint: bool = False
    shared_expert_gated: bool = True
    # gpt-oss's attention sinks: a learned logit per query head joining every softmax (no value).
    attention_sinks: bool = False
    # gpt-oss's RMSNorm (transformers' GptOssRMSNorm): the weight multiplies in float32 and the
    # product is rounded once to the model's dtype (Llama's rounds, then multiplies). Same in float32.
    norm_weight_fp32: bool = False
    # "mxfp4": the HF checkpoint stores the experts as MXFP4 `*_blocks` / `*_scales` pairs (its
    # quantization_config's quant_method), decoded at load (server.models.mxfp4); "": float.
    experts_quantization: str = ""
    # Per-layer shapes and KV sharing (Gemma 4); an empty tuple means "every layer the same".
    layer_head_dims: tuple[int, ...] = ()  # else head_dim
    layer_kv_heads: tuple[int, ...] = ()  # else num_kv_heads
    layer_intermediate_sizes: tuple[int, ...] = ()  # else intermediate_size
    # The earlier layer whose K/V this layer attends over instead of writing its own (None: its own).
    layer_kv_sources: tuple[Optional[int], ...] = ()
    # Layers whose values are the key projection's output (no v_proj; Gemma 4's attention_k_eq_v).
    layer_value_from_key: tuple[bool, ...] = ()
    value_norm: bool = False  # RMSNorm of each value head, without a weight
    layer_scalar: bool = False  # each layer ends by scaling the residual stream by its own scalar
    # Per-layer input embeddings (Gemma 4's PLE): a [per_layer_vocab_size, num_layers x this] table
    # plus a projection of the embeddings, fed to a gated block at the end of each layer (0: none).
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # Hybrid models (server/models/state_specs.py): per layer its kind, "attention" (a KV layer) or a
    # recurrent kind keeping a state slot per sequence ("short_conv": LFM2); () = every layer attention.
    layer_types: tuple[str, ...] = ()
    conv_kernel: int = 0  # LFM2's short convolution: its kernel size (conv_L_cache); Gated DeltaNet's conv
    conv_bias: bool = False
    # Gated DeltaNet layers ("gated_deltanet": Qwen3-Next, Qwen3.5; server/models/gated_deltanet.py): key
    # and value heads and their sizes, and how the checkpoint spells the in-projections ("qkvz" / "split").
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    gdn_checkpoint: str = "split"
    # The full-attention output gate (Qwen3-Next, Qwen3.5): q_proj also yields a gate per head and the
    # attention output is multiplied by its sigmoid before o_proj (server/models/qwen3_next.py).
    attn_output_gate: bool = False

    def __post_init__(self) -> None:
        # Internal consistency of a translation (a bug in a family entry, not bad user input).
        n = self.num_layers
        assert len(self.layer_sliding_windows) == n and len(self.layer_ropes) == n, "per-layer fields"
        assert all(r is None or 0 <= r < len(self.ropes) for r in self.layer_ropes), "layer_ropes"
        assert self.norm_placement in NORM_PLACEMENTS and self.activation in ACTIVATIONS
        assert self.qk_norm_over in QK_NORMS
        assert len(self.layer_mlp_kinds) in (0, n) and all(k in MLP_KINDS for k in self.layer_mlp_kinds)
        assert self.moe_checkpoint in MOE_CHECKPOINTS and self.moe_router in MOE_ROUTERS
        assert self.moe_activation in MOE_ACTIVATIONS
        assert "sparse" not in self.layer_mlp_kinds or 0 < self.num_experts_per_tok <= self.num_experts
        assert self.moe_n_group >= 1 and 1 <= self.moe_topk_group <= self.moe_n_group, "moe groups"
        for name in ("layer_head_dims", "layer_kv_heads", "layer_intermediate_sizes", "layer_kv_sources",
                     "layer_value_from_key", "layer_types"):
            assert len(getattr(self, name)) in (0, n), name
        assert all(s is None or 0 <= s < i and self.kv_source(s) == s
                   for i, s in enumerate(self.layer_kv_sources)), "layer_kv_sources: an earlier, writing layer"

    def head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def intermediate_of(self, layer: int) -> int:
        return self.layer_intermediate_sizes[layer] if self.layer_intermediate_sizes else self.intermediate_size

    def kv_source(self, layer: int) -> int:
        """The layer whose KV cache `layer` reads (itself unless it shares an earlier layer's)."""
        s = self.layer_kv_sources[layer] if self.layer_kv_sources else None
        return layer if s is None else s

    def value_from_key(self, layer: int) -> bool:
        return bool(self.layer_value_from_key[layer]) if self.layer_value_from_key else False

    def mlp_kind(self, layer: int) -> str:
        """"dense" or "sparse" (a mixture-of-experts MLP) for `layer`."""
        return self.layer_mlp_kinds[layer] if self.layer_mlp_kinds else "dense"

    @property
    def is_moe(self) -> bool:
        return "sparse" in self.layer_mlp_kinds

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_theta(self) -> float:
        """The base of the first RoPE table (the only one for single-table families)."""
        return self.ropes[0].theta

    @property
    def rope_scaling(self) -> Optional[RopeScaling]:
        return self.ropes[0].scaling
