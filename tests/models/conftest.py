"""Fixtures for the model tests: tiny checkpoint folders built once per session.

The repository root goes on sys.path so `tests.tiny_models` imports under a bare `pytest` too.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.tiny_models import make_tiny_model  # noqa: E402

VOCAB = 384
ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One float32 v5 checkpoint per architecture, shared by every test that only reads it."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(root / arch, arch, vocab_size=VOCAB) for arch in ARCHS}
