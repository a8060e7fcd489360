"""Fixtures for the server tests: the demo model (built once, in a temp dir) and a shared server."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.server.harness import ServerProcess


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The torch-free edge suite on Python 3.10 (make test-py310) has no torch to write weights with.
    pytest.importorskip("torch", reason="the demo model's weights need torch (make test runs this)")
    from server.models.demo_model import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("pagewire-cache"))


@pytest.fixture(scope="session")
def server(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server shared by the API tests. Short stream retention so resume-from-ledger is testable;
    a small body limit so the oversize checks stay cheap."""
    db = tmp_path_factory.mktemp("ledger") / "shared.db"
    proc = ServerProcess(demo_model, db, "--stream-retention", "1.0", "--max-request-bytes", "65536")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
