"""Faults with real processes on a real PostgreSQL: SIGKILL one replica mid-stream and mid-batch
(the survivor interrupts the dead one's rows once its lease lapses; nothing acknowledged is lost,
no batch line runs twice, usage equals the rows), and PostgreSQL restarted under load (requests
fail cleanly with 503 while it is down, nothing is misreported, service recovers by itself)."""
from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from tests.scaleout.postgres import PostgresServer
from tests.server.harness import ServerProcess, WsClient

LEASE = "2"  # seconds: a dead replica's rows are swept this long after its last renewal


def replica(demo_model: Path, tmp_path: Path, url: str, name: str, *extra: str) -> ServerProcess:
    # The harness's own --db (a log name) comes first; ours, later on the command line, wins.
    return ServerProcess(demo_model, tmp_path / f"{name}.db", "--db", url, "--instance-lease", LEASE, *extra)


def pg_rows(url: str, where: str = "TRUE", args: tuple[Any, ...] = ()) -> dict[str, dict[str, Any]]:
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(url, row_factory=dict_row) as c:
        return {r["request_id"]: r for r in c.execute(f"SELECT * FROM requests WHERE {where}", args)}


def wait_until(cond: Any, timeout: float, what: str) -> None:
    """Poll a condition on another process's state (a lease lapsing is time itself)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _usage(url: str) -> list[dict[str, Any]]:
    import contextlib
    import io

    from server.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["usage", "--db", url, "--format", "json", "--group-by", "model"]) == 0
    return json.loads(out.getvalue())


def test_sigkill_replica_mid_stream(demo_model: Path, tmp_path: Path, pg_url: str) -> None:
    a = replica(demo_model, tmp_path, pg_url, "a").start()
    b = replica(demo_model, tmp_path, pg_url, "b").start()
    seen: dict[str, dict[str, Any]] = {}
    try:
        async def scenario() -> None:
            async with WsClient(a.ws_url) as ws:
                for i in range(12):
                    seen[f"c{i}"] = {"request_id": None, "tokens": [], "done": None}
                    # The long ones run near the demo model's 2,048-position context, so that they are
                    # still decoding when the SIGKILL lands even on a fast, quiet machine (at 300 tokens
                    # all twelve could finish before it: nothing was left to interrupt).
                    await ws.send({"type": "generate", "id": f"c{i}", "prompt": f"kill {i}",
                                   "params": {"max_tokens": 8 if i < 4 else 1900, "ignore_eos": True,
                                              "temperature": 0}})
                while True:
                    f = await ws.recv(timeout=300)
                    st = seen[f["id"]]
                    if f["type"] == "accepted":
                        st["request_id"] = f["request_id"]
                    elif f["type"] == "delta":
                        st["tokens"].extend(f["token_ids"])
                    elif f["type"] == "done":
                        st["done"] = f
                    if all(s["request_id"] for s in seen.values()) and \
                            sum(s["done"] is not None for s in seen.values()) >= 4:
                        break
            a.signal(signal.SIGKILL)
            a.wait(60)
        asyncio.run(scenario())
        acked = {s["request_id"]: s for s in seen.values()}
        # The survivor sweeps the dead replica's rows once its lease lapses; its own are untouched.
        wait_until(lambda: all(r["state"] in ("finished", "interrupted") for r in pg_rows(pg_url).values()),
                   60, "the dead replica's rows to be interrupted")
        rows = pg_rows(pg_url)
        assert set(acked) <= set(rows)  # nothing acknowledged is lost
        assert any(rows[r]["state"] == "interrupted" for r in acked)
        for rid, s in acked.items():
            if s["done"] is not None:
                assert rows[rid]["state"] == "finished" and rows[rid]["completion_tokens"] == len(s["tokens"])
        # B still serves, and resume of a killed stream on B says how it ended (no silent gap).
        killed = next(r for r in acked if rows[r]["state"] == "interrupted")

        async def resume() -> dict[str, Any]:
            async with WsClient(b.ws_url) as ws:
                await ws.send({"type": "resume", "request_id": killed, "after_seq": 0, "id": "r"})
                while True:
                    f = await ws.recv(timeout=60)
                    if f["type"] in ("done", "error"):
                        return f
        end = asyncio.run(resume())
        assert end["type"] == "error" and end["code"] == "interrupted", end
        # Usage equals the rows.
        billable = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows.values() if r["admitted_at"])
        assert sum(u["billable_tokens"] for u in _usage(pg_url)) == billable
    finally:
        a.kill()
        a.stop()
        b.stop()


def _batch(base: str, n: int) -> str:
    lines = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "demo", "prompt": [1, 2, i + 3], "max_tokens": 24,
                                         "ignore_eos": True, "temperature": 0}}) + "\n" for i in range(n))
    up = httpx.post(base + "/v1/files", timeout=60, data={"purpose": "batch"},
                    files={"file": ("in.jsonl", lines.encode(), "application/jsonl")})
    assert up.status_code == 200, up.text
    cr = httpx.post(base + "/v1/batches", timeout=60, json={"input_file_id": up.json()["id"],
                                                              "endpoint": "/v1/completions"})
    assert cr.status_code == 200, cr.text
    return str(cr.json()["id"])


def test_sigkill_replica_mid_batch(demo_model: Path, tmp_path: Path, pg_url: str) -> None:
    n = 16
    a = replica(demo_model, tmp_path, pg_url, "a").start()
    b = replica(demo_model, tmp_path, pg_url, "b").start()
    try:
        bid = _batch(a.base, n)

        def progress() -> dict[str, Any]:
            return dict(httpx.get(f"{b.base}/v1/batches/{bid}", timeout=30).json())
        wait_until(lambda: progress()["request_counts"]["completed"] >= 3, 300, "a few lines to finish")
        a.signal(signal.SIGKILL)
        a.wait(60)
        wait_until(lambda: progress()["status"] == "completed", 600, "the survivor to finish the batch")
        g = progress()
        assert g["request_counts"] == {"total": n, "completed": n, "failed": 0}
        out = httpx.get(f"{b.base}/v1/files/{g['output_file_id']}/content", timeout=30).text.splitlines()
        assert sorted(json.loads(ln)["custom_id"] for ln in out) == sorted(f"c{i}" for i in range(n))
        rows = pg_rows(pg_url, "idempotency_key LIKE ?".replace("?", "%s"), (f"batch-{bid}-%",))
        per_line: dict[int, list[str]] = {}
        for r in rows.values():
            per_line.setdefault(int(r["idempotency_key"].split("-")[-2]), []).append(r["state"])
        # Never run twice: exactly one finished request per line; any other attempt was cut by the kill.
        assert sorted(per_line) == list(range(n))
        assert all(states.count("finished") == 1 and set(states) <= {"finished", "interrupted"}
                   for states in per_line.values()), per_line
        # The output file's request ids are the finished rows.
        finished = {rid for rid, r in rows.items() if r["state"] == "finished"}
        assert {json.loads(ln)["response"]["request_id"] for ln in out} == finished
    finally:
        a.kill()
        a.stop()
        b.stop()


def test_postgres_restart_under_load(demo_model: Path, tmp_path: Path, own_postgres: PostgresServer) -> None:
    url = own_postgres.new_database()
    srv = replica(demo_model, tmp_path, url, "a").start()
    statuses: list[tuple[str, int, str]] = []  # (phase, status, request id or error code)
    try:
        def one(phase: str) -> int:
            try:
                r = httpx.post(srv.base + "/v1/completions", timeout=60,
                               json={"model": "demo", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
            except httpx.HTTPError as e:  # never expected: the server answers even when the DB is down
                statuses.append((phase, -1, repr(e)))
                return -1
            ident = r.headers.get("x-request-id") if r.status_code == 200 else r.json()["error"]["code"]
            statuses.append((phase, r.status_code, str(ident)))
            return r.status_code

        for _ in range(3):
            assert one("before") == 200
        own_postgres.stop("fast")
        down = [one("down") for _ in range(4)]
        assert all(s == 503 for s in down), statuses
        assert {c for p, s, c in statuses if p == "down"} <= {"ledger_unavailable"}
        health = httpx.get(srv.base + "/health", timeout=30)
        assert health.status_code == 503, health.text
        own_postgres.start()
        # Recovers by itself: the writer reconnects, the pool replaces its connections.
        wait_until(lambda: one("after") == 200, 60, "service to recover")
        for _ in range(3):
            assert one("after") == 200
        assert all(s in (200, 503) for _, s, _ in statuses), statuses
    finally:
        srv.stop()
    # Nothing misreported: every request answered 200 is `finished` in the ledger with its usage;
    # none that was refused with 503 left a row behind that claims otherwise.
    rows = pg_rows(url)
    ok = {c for _, s, c in statuses if s == 200}
    assert ok <= set(rows) and all(rows[r]["state"] == "finished" and rows[r]["completion_tokens"] == 4 for r in ok)
    assert all(r["state"] in ("finished", "interrupted", "failed") for r in rows.values())
