"""server.models: model configs, checkpoint loading and the paged-attention model implementations.

`ModelConfig` and the error types are torch-free; `load_model` and the model classes import torch
and the compiled ops, so they are resolved lazily on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from server.models.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    ModelFileNotFoundError,
    ModelLoadError,
    RopeScaling,
    UnsupportedModelError,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "ModelFileNotFoundError",
    "ModelLoadError",
    "RopeScaling",
    "UnsupportedModelError",
    "load_model",
    "LlamaFamilyForCausalLM",
]

if TYPE_CHECKING:  # pragma: no cover
    from server.models.llama import LlamaFamilyForCausalLM
    from server.models.loader import load_model


def __getattr__(name: str) -> Any:
    if name == "load_model":
        from server.models.loader import load_model

        return load_model
    if name == "LlamaFamilyForCausalLM":
        from server.models.llama import LlamaFamilyForCausalLM

        return LlamaFamilyForCausalLM
    raise AttributeError(name)
