"""LFM2's two translations into ModelConfig: a Hugging Face `config.json` (transformers'
`Lfm2Config`) and a llama.cpp `lfm2` GGUF file. Torch-free.

LFM2 interleaves gated short-convolution layers ("conv") with full-attention layers; the layer
kinds become `layer_types` ("short_conv" / "attention", server/models/state_specs.py). Beyond
that its attention layers are Qwen3's (per-head q/k RMSNorm, NeoX RoPE, no biases) and its MLP is
the gated SiLU MLP, pre-norm, with the final norm named `embedding_norm`.
"""
from __future__ import annotations

from typing import Any, cast

from server.models.config import ModelConfig, ModelLoadError
from server.models.gguf_config import gguf_base
from server.models.gguf_file import GGUFFile
from server.models.hf_config import HFFields, hf_base
from server.models.state_specs import ATTENTION, SHORT_CONV

MAX_CONV_KERNEL = 8  # the short_conv op's bound (csrc/cpu/short_conv_kernel.h)

# transformers' Lfm2 spelling of the tensors the shared decoder names the Llama way (suffixes).
LFM2_NAMES = (
    ("input_layernorm.weight", "operator_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("self_attn.o_proj.weight", "self_attn.out_proj.weight"),
    ("self_attn.q_norm.weight", "self_attn.q_layernorm.weight"),
    ("self_attn.k_norm.weight", "self_attn.k_layernorm.weight"),
    ("mlp.gate_proj.weight", "feed_forward.w1.weight"),
    ("mlp.up_proj.weight", "feed_forward.w3.weight"),
    ("mlp.down_proj.weight", "feed_forward.w2.weight"),
    ("model.norm.weight", "model.embedding_norm.weight"),
)
# llama.cpp's `lfm2` tensors the shared GGUF map does not know, by their transformers names.
LFM2_GGUF_GLOBAL = {"token_embd_norm.weight": "model.embedding_norm.weight"}
LFM2_GGUF_BLOCK = {f"shortconv.{p}.{w}": f"conv.{p}.{w}" for p in ("conv", "in_proj", "out_proj")
                   for w in ("weight", "bias")}


def lfm2_gguf_name(gguf_name: str, llama_name: str | None) -> str | None:
    """The transformers Lfm2 name of a tensor of a llama.cpp `lfm2` file; llama_name is what the
    shared map (gguf_loader.hf_tensor_name) made of it."""
    if gguf_name in LFM2_GGUF_GLOBAL:
        return LFM2_GGUF_GLOBAL[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LFM2_GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{LFM2_GGUF_BLOCK[parts[2]]}"
    if llama_name is None:
        return None
    for old, new in LFM2_NAMES:
        if llama_name.endswith(old):
            return llama_name[: -len(old)] + new
    return llama_name


def lfm2_intermediate(raw: dict[str, Any], source: str) -> int:
    """transformers' Lfm2MLP width: with block_auto_adjust_ff_dim, 2/3 of intermediate_size, times
    block_ffn_dim_multiplier, rounded up to block_multiple_of."""
    p = HFFields(raw, source)
    size = p.positive_int("block_ff_dim", None) or p.positive_int("intermediate_size")
    if raw.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        mult = raw.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            size = int(mult * size)
            of = p.positive_int("block_multiple_of", 256)
            size = of * ((size + of - 1) // of)
    return size


def _check_kernel(k: int, where: str) -> int:
    if not 2 <= k <= MAX_CONV_KERNEL:
        raise ModelLoadError(f"{where}: the short convolution's kernel must be 2..{MAX_CONV_KERNEL}, got {k}")
    return k


def lfm2_hf(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    n = raw.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ModelLoadError(f"{source}: field 'num_hidden_layers' must be a positive integer")
    types = raw.get("layer_types")
    if types is None:
        full = raw.get("full_attn_idxs")
        full = list(range(n)) if full is None else full
        if not isinstance(full, list):
            raise ModelLoadError(f"{source}: field 'full_attn_idxs' must list layer indices")
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or not all(t in ("conv", "full_attention") for t in types):
        raise ModelLoadError(f"{source}: field 'layer_types' must list {n} entries, each 'conv' or 'full_attention'")
    if "full_attention" not in types:
        raise ModelLoadError(f"{source}: field 'layer_types' needs at least one 'full_attention' layer")
    # hf_base reads the shared keys; LFM2 spells some its own way.
    tied = raw.get("tie_word_embeddings", raw.get("tie_embedding", True))
    shared = {k: v for k, v in raw.items() if k != "layer_types"}
    shared.update(rms_norm_eps=raw.get("norm_eps", 1e-5), intermediate_size=lfm2_intermediate(raw, source),
                  tie_word_embeddings=bool(tied))
    base = hf_base(shared, source, name)
    kernel = _check_kernel(HFFields(raw, source).positive_int("conv_L_cache", 3), f"{source}: field 'conv_L_cache'")
    return ModelConfig(**{**base, "qk_norm": True, "qkv_bias": False, "o_bias": False, "mlp_bias": False,
                          "layer_types": tuple(ATTENTION if t == "full_attention" else SHORT_CONV for t in types),
                          "conv_kernel": kernel, "conv_bias": bool(raw.get("conv_bias", False))})


def lfm2_gguf(f: GGUFFile, arch: str) -> ModelConfig:
    """llama.cpp's `lfm2` files: `attention.head_count_kv` per layer (0 marks a convolution layer),
    `shortconv.l_cache` the kernel, the final norm stored as `token_embd_norm`."""
    k = arch + "."
    n = f.get_int(k + "block_count")
    kv = f.metadata.get(k + "attention.head_count_kv")
    if not isinstance(kv, list) or len(kv) != n or not all(isinstance(h, int) and h >= 0 for h in kv) or not any(kv):
        raise ModelLoadError(f"{f.path}: metadata key {k + 'attention.head_count_kv'!r} must list {n} head counts "
                             "(0 for a convolution layer), at least one of them > 0")
    heads = {h for h in kv if h}
    if len(heads) != 1:
        raise ModelLoadError(f"{f.path}: {k}attention.head_count_kv: attention layers must agree, got {sorted(heads)}")
    # gguf_base reads head_count_kv as one number: hand it a view where it is one.
    base = gguf_base(cast(GGUFFile, _OneKVHeads(f, k + "attention.head_count_kv", heads.pop())), arch, "Lfm2ForCausalLM")
    kernel = _check_kernel(f.get_int(k + "shortconv.l_cache"), f"{f.path}: metadata key {k}shortconv.l_cache")
    return ModelConfig(**{**base, "qk_norm": True,
                          "layer_types": tuple(ATTENTION if h else SHORT_CONV for h in kv),
                          "conv_kernel": kernel, "conv_bias": "blk.0.shortconv.conv.bias" in f.tensors
                          or any(t.endswith("shortconv.conv.bias") for t in f.tensors)})


class _OneKVHeads:
    """A GGUFFile whose per-layer head_count_kv reads as the attention layers' one value."""

    def __init__(self, f: GGUFFile, key: str, value: int) -> None:
        self._f, self._key, self._value = f, key, value

    def get_int(self, key: str, *args: Any, **kwargs: Any) -> Any:
        return self._value if key == self._key else self._f.get_int(key, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)
