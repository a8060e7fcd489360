"""The registry of architectures pagewire runs: one `Architecture` entry per family.

Each entry names the family's Hugging Face `architectures` values and llama.cpp GGUF
`general.architecture` values, holds its two translations (config.json -> ModelConfig, GGUF
metadata -> ModelConfig), whether llama.cpp permuted its Q/K rows, and the model class as an
import path (resolved lazily: the registry is torch-free, so `pagewire plan` and the draft-model
checks use it without loading torch). The layers' KV specs (`kv_specs`) come from the shared
config, so the allocator's KV groups read one description for every family.

The entries themselves live in server.models.families; adding a family is one entry there.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from server.models.config import ModelConfig, UnsupportedModelError

if TYPE_CHECKING:  # pragma: no cover
    from server.models.gguf_file import GGUFFile
    from server.models.protocol import CausalLM

HFTranslation = Callable[[dict[str, Any], str, str], ModelConfig]  # (raw config, source, HF name)
GGUFTranslation = Callable[["GGUFFile", str], ModelConfig]  # (file, GGUF architecture)


@dataclass(frozen=True)
class Architecture:
    """One family. `hf` and `gguf` translate into the shared ModelConfig; `model` is
    "module:Class" of its CausalLM."""

    family: str
    hf_names: tuple[str, ...]
    gguf_names: tuple[str, ...]
    hf: HFTranslation
    gguf: Optional[GGUFTranslation]
    # llama.cpp's converter permutes Q/K rows for architectures it runs with "normal" (interleaved)
    # RoPE; files of NeoX-RoPE architectures keep HF's rotate-half order.
    gguf_permuted_qk: bool = False
    model: str = "server.models.decoder:DecoderForCausalLM"

    def model_class(self) -> "type[CausalLM]":
        module, name = self.model.split(":")
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class KVSpec:
    """What one layer keeps in the KV cache: its kv heads, head size and attention window
    (None = every token). Layers with equal specs can share a KV group."""

    num_kv_heads: int
    head_dim: int
    sliding_window: Optional[int]


_ENTRIES: list[Architecture] = []


def architectures() -> list[Architecture]:
    """Every registered family, in the README's order."""
    if not _ENTRIES:
        from server.models.families import FAMILIES

        _ENTRIES.extend(FAMILIES)
    return _ENTRIES


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


def config_from_hf(raw: dict[str, Any], source: str) -> ModelConfig:
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
    """Per layer, what it keeps in the KV cache (its sliding window, or every token)."""
    return tuple(KVSpec(config.num_kv_heads, config.head_dim, w) for w in config.layer_sliding_windows)


def model_class(config: ModelConfig) -> "type[CausalLM]":
    return architecture_of(config).model_class()
