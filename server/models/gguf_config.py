"""ModelConfig from a GGUF file's metadata: llama.cpp's `{arch}.*` keys mapped onto our native fields.

Torch-free. It owns which GGUF architectures pagewire runs and what each implies (Qwen2's qkv bias,
Qwen3's q/k norm and explicit key length, Mistral's sliding window), and the `dtype="auto"` rule for
GGUF files: the float type the weights are stored in, or float32 for quantised files (dequantised
exactly, as transformers does).
"""
from __future__ import annotations

from typing import Optional

from server.models.config import ModelConfig, ModelLoadError, RopeScaling, UnsupportedModelError
from server.models.gguf_file import GGUFFile

# GGUF architecture -> (HF architecture name, our switches).
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# llama.cpp's converter permutes Q/K rows for these (they rotate interleaved pairs in ggml);
# Qwen files keep the HF "rotate half" row order.
PERMUTED_QK_ARCHITECTURES = ("llama", "mistral")
_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def gguf_architecture(f: GGUFFile) -> str:
    """`general.architecture`, checked against the supported ones (the error lists them)."""
    arch = f.get_str("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{f.path}: general.architecture {arch!r} is not supported; "
            f"supported architectures: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def gguf_dtype(f: GGUFFile) -> str:
    """The dtype "auto" resolves to: the one float type of the 2-D weights, else float32."""
    kinds = {t.type_name for t in f.tensors.values() if len(t.shape) >= 2}
    if len(kinds) == 1 and next(iter(kinds)) in _FLOAT_TYPES:
        return _FLOAT_TYPES[next(iter(kinds))]
    return "float32"


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    """Raises UnsupportedModelError (unknown arch, RoPE scaling) or ModelLoadError naming file and key."""
    arch = gguf_architecture(f)
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
    # Qwen3 (and any file with a decoupled head size) states key_length; else hidden / heads.
    head_dim = f.get_int(k + "attention.key_length", None)
    if head_dim is None:
        if hidden % num_heads:
            raise ModelLoadError(f"{f.path}: {k}embedding_length {hidden} is not divisible by the head count")
        head_dim = hidden // num_heads
    value_dim = f.get_int(k + "attention.value_length", head_dim)
    if value_dim != head_dim:
        raise UnsupportedModelError(f"{f.path}: {k}attention.value_length {value_dim} differs from key_length")
    rope_dims = f.get_int(k + "rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise UnsupportedModelError(
            f"{f.path}: {k}rope.dimension_count {rope_dims} (partial rotary) is not supported; head size is {head_dim}"
        )
    if head_dim % 2:
        raise ModelLoadError(f"{f.path}: head size {head_dim} must be even for rotary embeddings")

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

    window = f.get_int(k + "attention.sliding_window", None)
    if arch not in ("llama", "mistral"):
        window = None  # Qwen files carry no per-layer pattern; llama.cpp runs them without a window
    bos = f.token_id("tokenizer.ggml.bos_token_id", vocab)
    eos_ids = tuple(
        i for i in (f.token_id(key, vocab) for key in (
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"))
        if i is not None
    )
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        model_type=arch,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=f.get_int(k + "feed_forward_length"),
        vocab_size=vocab,
        rms_norm_eps=f.get_float(k + "attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=f.get_float(k + "rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(f, k),
        max_position_embeddings=f.get_int(k + "context_length", 2048),
        tie_word_embeddings="output.weight" not in f.tensors,
        qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in f.tensors,
        o_bias="blk.0.attn_output.bias" in f.tensors,
        mlp_bias="blk.0.ffn_up.bias" in f.tensors,
        qk_norm=arch == "qwen3",
        sliding_window=window,
        layer_sliding_windows=(window,) * num_layers,
        torch_dtype=gguf_dtype(f),
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
    )


def _rope_scaling(f: GGUFFile, k: str) -> Optional[RopeScaling]:
    kind = f.get_str(k + "rope.scaling.type", "none")
    if kind == "none":
        if "rope_freqs.weight" in f.tensors:
            raise UnsupportedModelError(
                f"{f.path}: tensor 'rope_freqs.weight' (llama3-style per-frequency RoPE factors) is not supported"
            )
        return None
    if kind == "linear":
        return RopeScaling("linear", f.get_float(k + "rope.scaling.factor"))
    raise UnsupportedModelError(
        f"{f.path}: metadata key {k + 'rope.scaling.type'!r} is {kind!r}; supported: none, linear"
    )
