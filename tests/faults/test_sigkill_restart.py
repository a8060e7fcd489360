"""SIGKILL during 64 streams, then a restart on the same ledger (issue 13's fault suite).

Every request the server acknowledged (`accepted`) must be, after the restart, `finished` or
`interrupted` — never lost, never left open. A finished row's usage equals the tokens its client
received when the client got its `done`; when the kill came between the terminal commit and the
`done` reaching the client, the client holds a prefix of the row's tokens (the row is the truth).
The database passes `PRAGMA integrity_check`. The kill is timed by events: once every request is
acknowledged and a first wave has finished, so the kill lands among finished, running and queued
requests alike."""
from __future__ import annotations

import asyncio
import signal
import sqlite3
from pathlib import Path
from typing import Any

from tests.server.harness import ServerProcess, WsClient, ledger_rows, wait_swept

SOCKETS = 8
PER_SOCKET = 8  # 64 streams
TOKENS = 48


def test_sigkill_during_64_streams_then_restart(demo_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "kill.db"
    srv = ServerProcess(demo_model, db, "--max-num-seqs", "8").start()
    seen: dict[str, dict[str, Any]] = {}  # cid → {"request_id", "tokens", "done"}
    try:
        async def client(k: int, all_acked: asyncio.Event, some_done: asyncio.Event,
                         killed: asyncio.Event) -> None:
            async with WsClient(srv.ws_url) as ws:
                for i in range(PER_SOCKET):
                    cid = f"c{k}-{i}"
                    seen[cid] = {"request_id": None, "tokens": [], "done": None}
                    await ws.send({"type": "generate", "id": cid, "prompt": f"kill {k} {i}",
                                   "params": {"max_tokens": TOKENS, "ignore_eos": True, "temperature": 0}})
                while not killed.is_set():
                    try:
                        f = await ws.recv(timeout=600)
                    except Exception:  # the server died under us: what we have is what we got
                        return
                    st = seen[f["id"]]
                    if f["type"] == "accepted":
                        st["request_id"] = f["request_id"]
                        if all(s["request_id"] for s in seen.values()) and len(seen) == SOCKETS * PER_SOCKET:
                            all_acked.set()
                    elif f["type"] == "delta":
                        st["tokens"].extend(f["token_ids"])
                    elif f["type"] == "done":
                        st["done"] = f
                        if sum(s["done"] is not None for s in seen.values()) >= 8:
                            some_done.set()

        async def scenario() -> None:
            all_acked, some_done, killed = asyncio.Event(), asyncio.Event(), asyncio.Event()
            tasks = [asyncio.create_task(client(k, all_acked, some_done, killed)) for k in range(SOCKETS)]
            await all_acked.wait()
            await some_done.wait()
            srv.signal(signal.SIGKILL)
            srv.wait(60)
            killed.set()
            await asyncio.gather(*tasks)

        asyncio.run(scenario())
    finally:
        srv.kill()
        srv.stop()

    acked = {s["request_id"]: s for s in seen.values() if s["request_id"]}
    assert len(acked) == SOCKETS * PER_SOCKET
    assert any(s["done"] is None for s in acked.values())  # the kill did cut streams short

    restarted = ServerProcess(demo_model, db).start()  # recovery runs at start-up (a lease later on PostgreSQL)
    wait_swept(db, set(acked))
    restarted.stop()
    rows = ledger_rows(db)
    assert set(acked) <= set(rows)
    for rid, s in acked.items():
        row = rows[rid]
        assert row["state"] in ("finished", "interrupted"), (rid, row["state"])
        if s["done"] is not None:
            assert row["state"] == "finished"
            assert row["completion_tokens"] == s["done"]["usage"]["completion_tokens"] == len(s["tokens"]) == TOKENS
            assert row["output"]["samples"][0]["token_ids"] == s["tokens"]
        elif row["state"] == "finished":  # committed, but the kill beat the `done` to the client
            assert row["completion_tokens"] == TOKENS
            assert row["output"]["samples"][0]["token_ids"][:len(s["tokens"])] == s["tokens"]
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
