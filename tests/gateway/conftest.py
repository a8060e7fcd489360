"""Fixtures for the gateway tests: the demo model, built once per session in a temp dir."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from server.models.demo_model import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("pagewire-cache"))
