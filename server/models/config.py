"""ModelConfig: a Hugging Face `config.json` parsed into the few native fields our models use.

It owns the knowledge of how the supported architectures spell things (transformers 4 vs 5 RoPE
keys, Qwen2's implicit qkv bias, which layers slide) so the model code reads plain attributes.
It also owns the model-loading error types, so callers can catch one family of exceptions.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from server.jsonfile import read_json_object

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
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
    """RoPE frequency scaling as transformers applies it to `inv_freq`.

    rope_type: "linear" divides every frequency by `factor`; "llama3" divides only low
    frequencies by `factor` and interpolates the band between low/high_freq_factor.
    """

    rope_type: str
    factor: float
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    original_max_position_embeddings: Optional[int] = None


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape and numerics. `layer_sliding_windows[i]` is the window of layer i (None = full)."""

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
    rope_theta: float
    rope_scaling: Optional[RopeScaling]
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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read `<model_dir>/config.json`; raises ModelFileNotFoundError naming the missing path."""
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelFileNotFoundError(model_dir, "model directory")
        path = model_dir / "config.json"
        if not path.is_file():
            raise ModelFileNotFoundError(path, "model config")
        return cls.from_dict(read_json_object(path, ModelLoadError), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Parse a config dict in transformers-4 or transformers-5 layout.

        Raises UnsupportedModelError for other architectures/RoPE types, ModelLoadError for
        missing or ill-typed fields (the message names `source` and the field).
        """
        p = _Fields(raw, source)
        architecture = _architecture(raw, source)
        model_type = str(raw.get("model_type", ""))

        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {hidden_act!r} is not supported (only 'silu')")

        hidden_size = p.positive_int("hidden_size")
        num_heads = p.positive_int("num_attention_heads")
        num_kv_heads = p.positive_int("num_key_value_heads", default=num_heads)
        # An explicit head_dim wins (Qwen3 and some Mistrals decouple it from hidden/heads);
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

        rope_theta, rope_scaling = _rope(raw, source)
        sliding_window, layer_windows = _sliding_windows(raw, architecture, num_layers, source)

        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(int(x) for x in eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        bos = raw.get("bos_token_id")

        return cls(
            architecture=architecture,
            model_type=model_type,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=p.positive_int("intermediate_size"),
            vocab_size=p.positive_int("vocab_size"),
            rms_norm_eps=p.number("rms_norm_eps", default=1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=p.positive_int("max_position_embeddings", default=2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and never an o_proj bias, whatever attention_bias says.
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=sliding_window,
            layer_sliding_windows=layer_windows,
            torch_dtype=_checkpoint_dtype(raw, source),
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
        )


class _Fields:
    """Typed reads from the raw dict with errors that name the source file and the field."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    _REQUIRED = object()

    def positive_int(self, key: str, default: Any = _REQUIRED) -> Any:
        v = self.raw.get(key)
        if v is None:
            if default is _Fields._REQUIRED:
                raise ModelLoadError(f"{self.source}: missing required field {key!r}")
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ModelLoadError(f"{self.source}: field {key!r} must be a positive integer, got {v!r}")
        return v

    def number(self, key: str, default: float) -> float:
        v = self.raw.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ModelLoadError(f"{self.source}: field {key!r} must be a number, got {v!r}")
        return float(v)


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise UnsupportedModelError(
            f"{source}: no 'architectures' entry; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise UnsupportedModelError(
        f"{source}: architecture {', '.join(map(str, archs))} is not supported; "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(raw: dict[str, Any], source: str) -> tuple[float, Optional[RopeScaling]]:
    """Return (rope_theta, scaling) from either layout.

    transformers 5 writes `rope_parameters: {rope_type, rope_theta, factor, ...}`; transformers 4
    writes `rope_theta` and `rope_scaling: {rope_type|type, factor, ...}` at the top level.
    """
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ModelLoadError(f"{source}: field 'rope_parameters' must be an object, got {params!r}")
        if params and all(isinstance(v, dict) for v in params.values()):
            raise UnsupportedModelError(f"{source}: per-layer-type 'rope_parameters' are not supported")
        scaling_raw: Optional[dict[str, Any]] = params
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        field = "rope_parameters"
    else:
        scaling_raw = raw.get("rope_scaling")
        if scaling_raw is not None and not isinstance(scaling_raw, dict):
            raise ModelLoadError(f"{source}: field 'rope_scaling' must be an object, got {scaling_raw!r}")
        theta = raw.get("rope_theta", 10000.0)
        field = "rope_scaling"
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelLoadError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    if not scaling_raw:
        return float(theta), None

    # Old transformers-4 configs spell the kind "type" instead of "rope_type".
    rope_type = scaling_raw.get("rope_type", scaling_raw.get("type", "default"))
    prf = scaling_raw.get("partial_rotary_factor", 1.0)
    if prf != 1.0:
        raise UnsupportedModelError(f"{source}: {field}.partial_rotary_factor {prf!r} is not supported")
    if rope_type == "default":
        return float(theta), None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: {field}.rope_type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )

    def number(key: str) -> float:
        v = scaling_raw.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ModelLoadError(f"{source}: {field}.{key} must be a number for rope_type {rope_type!r}, got {v!r}")
        return float(v)

    factor = number("factor")
    if rope_type == "linear":
        return float(theta), RopeScaling("linear", factor)
    low, high = number("low_freq_factor"), number("high_freq_factor")
    if high <= low:
        raise ModelLoadError(f"{source}: {field}.high_freq_factor must exceed low_freq_factor")
    orig = scaling_raw.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise ModelLoadError(f"{source}: {field}.original_max_position_embeddings must be a positive integer")
    return float(theta), RopeScaling("llama3", factor, low, high, orig)


def _sliding_windows(
    raw: dict[str, Any], architecture: str, num_layers: int, source: str
) -> tuple[Optional[int], tuple[Optional[int], ...]]:
    """Which layers attend through a sliding window, following each architecture's transformers rule."""
    window = raw.get("sliding_window")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window", False):
        # Qwen configs carry a sliding_window value even when it is switched off.
        window = None
    if architecture == "LlamaForCausalLM":
        window = None
    if window is None:
        return None, (None,) * num_layers
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"{source}: field 'sliding_window' must be a positive integer or null, got {window!r}")

    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ModelLoadError(f"{source}: field 'layer_types' must list {num_layers} entries")
        return window, tuple(window if t == "sliding_attention" else None for t in layer_types)
    if architecture == "MistralForCausalLM":
        return window, (window,) * num_layers
    # Qwen2/Qwen3: only layers from max_window_layers on slide.
    first = raw.get("max_window_layers", 28)
    return window, tuple(window if i >= first else None for i in range(num_layers))


def _checkpoint_dtype(raw: dict[str, Any], source: str) -> str:
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
