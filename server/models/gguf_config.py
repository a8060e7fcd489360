"""The shared half of every GGUF translation: llama.cpp's `{arch}.*` metadata keys read into
ModelConfig keyword arguments, and the `dtype="auto"` rule for GGUF files.

`gguf_base` reads what all llama.cpp architectures spell the same way; each family's translation
in server.models.families overrides its own parts. `dtype="auto"` is the float type the weights
are stored in, or float32 for quantised files (dequantised exactly, as transformers does).
Torch-free.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from server.models.config import ModelLoadError, RopeScaling, RopeSpec, UnsupportedModelError
from server.models.gguf_file import GGUFFile

_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Tensors a translation reads into the config (longrope's factors) rather than the loader into weights.
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight",
                  "rope_freqs.weight")  # Gemma 4's proportional RoPE (server.models.gemma4_config)


# 2-D tensors llama.cpp's converter always writes in F32, whatever the file's type: the MoE
# routers, the recurrent layers' conv kernels. They do not make a BF16 file a float32 one.
_ALWAYS_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight", "shortconv.conv.weight")


def gguf_dtype(f: GGUFFile) -> str:
    """The dtype "auto" resolves to: the one float type of the 2-D weights (those the converter
    always keeps in F32 aside), else float32."""
    kinds = {t.type_name for t in f.tensors.values() if len(t.shape) >= 2 and not t.name.endswith(_ALWAYS_F32)}
    if len(kinds) == 1 and next(iter(kinds)) in _FLOAT_TYPES:
        return _FLOAT_TYPES[next(iter(kinds))]
    return "float32"


def gguf_base(f: GGUFFile, arch: str, architecture: str) -> dict[str, Any]:
    """ModelConfig keyword arguments from the keys every llama.cpp architecture shares: full
    attention, one RoPE table (`rope.dimension_count` may make it partial), pre-norm, biases where
    the file has bias tensors."""
    k = arch + "."
    hidden = f.get_int(k + "embedding_length")
    num_layers = f.get_int(k + "block_count")
    num_heads = f.get_int(k + "attention.head_count")
    num_kv_heads = f.get_int(k + "attention.head_count_kv", num_heads)
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{f.path}: {k}attention.head_count {num_heads} is not a multiple of "
            f"{k}attention.head_count_kv {num_kv_heads}"
        )
    # Qwen3, Gemma (and any file with a decoupled head size) state key_length; else hidden / heads.
    head_dim = f.get_int(k + "attention.key_length", None)
    if head_dim is None:
        if hidden % num_heads:
            raise ModelLoadError(f"{f.path}: {k}embedding_length {hidden} is not divisible by the head count")
        head_dim = hidden // num_heads
    value_dim = f.get_int(k + "attention.value_length", head_dim)
    if value_dim != head_dim:
        raise UnsupportedModelError(f"{f.path}: {k}attention.value_length {value_dim} differs from key_length")
    if head_dim % 2:
        raise ModelLoadError(f"{f.path}: head size {head_dim} must be even for rotary embeddings")
    rotary_dim = f.get_int(k + "rope.dimension_count", head_dim)
    if rotary_dim > head_dim or rotary_dim % 2:
        raise ModelLoadError(f"{f.path}: {k}rope.dimension_count {rotary_dim} must be even and at most the "
                             f"head size {head_dim}")

    vocab = f.get_int(k + "vocab_size", None)
    if vocab is None:
        tokens = f.get_list("tokenizer.ggml.tokens", str, None)
        embd = f.tensors.get("token_embd.weight")
        if tokens is not None:
            vocab = len(tokens)
        elif embd is not None:
            vocab = embd.shape[0]
        else:
            raise ModelLoadError(f"{f.path}: missing metadata key {k + 'vocab_size'!r} and no tokenizer.ggml.tokens")
    max_pos = f.get_int(k + "context_length", 2048)
    bos = f.token_id("tokenizer.ggml.bos_token_id", vocab)
    eos_ids = tuple(
        i for i in (f.token_id(key, vocab) for key in (
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"))
        if i is not None
    )
    rope = RopeSpec(f.get_float(k + "rope.freq_base", 10000.0), gguf_rope_scaling(f, k, rotary_dim, max_pos),
                    rotary_dim)
    return dict(
        architecture=architecture,
        model_type=arch,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=f.get_int(k + "feed_forward_length"),
        vocab_size=vocab,
        rms_norm_eps=f.get_float(k + "attention.layer_norm_rms_epsilon", 1e-6),
        max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in f.tensors,
        qkv_bias="blk.0.attn_q.bias" in f.tensors or "blk.0.attn_qkv.bias" in f.tensors,
        o_bias="blk.0.attn_output.bias" in f.tensors,
        mlp_bias="blk.0.ffn_up.bias" in f.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
        sliding_window=None,
        layer_sliding_windows=(None,) * num_layers,
        torch_dtype=gguf_dtype(f),
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        ropes=(rope,),
        layer_ropes=(0,) * num_layers,
        attention_scale=f.get_float(k + "attention.scale", head_dim**-0.5),
    )


def gguf_windows(f: GGUFFile, arch: str, num_layers: int, default_period: Optional[int]) -> dict[str, Any]:
    """sliding_window / layer_sliding_windows from `{arch}.attention.sliding_window` and
    `{arch}.attention.sliding_window_pattern` (a period n: layers i with i % n < n - 1 slide, as
    llama.cpp's set_swa_pattern; or one bool per layer). Without a pattern key, `default_period`
    (llama.cpp's hard-wired one for the architecture; None: every layer slides)."""
    k = arch + "."
    window = f.get_int(k + "attention.sliding_window", None)
    if window is None:
        return dict(sliding_window=None, layer_sliding_windows=(None,) * num_layers)
    key = k + "attention.sliding_window_pattern"
    raw = f.metadata.get(key)
    if isinstance(raw, list):
        if len(raw) != num_layers or not all(isinstance(b, bool) for b in raw):
            raise ModelLoadError(f"{f.path}: metadata key {key!r} must list {num_layers} booleans")
        sliding = list(raw)
    else:
        period = f.get_int(key, default_period)
        sliding = [True] * num_layers if period is None else [i % period < period - 1 for i in range(num_layers)]
    return dict(sliding_window=window, layer_sliding_windows=tuple(window if s else None for s in sliding))


def gguf_rope_scaling(f: GGUFFile, k: str, rotary_dim: int, max_pos: int) -> Optional[RopeScaling]:
    """`{arch}.rope.scaling.*`: none, linear or yarn; longrope when the file has the
    rope_factors_long/short tensors (Phi-3)."""
    orig = f.get_int(k + "rope.scaling.original_context_length", max_pos)
    if "rope_factors_long.weight" in f.tensors or "rope_factors_short.weight" in f.tensors:
        short, long = (_factor_tensor(f, f"rope_factors_{n}.weight", rotary_dim) for n in ("short", "long"))
        factor = max_pos / orig
        default_attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        return RopeScaling("longrope", factor, original_max_position_embeddings=orig, short_factor=short,
                           long_factor=long, attention_factor=f.get_float(k + "rope.scaling.attn_factor",
                                                                           default_attn))
    kind = f.get_str(k + "rope.scaling.type", "none")
    if kind == "none":
        if "rope_freqs.weight" in f.tensors:
            raise UnsupportedModelError(
                f"{f.path}: tensor 'rope_freqs.weight' (llama3-style per-frequency RoPE factors) is not supported"
            )
        return None
    if kind == "linear":
        return RopeScaling("linear", f.get_float(k + "rope.scaling.factor"))
    if kind == "yarn":
        factor = f.get_float(k + "rope.scaling.factor")
        attn = f.get_float(k + "rope.scaling.attn_factor", 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0)
        return RopeScaling("yarn", factor, original_max_position_embeddings=orig, attention_factor=attn,
                           beta_fast=f.get_float(k + "rope.scaling.yarn_beta_fast", 32.0),
                           beta_slow=f.get_float(k + "rope.scaling.yarn_beta_slow", 1.0))
    raise UnsupportedModelError(
        f"{f.path}: metadata key {k + 'rope.scaling.type'!r} is {kind!r}; supported: none, linear, yarn"
    )


def _factor_tensor(f: GGUFFile, name: str, rotary_dim: int) -> tuple[float, ...]:
    t = f.tensors.get(name)
    if t is None or t.type_name != "F32" or tuple(t.shape) != (rotary_dim // 2,):
        raise ModelLoadError(f"{f.path}: tensor {name!r} must be F32 of shape [{rotary_dim // 2}] (rotary dim / 2)")
    return tuple(float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1))
