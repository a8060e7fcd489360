"""Fixtures for the gateway tests: the demo model, and an in-process server (uvicorn on a thread)
whose quota clock the test can move, so rate-limit windows pass without sleeping."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx
import pytest

from tests.server.harness import db_arg, free_port


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from server.models.demo_model import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("pagewire-cache"))


class FakeClock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


class InProcessServer:
    """A real pagewire app served by uvicorn on a background thread, in this process."""

    def __init__(self, demo_model: Path, db: Path, models: Optional[dict[str, Path]] = None,
                 **settings: Any) -> None:
        """`models` (name → path): serve these (the first the default) instead of the demo model."""
        import uvicorn

        from server.serve import compose
        from server.serving.model_catalog import ModelEntry
        from server.serving.settings import ServeSettings

        self.port = free_port()
        self.settings = ServeSettings(host="127.0.0.1", port=self.port, db=db_arg(db), max_num_seqs=8,
                                      kv_cache_tokens=4096, max_num_batched_tokens=256, num_threads=1,
                                      **settings)
        entries = [ModelEntry(n, p, "--model") for n, p in (models or {}).items()]
        if entries:
            self.rt, self.gateway, app = compose(self.settings, entries[0].path, entries[0].name, models=entries)
        else:
            self.rt, self.gateway, app = compose(self.settings, demo_model, "demo")
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, loop="asyncio",
                                lifespan="on", ws="websockets", log_level="warning",
                                ws_ping_interval=None, ws_ping_timeout=None)  # as serve.py: pagewire pings
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> "InProcessServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if not self.thread.is_alive():
                raise RuntimeError("in-process server exited")
            self.thread.join(0.1)
        raise RuntimeError("in-process server did not become healthy")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture
def make_key(tmp_path: Path) -> Any:
    """make_key(db, name, **limits) -> (key_id, secret), written by the keys CLI's own store."""
    from server.gateway.cli import _open_for_keys
    from server.gateway.keys import KeyStore
    from server.serving.db_url import parse_db

    def make(db: Path, name: str, **limits: Any) -> tuple[str, str]:
        conn, lock = _open_for_keys(parse_db(db_arg(db)))
        try:
            key, secret = KeyStore(conn).create(name, **limits)
        finally:
            conn.close()
            if lock is not None:
                lock.release()
        return key.key_id, secret

    return make


@pytest.fixture
def in_process(demo_model: Path) -> Iterator[Any]:
    servers: list[InProcessServer] = []

    def start(db: Path, models: Optional[dict[str, Path]] = None, **settings: Any) -> InProcessServer:
        s = InProcessServer(demo_model, db, models, **settings).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()
