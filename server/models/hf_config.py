"""The shared half of every Hugging Face translation: `config.json` fields read with errors that
name the file and the field, in transformers-4 or transformers-5 layout.

`hf_base` reads what all families spell the same way (sizes, heads, norms' epsilon, biases,
dtype, special ids, RoPE) into ModelConfig keyword arguments; each family's translation in
server.models.families then overrides its own parts. Torch-free.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from server.models.config import ModelLoadError, RopeScaling, RopeSpec, UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_LAYER_TYPES = ("full_attention", "sliding_attention")


class HFFields:
    """Typed reads from the raw dict with errors that name the source file and the field."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    _REQUIRED = object()

    def positive_int(self, key: str, default: Any = _REQUIRED) -> Any:
        v = self.raw.get(key)
        if v is None:
            if default is HFFields._REQUIRED:
                raise ModelLoadError(f"{self.source}: missing required field {key!r}")
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ModelLoadError(f"{self.source}: field {key!r} must be a positive integer, got {v!r}")
        return v

    def number(self, key: str, default: Optional[float]) -> Any:
        v = self.raw.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ModelLoadError(f"{self.source}: field {key!r} must be a number, got {v!r}")
        return float(v)

    def layer_types(self, num_layers: int) -> Optional[list[str]]:
        """`layer_types` ("sliding_attention" / "full_attention" per layer), if the config has it."""
        types = self.raw.get("layer_types")
        if types is None:
            return None
        if (not isinstance(types, list) or len(types) != num_layers
                or not all(t in ("sliding_attention", "full_attention") for t in types)):
            raise ModelLoadError(f"{self.source}: field 'layer_types' must list {num_layers} entries, each "
                                 "'sliding_attention' or 'full_attention'")
        return types

    def window(self) -> Optional[int]:
        window = self.raw.get("sliding_window")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ModelLoadError(f"{self.source}: field 'sliding_window' must be a positive integer or null, "
                                 f"got {window!r}")
        return window


