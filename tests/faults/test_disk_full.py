"""Bug 3: with the disk full, nothing is acknowledged that is not recorded.

- at admission: a request whose row cannot be committed is refused (503 `ledger_unavailable`),
  never run unrecorded;
- mid-request: the terminal frame follows the terminal commit, so a request that finished while
  the disk was full gets an error saying its record failed (`ledger_write_failed`, with usage),
  not `done`; /health reports the ledger failing; the server holds the terminal write and retries
  it, so once space is back the row is `finished` with the usage the client received.
The database lives on a small filesystem this test mounts and fills (skipped, with the reason,
where mounting is refused)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.faults.diskfull import fill, small_filesystem
from tests.server.harness import ServerProcess, WsClient, ledger_rows, tokens_of

# A full disk under the SQLite file; PostgreSQL's own storage is the database server's
# (tests/scaleout/test_faults_pg.py restarts it).
pytestmark = pytest.mark.sqlite_only


def _wait_health(srv: ServerProcess, status: int, timeout: float = 60.0) -> httpx.Response:
    """Poll /health until it answers `status` (the retry loop lands on its own schedule)."""
    deadline = time.monotonic() + timeout
    r = httpx.get(srv.base + "/health")
    while r.status_code != status and time.monotonic() < deadline:
        time.sleep(0.05)
        r = httpx.get(srv.base + "/health")
    return r


def test_disk_full_at_admission_and_mid_request(demo_model: Path, tmp_path: Path) -> None:
    with small_filesystem(tmp_path) as fs:
        db = fs / "ledger.db"
        srv = ServerProcess(demo_model, db, "--max-num-seqs", "1", "--engine-margin", "0")
        srv.log_path = tmp_path / "server.log"  # the log must not share the full disk
        srv.start()
        try:
            async def main() -> tuple[dict[str, list[dict[str, Any]]], httpx.Response, httpx.Response, Path]:
                got: dict[str, list[dict[str, Any]]] = {"blocker": [], "target": []}
                async with WsClient(srv.ws_url) as ws:
                    # The blocker holds the only engine slot, so the target is accepted (row
                    # committed) but cannot run until the disk is already full.
                    await ws.send({"type": "generate", "id": "blocker", "prompt": "hold",
                                   "params": {"max_tokens": 2000, "ignore_eos": True}})
                    while not any(f["type"] == "delta" for f in got["blocker"]):
                        f = await ws.recv()
                        got[f["id"]].append(f)
                    await ws.send({"type": "generate", "id": "target", "prompt": "finish me",
                                   "params": {"max_tokens": 20, "ignore_eos": True, "temperature": 0}})
                    while not got["target"]:
                        f = await ws.recv()
                        got[f["id"]].append(f)
                    assert got["target"][0]["type"] == "accepted", got["target"]
                    filler = fill(fs)
                    async with httpx.AsyncClient(timeout=60) as c:
                        refused = await c.post(srv.base + "/v1/completions", json={
                            "model": "demo", "prompt": "while full", "max_tokens": 2})
                    await ws.send({"type": "cancel", "id": "blocker"})
                    while got["target"][-1]["type"] not in ("done", "error"):
                        f = await ws.recv(timeout=120)
                        got[f["id"]].append(f)
                    health = httpx.get(srv.base + "/health")
                    return got, refused, health, filler

            got, refused, health_full, filler = asyncio.run(main())
            # Admission while full: refused, nothing runs unrecorded.
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "ledger_unavailable"
            # Mid-request: an error that says the record failed, not `done`, with the usage.
            end = got["target"][-1]
            assert end["type"] == "error" and end["code"] == "ledger_write_failed", end
            assert "ledger" in end["message"] and "retry" in end["message"]
            received = len(tokens_of(got["target"]))
            assert received == 20 and end["usage"]["completion_tokens"] == 20
            assert health_full.status_code == 503
            assert health_full.json()["ledger"]["status"] == "failing"
            rows = ledger_rows(db)
            target_rid = end["request_id"]
            assert rows[target_rid]["state"] in ("queued", "running")  # not yet recorded...

            filler.unlink()  # space is back: the held terminal writes land
            healthy = _wait_health(srv, 200)
            assert healthy.status_code == 200 and healthy.json()["ledger"] == {"status": "ok"}, healthy.text
            rows = ledger_rows(db)
            assert rows[target_rid]["state"] == "finished"
            assert rows[target_rid]["completion_tokens"] == received
            assert rows[target_rid]["finish_reason"] == "length"
            assert rows[got["blocker"][0]["request_id"]]["state"] == "cancelled"
            # And the server serves again.
            ok = httpx.post(srv.base + "/v1/completions", json={"model": "demo", "prompt": "again", "max_tokens": 2},
                            timeout=60)
            assert ok.status_code == 200, ok.text
        finally:
            srv.stop()
        import sqlite3

        conn = sqlite3.connect(db)
        try:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            assert conn.execute("SELECT count(*) FROM requests WHERE state IN ('queued','running')").fetchone()[0] == 0
        finally:
            conn.close()
