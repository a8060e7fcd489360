"""Fixtures for the family tests: each family's tiny HF folder and its GGUF copy, built once."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

FAMILIES = ("gemma2", "gemma3", "gemma4", "phi3", "olmo2", "olmo3", "smollm3", "granite",
            "qwen3moe", "mixtral", "olmoe", "qwen2moe", "gpt_oss", "dots1", "glm4_moe", "ernie4_5_moe")


@pytest.fixture(scope="session")
def family_model(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """family_model(arch, "hf" | "gguf"): the tiny folder (tests.tiny_models' config for `arch`)
    or an F32 GGUF file written from it the way llama.cpp's converter lays one out."""
    from tests.gguf_files import write_gguf

    cache: dict[str, Path] = {}

    def make(arch: str, source: str) -> Path:
        hf_dir = tiny_model(arch)
        if source == "hf":
            return hf_dir
        if arch not in cache:
            cache[arch] = write_gguf(tmp_path_factory.mktemp(f"{arch}-gguf") / f"{arch}.gguf", hf_dir, "F32")
        return cache[arch]

    return make
