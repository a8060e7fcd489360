"""Architecture and KVSpec: the shape of one registry entry, and of what one layer keeps in the
KV cache. Separate from the registry so the family modules can build entries without importing
the registry that lists them. Torch-free.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from server.models.config import ModelConfig

if TYPE_CHECKING:  # pragma: no cover
    from server.models.gguf_file import GGUFFile
    from server.models.protocol import CausalLMClass

HFTranslation = Callable[[dict[str, Any], str, str], ModelConfig]  # (raw config, source, HF name)
GGUFTranslation = Callable[["GGUFFile", str], ModelConfig]  # (file, GGUF architecture)


@dataclass(frozen=True)
class Architecture:
    """One family: its HF `architectures` names and llama.cpp `general.architecture` names, the
    translation from each source into the shared ModelConfig, and `model`, "module:Class" of its
    CausalLM (imported only when a model is built)."""

    family: str
    hf_names: tuple[str, ...]
    gguf_names: tuple[str, ...]
    hf: HFTranslation
    gguf: Optional[GGUFTranslation]
    # llama.cpp's converter permutes Q/K rows for architectures it runs with "normal" (interleaved)
    # RoPE; files of NeoX-RoPE architectures keep HF's rotate-half order.
    gguf_permuted_qk: bool = False
    model: str = "server.models.decoder:DecoderForCausalLM"

    def model_class(self) -> "CausalLMClass":
        module, name = self.model.split(":")
        cls: CausalLMClass = getattr(importlib.import_module(module), name)
        return cls


@dataclass(frozen=True)
class KVSpec:
    """What one layer keeps in the KV cache: its kv heads, head size and attention window
    (None = every token), or, with `kv_source`, the earlier layer whose KV it reads instead of
    keeping its own (Gemma 4). Layers with equal specs can share a KV group."""

    num_kv_heads: int
    head_dim: int
    sliding_window: Optional[int]
    kv_source: Optional[int] = None
