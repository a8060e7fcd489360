"""server.models: model configs, the architecture registry, checkpoint loading and the
paged-attention decoder every family runs on.

`ModelConfig`, the registry and the error types are torch-free; `load_model` and the model
classes import torch and the compiled ops, so they are resolved lazily on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from server.models.config import (
    ModelConfig,
    ModelFileNotFoundError,
    ModelLoadError,
    RopeScaling,
    UnsupportedModelError,
)
from server.models.protocol import CausalLM

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "ModelConfig",
    "ModelFileNotFoundError",
    "ModelLoadError",
    "RopeScaling",
    "UnsupportedModelError",
    "load_model",
    "DecoderForCausalLM",
]

if TYPE_CHECKING:  # pragma: no cover
    from server.models.decoder import DecoderForCausalLM
    from server.models.loader import load_model

    SUPPORTED_ARCHITECTURES: tuple[str, ...]


def __getattr__(name: str) -> Any:
    if name == "SUPPORTED_ARCHITECTURES":  # every registered family's HF names
        from server.models.registry import supported_hf_names

        return supported_hf_names()
    if name == "load_model":
        from server.models.loader import load_model

        return load_model
    if name == "DecoderForCausalLM":
        from server.models.decoder import DecoderForCausalLM

        return DecoderForCausalLM
    raise AttributeError(name)
