"""The registry of architectures pagewire runs: one `Architecture` entry per family.

Each entry names the family's Hugging Face `architectures` values and llama.cpp GGUF
`general.architecture` values, holds its two translations (config.json -> ModelConfig, GGUF
metadata -> ModelConfig), whether llama.cpp permuted its Q/K rows, and the model class as an
import path (resolved lazily: the registry is torch-free, so `pagewire plan` and the draft-model
checks use it without loading torch). The layers' KV specs (`kv_specs`) come from the shared
config, so the allocator's KV groups read one description for every family.

The entries themselves live in server.models.families; adding a family is one entry there.
Reading a model's config (`read_model_config`: a folder's config.json or a GGUF file's metadata)
goes through here, so every caller gets the same translation.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from server.jsonfile import read_json_object
from server.models.architecture import Architecture, KVSpec
from server.models.config import ModelConfig, ModelFileNotFoundError, ModelLoadError, UnsupportedModelError
from server.models.families import FAMILIES
from server.models.state_specs import attention_layers

if TYPE_CHECKING:  # pragma: no cover
    from server.models.gguf_file import GGUFFile
    from server.models.protocol import CausalLMClass

__all__ = ["Architecture", "KVSpec", "architectures", "read_model_config", "config_from_hf", "config_from_gguf",
           "hf_config_from_dir", "kv_specs", "kv_shape", "model_class", "gguf_permuted_qk"]


def architectures() -> list[Architecture]:
    """Every registered family, in the README's order."""
    return FAMILIES


def read_model_config(path: str | Path) -> ModelConfig:
    """The config of a Hugging Face folder (config.json) or a GGUF file (its metadata only)."""
    from server.models.gguf_file import GGUFFile, is_gguf_path

    if is_gguf_path(path):
        return config_from_gguf(GGUFFile.open(path))
    return hf_config_from_dir(path)


def hf_config_from_dir(model_dir: str | Path) -> ModelConfig:
    """Read `<model_dir>/config.json`; raises ModelFileNotFoundError naming the missing path."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelFileNotFoundError(model_dir, "model directory")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelFileNotFoundError(path, "model config")
    return config_from_hf(read_json_object(path, ModelLoadError), source=str(path))


def supported_hf_names() -> tuple[str, ...]:
    return tuple(n for a in architectures() for n in a.hf_names)


def supported_gguf_names() -> tuple[str, ...]:
    return tuple(n for a in architectures() for n in a.gguf_names)


def by_hf_name(name: str) -> Optional[Architecture]:
    return next((a for a in architectures() if name in a.hf_names), None)


def by_gguf_name(name: str) -> Optional[Architecture]:
    return next((a for a in architectures() if name in a.gguf_names), None)


def architecture_of(config: ModelConfig) -> Architecture:
    """The entry a config was translated by (its `architecture` is always an HF name)."""
    arch = by_hf_name(config.architecture)
    if arch is None:
        raise UnsupportedModelError(f"architecture {config.architecture} is not supported")
    return arch


def config_from_hf(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The first of `raw["architectures"]` that pagewire supports, translated; the error lists
    the supported names."""
    names = raw.get("architectures") or []
    supported = ", ".join(supported_hf_names())
    if not isinstance(names, list) or not names:
        raise UnsupportedModelError(f"{source}: no 'architectures' entry; supported architectures: {supported}")
    for name in names:
        arch = by_hf_name(str(name))
        if arch is not None:
            return arch.hf(raw, source, str(name))
    raise UnsupportedModelError(
        f"{source}: architecture {', '.join(map(str, names))} is not supported; supported architectures: {supported}"
    )


def config_from_gguf(f: "GGUFFile") -> ModelConfig:
    """`general.architecture`'s translation; the error lists the supported names."""
    name = f.get_str("general.architecture")
    arch = by_gguf_name(name)
    if arch is None or arch.gguf is None:
        raise UnsupportedModelError(
            f"{f.path}: general.architecture {name!r} is not supported; "
            f"supported architectures: {', '.join(supported_gguf_names())}"
        )
    return arch.gguf(f, name)


def gguf_permuted_qk(config: ModelConfig) -> bool:
    """Whether a GGUF file of this config's family stores Q/K rows in llama.cpp's permuted order."""
    return architecture_of(config).gguf_permuted_qk


def kv_specs(config: ModelConfig) -> tuple[KVSpec, ...]:
    """Per KV layer, what it keeps in the KV cache (its shape, its sliding window or every token), or
    which earlier layer's KV it reads. The KV layers are every layer, or a hybrid model's attention
    layers only (state_specs.attention_layers: its recurrent layers keep state slots instead)."""
    c = config
    return tuple(KVSpec(c.kv_heads_of(i), c.head_dim_of(i), c.layer_sliding_windows[i],
                        None if c.kv_source(i) == i else c.kv_source(i))
                 for i in attention_layers(c))


def kv_shape(config: ModelConfig) -> dict[str, Any]:
    """server.engine.kv_budget.kv_layout's model arguments for `config`: the layer count, shape
    and windows, plus per-layer sizes and sources when the layers differ (Gemma 4)."""
    specs = kv_specs(config)
    out: dict[str, Any] = dict(num_layers=len(specs), num_kv_heads=config.num_kv_heads,
                               head_dim=config.head_dim, layer_windows=[s.sliding_window for s in specs])
    if any((s.num_kv_heads, s.head_dim, s.kv_source) != (config.num_kv_heads, config.head_dim, None) for s in specs):
        out.update(layer_elems=[s.num_kv_heads * s.head_dim for s in specs],
                   layer_sources=[s.kv_source for s in specs])
    return out


def model_class(config: ModelConfig) -> "CausalLMClass":
    return architecture_of(config).model_class()