def hf_base(raw: dict[str, Any], source: str, architecture: str,
            activations: Sequence[str] = ("silu",)) -> dict[str, Any]:
    """ModelConfig keyword arguments as a Llama-style config spells them: full attention, one
    RoPE table, pre-norm, attention_bias for all four projections. `activations` are the
    internal names ("silu", "gelu_tanh") this family may use."""
    p = HFFields(raw, source)
    act_raw = raw.get("hidden_activation", raw.get("hidden_act", "silu"))
    activation = _ACTIVATIONS.get(str(act_raw))
    if activation not in activations:
        allowed = ", ".join(repr(k) for k, v in _ACTIVATIONS.items() if v in activations)
        raise UnsupportedModelError(f"{source}: hidden_act {act_raw!r} is not supported (only {allowed})")

    hidden_size = p.positive_int("hidden_size")
    num_heads = p.positive_int("num_attention_heads")
    num_kv_heads = p.positive_int("num_key_value_heads", default=num_heads)
    # An explicit head_dim wins (Qwen3, Gemma and some Mistrals decouple it from hidden/heads);
    # transformers treats head_dim: null the same as absent.
    head_dim = p.positive_int("head_dim", default=None)
    if head_dim is None:
        if hidden_size % num_heads:
            raise ModelLoadError(
                f"{source}: hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads}"
            )
        head_dim = hidden_size // num_heads
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
        )
    if head_dim % 2:
        raise ModelLoadError(f"{source}: head_dim {head_dim} must be even for rotary embeddings")
    num_layers = p.positive_int("num_hidden_layers")
    max_pos = p.positive_int("max_position_embeddings", default=2048)
    ropes, layer_ropes = hf_ropes(raw, source, head_dim, max_pos, p.layer_types(num_layers), num_layers)

    attention_bias = bool(raw.get("attention_bias", False))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(int(x) for x in eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
    bos = raw.get("bos_token_id")
    return dict(
        architecture=architecture,
        model_type=str(raw.get("model_type", "")),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=p.positive_int("intermediate_size"),
        vocab_size=p.positive_int("vocab_size"),
        rms_norm_eps=p.number("rms_norm_eps", default=1e-6),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=False,
        sliding_window=None,
        layer_sliding_windows=(None,) * num_layers,
        torch_dtype=checkpoint_dtype(raw, source),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        ropes=ropes,
        layer_ropes=layer_ropes,
        attention_scale=head_dim**-0.5,
        activation=activation,
    )


def windows(p: HFFields, num_layers: int, window: Optional[int],
            default_sliding: Sequence[bool]) -> dict[str, Any]:
    """sliding_window / layer_sliding_windows: `layer_types` when present, else `default_sliding`
    (the family's rule: every layer, alternate, 5 of 6, ...); no window means no sliding layer."""
    if window is None:
        return dict(sliding_window=None, layer_sliding_windows=(None,) * num_layers)
    types = p.layer_types(num_layers)
    sliding = [t == "sliding_attention" for t in types] if types is not None else list(default_sliding)
    return dict(sliding_window=window, layer_sliding_windows=tuple(window if s else None for s in sliding))


def hf_ropes(raw: dict[str, Any], source: str, head_dim: int, max_pos: int, layer_types: Optional[list[str]],
             num_layers: int) -> tuple[tuple[RopeSpec, ...], tuple[Optional[int], ...]]:
    """(tables, each layer's table) from either layout.

    transformers 5 writes `rope_parameters: {rope_type, rope_theta, factor, ...}`, or one such dict
    per layer type (Gemma 3's local and global bases); transformers 4 writes `rope_theta` and
    `rope_scaling: {rope_type|type, factor, ...}` at the top level.
    """
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ModelLoadError(f"{source}: field 'rope_parameters' must be an object, got {params!r}")
    per_type = {k: v for k, v in (params or {}).items() if k in _LAYER_TYPES and isinstance(v, dict)}
    if per_type:  # transformers keeps (and ignores) flat keys beside them in some configs
        params = per_type
        kinds = sorted(params)
        specs = tuple(rope_spec(params[k], raw, source, f"rope_parameters.{k}", head_dim, max_pos) for k in kinds)
        if layer_types is None:
            raise ModelLoadError(f"{source}: per-layer-type 'rope_parameters' need 'layer_types'")
        missing = sorted(set(layer_types) - set(kinds))
        if missing:
            raise ModelLoadError(f"{source}: 'rope_parameters' has no entry for layer type {missing[0]!r}")
        return specs, tuple(kinds.index(t) for t in layer_types)
    if params is not None:
        spec = rope_spec(params, raw, source, "rope_parameters", head_dim, max_pos)
    else:
        scaling = raw.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ModelLoadError(f"{source}: field 'rope_scaling' must be an object, got {scaling!r}")
        spec = rope_spec(scaling or {}, raw, source, "rope_scaling", head_dim, max_pos)
    return (spec,), (0,) * num_layers


def rope_spec(params: dict[str, Any], raw: dict[str, Any], source: str, field: str, head_dim: int,
              max_pos: int) -> RopeSpec:
    """One table's base, scaling and rotary dim; keys missing from `params` fall back to the
    config's top level (transformers 4 kept rope_theta, partial_rotary_factor and
    original_max_position_embeddings there)."""
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelLoadError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    prf = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1:
        raise ModelLoadError(f"{source}: partial_rotary_factor must be in (0, 1], got {prf!r}")
    if params.get("rope_type") == "proportional":  # Gemma 4: a whole-head table, partly still
        factor = params.get("factor", 1.0)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ModelLoadError(f"{source}: {field}.factor must be a positive number, got {factor!r}")
        return RopeSpec(float(theta), RopeScaling("proportional", float(factor), proportion=float(prf)), head_dim)
    rotary_dim = int(head_dim * prf)
    if rotary_dim % 2:
        raise ModelLoadError(f"{source}: head_dim x partial_rotary_factor = {rotary_dim} must be even")
    return RopeSpec(float(theta), _scaling(params, raw, source, field, rotary_dim, max_pos), rotary_dim)


def _scaling(params: dict[str, Any], raw: dict[str, Any], source: str, field: str, rotary_dim: int,
             max_pos: int) -> Optional[RopeScaling]:
    # Old transformers-4 configs spell the kind "type" instead of "rope_type".
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: {field}.rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )

    def number(key: str, default: Any = None) -> float:
        v = params.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ModelLoadError(f"{source}: {field}.{key} must be a number for rope_type {rope_type!r}, got {v!r}")
        return float(v)

    def orig_max() -> int:
        orig = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings", max_pos))
        if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
            raise ModelLoadError(f"{source}: {field}.original_max_position_embeddings must be a positive integer")
        return orig

    if rope_type == "linear":
        return RopeScaling("linear", number("factor"))
    if rope_type == "llama3":
        low, high = number("low_freq_factor"), number("high_freq_factor")
        if high <= low:
            raise ModelLoadError(f"{source}: {field}.high_freq_factor must exceed low_freq_factor")
        return RopeScaling("llama3", number("factor"), low, high, orig_max())
    orig = orig_max()
    factor = number("factor") if params.get("factor") is not None else max_pos / orig
    attention = params.get("attention_factor")
    if rope_type == "yarn":
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention is None:
            m, m_all = params.get("mscale"), params.get("mscale_all_dim")
            attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        return RopeScaling("yarn", factor, original_max_position_embeddings=orig,
                           attention_factor=float(attention), beta_fast=float(params.get("beta_fast") or 32),
                           beta_slow=float(params.get("beta_slow") or 1), truncate=bool(params.get("truncate", True)))
    # longrope (Phi-3): per-frequency short and long divisors.
    lists = {}
    for key in ("short_factor", "long_factor"):
        v = params.get(key)
        if (not isinstance(v, list) or len(v) != rotary_dim // 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
            raise ModelLoadError(f"{source}: {field}.{key} must list {rotary_dim // 2} numbers (rotary dim / 2)")
        lists[key] = tuple(float(x) for x in v)
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return RopeScaling("longrope", factor, original_max_position_embeddings=orig, short_factor=lists["short_factor"],
                       long_factor=lists["long_factor"], attention_factor=float(attention))


def checkpoint_dtype(raw: dict[str, Any], source: str) -> str:
    """The checkpoint's dtype name: transformers 5 writes `dtype`, 4 writes `torch_dtype`; default float32."""
    value = raw.get("dtype", raw.get("torch_dtype"))
    if value is None:
        return "float32"
    name = _DTYPE_NAMES.get(str(value).removeprefix("torch."))
    if name is None:
        raise UnsupportedModelError(
            f"{source}: dtype {value!r} is not supported; supported: float32, bfloat16, float16"
        )
    return name
