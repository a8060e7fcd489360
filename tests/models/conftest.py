"""Fixtures for the model tests: tiny checkpoint folders built once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.paged_harness import ARCHS, VOCAB
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One float32 v5 checkpoint per architecture, shared by every test that only reads it."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(root / arch, arch, vocab_size=VOCAB) for arch in ARCHS}
