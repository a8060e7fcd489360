"""Process-level behaviour, each test on its own server: a crash (SIGKILL) and restart on the same
ledger, graceful shutdown, overload backpressure, and 503 while the model is not loaded."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.server.harness import REPO, ServerProcess, WsClient, db_arg, ledger_rows, tokens_of

LONG = {"prompt": "Keep going", "params": {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}}


def _short(i: int) -> dict[str, Any]:
    return {"prompt": f"Short {i}", "params": {"max_tokens": 4, "ignore_eos": True, "temperature": 0}}


@pytest.mark.slow
def test_sigkill_mid_streams_then_restart_keeps_every_acknowledged_request(demo_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "crash.db"
    frames: dict[str, list[dict[str, Any]]] = {}
    with ServerProcess(demo_model, db) as srv:
        async def main() -> None:
            async with WsClient(srv.ws_url) as ws:
                for i in range(4):
                    await ws.send({"type": "generate", "id": f"s{i}", **_short(i)})
                    await ws.send({"type": "generate", "id": f"l{i}", **LONG})
                def ready() -> bool:
                    shorts = all(frames.get(f"s{i}", [{}])[-1].get("type") == "done" for i in range(4))
                    longs = all(sum(f["type"] == "delta" for f in frames.get(f"l{i}", [])) >= 2 for i in range(4))
                    return shorts and longs
                while not ready():
                    f = await ws.recv()
                    frames.setdefault(f["id"], []).append(f)
                srv.kill()  # SIGKILL in the middle of the four long streams
                try:
                    while True:
                        f = await ws.recv(timeout=10)
                        frames.setdefault(f["id"], []).append(f)
                except websockets.ConnectionClosed:
                    pass

        asyncio.run(main())
    acknowledged = {cid: fs[0]["request_id"] for cid, fs in frames.items() if fs[0]["type"] == "accepted"}
    assert len(acknowledged) == 8

    with ServerProcess(demo_model, db) as again:
        rows = ledger_rows(db)
        for cid, rid in acknowledged.items():
            assert rid in rows, cid
            row = rows[rid]
            if cid.startswith("s"):
                assert row["state"] == "finished"
                assert row["completion_tokens"] == len(tokens_of(frames[cid])) == 4
                assert frames[cid][-1]["usage"]["completion_tokens"] == 4
            else:
                assert row["state"] == "interrupted", row
                assert row["finished_at"] is not None
        assert httpx.get(again.base + "/health").status_code == 200
    # The operator's view of the same ledger.
    out = subprocess.run([sys.executable, "-m", "server.cli", "requests", "show", acknowledged["l0"], "--db", db_arg(db)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["state"] == "interrupted"
    listing = subprocess.run([sys.executable, "-m", "server.cli", "requests", "list", "--db", db_arg(db),
                              "--state", "finished"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and all(acknowledged[f"s{i}"] in listing.stdout for i in range(4))


@pytest.mark.slow
def test_graceful_shutdown_finishes_or_interrupts_everything_and_closes_1001(demo_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "graceful.db"
    srv = ServerProcess(demo_model, db, "--shutdown-grace", "1.5").start()
    try:
        async def main() -> tuple[dict[str, list[dict[str, Any]]], int, list[str], int]:
            sse_streaming = asyncio.Event()

            async def sse_long() -> list[str]:
                lines: list[str] = []
                async with httpx.AsyncClient(timeout=120) as c:
                    async with c.stream("POST", srv.base + "/v1/completions", json={
                            "model": "demo", "prompt": "SSE", "max_tokens": 1500, "ignore_eos": True,
                            "stream": True}) as r:
                        async for ln in r.aiter_lines():
                            if ln.startswith("data: "):
                                lines.append(ln)
                                sse_streaming.set()
                return lines

            sse = asyncio.create_task(sse_long())
            got: dict[str, list[dict[str, Any]]] = {}

            def ready() -> bool:  # the short one done, the long one streaming
                short_done = got.get("short", [{}])[-1].get("type") == "done"
                return short_done and sum(f["type"] == "delta" for f in got.get("long", [])) >= 2

            async with WsClient(srv.ws_url) as ws:
                await ws.send({"type": "generate", "id": "long", **LONG})
                await ws.send({"type": "generate", "id": "short", **_short(0)})
                while not ready():
                    f = await ws.recv()
                    got.setdefault(f["id"], []).append(f)
                await asyncio.wait_for(sse_streaming.wait(), 120)
                srv.signal(signal.SIGTERM)
                # Draining starts when the server handles the signal: poll for it.
                health = 0
                async with httpx.AsyncClient(timeout=30) as c:
                    deadline = asyncio.get_running_loop().time() + 60
                    while health != 503 and asyncio.get_running_loop().time() < deadline:
                        health = (await c.get(srv.base + "/health")).status_code
                        if health != 503:
                            await asyncio.sleep(0.02)
                try:
                    while True:
                        f = await ws.recv()
                        got.setdefault(f["id"], []).append(f)
                except websockets.ConnectionClosed as e:
                    code = e.rcvd.code if e.rcvd else -1
            return got, code, await sse, health

        got, close_code, sse_lines, health = asyncio.run(main())
        assert srv.wait(120) == 0
    finally:
        srv.stop()
    assert health == 503
    assert close_code == 1001
    assert got["short"][-1]["type"] == "done"
    assert got["long"][-1]["type"] == "error" and got["long"][-1]["code"] == "interrupted"
    assert '"request_interrupted"' in sse_lines[-2] and sse_lines[-1] == "data: [DONE]"
    rows = ledger_rows(db)
    assert len(rows) == 3
    assert not [r for r in rows.values() if r["state"] in ("queued", "running")]
    assert sorted(r["state"] for r in rows.values()) == ["finished", "interrupted", "interrupted"]


@pytest.mark.slow
def test_overload_gives_429_and_retry_frames_and_every_accepted_request_completes(demo_model: Path,
                                                                                  tmp_path: Path) -> None:
    db = tmp_path / "overload.db"
    with ServerProcess(demo_model, db, "--max-num-seqs", "2", "--engine-margin", "0", "--max-queue", "3") as srv:
        async def http_one(c: httpx.AsyncClient, i: int) -> httpx.Response:
            return await c.post(srv.base + "/v1/completions", json={
                "model": "demo", "prompt": f"Load {i}", "max_tokens": 24, "ignore_eos": True})

        async def main() -> tuple[list[httpx.Response], dict[str, dict[str, Any]], dict[str, dict[str, Any]],
                                  list[httpx.Response]]:
            async with httpx.AsyncClient(timeout=120) as c, WsClient(srv.ws_url) as ws:
                # Fill every slot (2 in the engine + 3 queued) with long requests, one at a time
                # (a slot is reserved while a request is being admitted), each acknowledged
                # before the next, so the refusals below do not depend on who wins a race.
                holders = [f"hold{i}" for i in range(5)]
                for cid in holders:
                    await ws.send({"type": "generate", "id": cid, "prompt": f"Hold {cid}",
                                   "params": {"max_tokens": 1500, "ignore_eos": True}})
                    while True:
                        f = await ws.recv()
                        assert f["type"] != "error", f
                        if f["type"] == "accepted" and f["id"] == cid:
                            break
                # Full: every new request is refused with a retry hint, over HTTP and the socket.
                refused_http = list(await asyncio.gather(*(http_one(c, i) for i in range(8))))
                for i in range(6):
                    await ws.send({"type": "generate", "id": f"w{i}", "prompt": f"Socket {i}",
                                   "params": {"max_tokens": 24, "ignore_eos": True}})
                refused_ws: dict[str, dict[str, Any]] = {}
                while len(refused_ws) < 6:
                    f = await ws.recv()
                    if f.get("id", "").startswith("w"):
                        refused_ws[f["id"]] = f
                # Release the slots; then what is accepted completes.
                for cid in holders:
                    await ws.send({"type": "cancel", "id": cid})
                ends: dict[str, dict[str, Any]] = {}
                while len(ends) < len(holders):
                    f = await ws.recv()
                    if f["type"] in ("done", "error"):
                        ends[f["id"]] = f
                after = list(await asyncio.gather(*(http_one(c, i) for i in range(3))))
                return refused_http, refused_ws, ends, after

        refused_http, refused_ws, ends, after = asyncio.run(main())
        for r in refused_http:
            assert r.status_code == 429, r.text
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "overloaded"
        for f in refused_ws.values():
            assert f["type"] == "error" and f["code"] == "overloaded" and f["retry_after_ms"] >= 1000
        assert all(f["type"] == "done" and f["finish_reason"] == "cancelled" for f in ends.values())
        for r in after:
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
        rows = ledger_rows(db)
        assert sorted(r["state"] for r in rows.values()) == ["cancelled"] * 5 + ["finished"] * 3
        assert all(r["completion_tokens"] == 24 for r in rows.values() if r["state"] == "finished")
        metrics = httpx.get(srv.base + "/metrics").text
        assert 'pagewire_requests_rejected_total{code="overloaded"} 14.0' in metrics


@pytest.mark.slow
def test_second_signal_forces_exit_and_leaves_no_open_row(demo_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "forced.db"
    srv = ServerProcess(demo_model, db, "--shutdown-grace", "60").start()
    try:
        async def main() -> str:
            async with WsClient(srv.ws_url) as ws:
                await ws.send({"type": "generate", "id": "long", **LONG})
                rid = (await ws.recv())["request_id"]
                while (await ws.recv())["type"] != "delta":
                    pass
                srv.signal(signal.SIGTERM)  # starts a 60 s grace period...
                # Two signals that arrive before Python runs the handler merge into one: wait
                # until the first one is handled (draining: /health says 503).
                async with httpx.AsyncClient(timeout=30) as c:
                    while (await c.get(srv.base + "/health")).status_code != 503:
                        await asyncio.sleep(0.02)
                srv.signal(signal.SIGTERM)  # ...which the second signal cuts short
                return rid

        rid = asyncio.run(main())
        assert srv.wait(120) == 130
    finally:
        srv.stop()
    assert ledger_rows(db)[rid]["state"] == "interrupted"
