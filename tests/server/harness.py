"""A real pagewire server in a subprocess, on a free loopback port, for black-box tests.

`ServerProcess.start()` runs `python -m server.cli serve` with the demo model and a temp ledger,
then waits for /health 200. `stop()` sends SIGTERM (graceful) and escalates to SIGKILL, so no
test leaves a server behind even when it fails.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import httpx

REPO = Path(__file__).resolve().parents[2]

# Small engine knobs keep the suite fast on 2 CPU cores.
FAST_ENGINE = ["--max-num-seqs", "8", "--kv-cache-tokens", "4096", "--max-num-batched-tokens", "256",
               "--num-threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir: Optional[Path], db: Path, *extra: str, env: Optional[dict[str, str]] = None,
                 served_model_name: Optional[str] = "demo") -> None:
        """model_dir None runs `pagewire serve` with no model (the default one); served_model_name
        None keeps the server's own naming."""
        self.model_dir = model_dir
        self.served_model_name = served_model_name
        self.db = db
        self.extra = list(extra)
        self.env = env or {}
        self.port = free_port()
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.log_path = db.with_suffix(f".{self.port}.log")

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    def start(self, timeout: float = 300.0, healthy: bool = True) -> "ServerProcess":
        """Spawn the server and wait until /health is 200 (or, with healthy=False, answers at all)."""
        model = [str(self.model_dir)] if self.model_dir is not None else []
        name = ["--served-model-name", self.served_model_name] if self.served_model_name is not None else []
        cmd = [sys.executable, "-m", "server.cli", "serve", *model, "--port", str(self.port),
               "--db", db_arg(self.db), *name, "--log-level", "warning", *FAST_ENGINE, *self.extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(self.base + "/health", timeout=1.0).status_code == 200 or not healthy:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"server did not become healthy in {timeout}s:\n{self.read_log()}")

    def read_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """Graceful stop (SIGTERM); SIGKILL if it does not exit in time. Returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# -- the ledger backend under test ----------------------------------------------------------------
# PAGEWIRE_TEST_LEDGER=postgresql runs the suites built on these helpers (tests/gateway,
# tests/faults, tests/server) against a real PostgreSQL (tests/scaleout/postgres.py): each ledger
# path a test names stands for a fresh database on one server per test process, given to servers
# and the CLI as their --db (`db_arg`) and read back by `ledger_rows`. A test of the SQLite file
# itself (its lock, its permissions, a full disk under it, its old schema versions) is marked
# `sqlite_only`. Unset, or `sqlite`, is the embedded default.
LEDGER_BACKEND = os.environ.get("PAGEWIRE_TEST_LEDGER", "sqlite")
if LEDGER_BACKEND not in ("sqlite", "postgresql"):
    raise RuntimeError(f"PAGEWIRE_TEST_LEDGER: 'sqlite' or 'postgresql', not {LEDGER_BACKEND!r}")
ON_POSTGRES = LEDGER_BACKEND == "postgresql"
_pg_server: Any = None
_pg_urls: dict[str, str] = {}


def db_arg(db: Path) -> str:
    """The --db value a server or CLI under test gets for the ledger at `db`."""
    if not ON_POSTGRES:
        return str(db)
    global _pg_server
    key = str(Path(db).resolve())
    if key not in _pg_urls:
        if _pg_server is None:
            import atexit

            from tests.scaleout.postgres import PostgresServer, missing_reason

            reason = missing_reason()
            if reason is not None:
                raise RuntimeError(f"PAGEWIRE_TEST_LEDGER=postgresql: {reason}")
            _pg_server = PostgresServer().start()
            atexit.register(_pg_server.cleanup)
        _pg_urls[key] = _pg_server.new_database()
    return _pg_urls[key]


def ledger_query(db: Path, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """A read-only query (`?` placeholders) on the ledger at `db`, on either backend."""
    if ON_POSTGRES:
        import psycopg

        with psycopg.connect(db_arg(db)) as pg:
            return [tuple(r) for r in pg.execute(sql.replace("?", "%s"), args)]  # type: ignore[arg-type]
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return [tuple(r) for r in conn.execute(sql, args)]
    finally:
        conn.close()


def ledger_rows(db: Path) -> dict[str, dict[str, Any]]:
    """Every ledger row, by request id (read-only, as an operator would), on either backend."""
    if ON_POSTGRES:
        import psycopg
        from psycopg.rows import dict_row

        with psycopg.connect(db_arg(db), row_factory=dict_row) as pg:
            rows = {r["request_id"]: dict(r) for r in pg.execute("SELECT * FROM requests")}
    else:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        conn.row_factory = sqlite3.Row
        try:
            rows = {r["request_id"]: dict(r) for r in conn.execute("SELECT * FROM requests")}
        finally:
            conn.close()
    for r in rows.values():
        r["output"] = json.loads(r["output_json"]) if r.get("output_json") else None
    return rows


def wait_swept(db: Path, request_ids: "set[str] | list[str]", timeout: float = 120.0) -> None:
    """After a restart that follows a kill: on SQLite the new server interrupted the dead one's
    open rows when it opened the file; a PostgreSQL replica does so only once the dead replica's
    lease has lapsed (--instance-lease, 10 s, docs/scale-out.md). Wait, while a server runs, until
    none of `request_ids` is still open (returns at once on SQLite)."""
    deadline = time.monotonic() + timeout
    while ON_POSTGRES and time.monotonic() < deadline:
        rows = ledger_rows(db)
        if not any(rows.get(r, {}).get("state") in ("queued", "running") for r in request_ids):
            return
        time.sleep(0.2)


def hang_up_while_generating(base: str, path: str, body: dict[str, Any], headers: dict[str, str], db: Path,
                             idempotency_key: str, timeout: float = 300.0) -> str:
    """Send a whole (non-streamed) request, wait until the ledger shows it generating, then hang up.

    Returns its request id. A client that gives up after a fixed read timeout races the model: on
    a quiet machine the demo model can finish 1500 tokens inside the timeout, and the request then
    ends `finished`, not `cancelled`. This waits on the ledger's own progress instead (the row is
    `running` with its first token stamped), so the hang-up always lands mid-generation. The
    request carries an idempotency key so its row can be found (keys are stored as `key_id:key`
    when the request is authenticated).
    """
    from urllib.parse import urlsplit

    url = urlsplit(base)
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}", f"Idempotency-Key: {idempotency_key}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=60)
    try:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = [r for r in ledger_rows(db).values()
                    if (r["idempotency_key"] or "") in (idempotency_key, ) or
                    (r["idempotency_key"] or "").endswith(":" + idempotency_key)]
            if rows and (rows[0]["state"] not in ("queued", "running") or rows[0]["first_token_at"] is not None):
                assert rows[0]["state"] == "running", f"it ended {rows[0]['state']} before the hang-up"
                return str(rows[0]["request_id"])
            time.sleep(0.02)
        raise AssertionError(f"no generating row for {idempotency_key} within {timeout} s")
    finally:
        sock.close()  # the hang-up: the server sees the connection end while it generates


class WsClient:
    """A thin asyncio WebSocket client speaking pagewire frames (JSON dicts)."""

    def __init__(self, url: str, headers: Optional[dict[str, str]] = None) -> None:
        self.url = url
        self.headers = headers
        self.conn: Any = None

    async def __aenter__(self) -> "WsClient":
        from websockets.asyncio.client import connect

        # A short close timeout: after a server crash the close handshake cannot complete.
        self.conn = await connect(self.url, proxy=None, max_size=8 * 1024 * 1024, close_timeout=1,
                                  additional_headers=self.headers)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.conn.close()

    async def send(self, frame: dict[str, Any] | str) -> None:
        await self.conn.send(frame if isinstance(frame, str) else json.dumps(frame))

    async def recv(self, timeout: float = 120.0) -> dict[str, Any]:
        import asyncio

        return json.loads(await asyncio.wait_for(self.conn.recv(), timeout))

    async def run(self, frames: dict[str, dict[str, Any]], timeout: float = 120.0) -> dict[str, list[dict[str, Any]]]:
        """Send generate frames (by id) and collect every frame per id until each has ended."""
        import asyncio

        for cid, f in frames.items():
            await self.send({"type": "generate", "id": cid, **f})
        got: dict[str, list[dict[str, Any]]] = {cid: [] for cid in frames}
        open_ids = set(frames)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while open_ids:
            msg = await self.recv(max(0.1, deadline - loop.time()))
            cid = msg.get("id")
            got.setdefault(cid, []).append(msg)
            if msg["type"] in ("done", "error") and cid in open_ids:
                open_ids.discard(cid)
        return got


def text_of(frames: list[dict[str, Any]], index: int = 0) -> str:
    return "".join(f["text"] for f in frames if f["type"] == "delta" and f.get("index", 0) == index)


def tokens_of(frames: list[dict[str, Any]]) -> list[int]:
    return [t for f in frames if f["type"] == "delta" for t in f["token_ids"]]
