"""Bug 1: SIGTERM during 32 streams (SSE and WebSocket, half of them still queued in admission,
one SSE client that has stopped reading): draining keeps the engine stepping and admission
submitting, so every request finishes within the grace period, `done`/`[DONE]` included, and the
ledger records them all `finished`. Waits on the streams' own ends, never on time."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
from pathlib import Path
from typing import Any

import httpx

from tests.server.harness import ServerProcess, WsClient, ledger_rows, tokens_of

TOKENS = 24
N_SSE = 12
N_WS = 20  # on two sockets


def test_sigterm_during_32_streams_finishes_them_all(demo_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "drain.db"
    srv = ServerProcess(demo_model, db, "--max-num-seqs", "16", "--engine-margin", "0",
                        "--shutdown-grace", "600").start()
    try:
        async def sse(c: httpx.AsyncClient, i: int, acked: asyncio.Event) -> tuple[int, list[str]]:
            async with c.stream("POST", srv.base + "/v1/completions", json={
                    "model": "demo", "prompt": f"drain {i}", "max_tokens": TOKENS, "ignore_eos": True,
                    "stream": True, "logprobs": 0}) as r:
                assert r.status_code == 200  # headers come only after the ledger commit
                acked.set()
                lines: list[str] = []
                n = 0
                async for ln in r.aiter_lines():
                    if ln.startswith("data: {"):
                        lines.append(ln)
                        # Chunks may coalesce tokens for a slow reader; logprobs list each token.
                        for ch in json.loads(ln[6:]).get("choices", []):
                            n += len((ch.get("logprobs") or {}).get("tokens") or [])
                    elif ln == "data: [DONE]":
                        lines.append(ln)
                return n, lines

        def stalled_reader() -> socket.socket:
            # A raw client that sends a streamed request and then never reads a byte.
            s = socket.create_connection(("127.0.0.1", srv.port))
            body = json.dumps({"model": "demo", "prompt": "never read", "max_tokens": TOKENS,
                               "ignore_eos": True, "stream": True}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                      + f"content-length: {len(body)}\r\n\r\n".encode() + body)
            return s

        async def ws_socket(prefix: str, n: int, acked: asyncio.Event) -> dict[str, list[dict[str, Any]]]:
            async with WsClient(srv.ws_url) as ws:
                for i in range(n):
                    await ws.send({"type": "generate", "id": f"{prefix}{i}", "prompt": f"ws {prefix}{i}",
                                   "params": {"max_tokens": TOKENS, "ignore_eos": True}})
                got: dict[str, list[dict[str, Any]]] = {f"{prefix}{i}": [] for i in range(n)}
                while any(not fs or fs[-1]["type"] not in ("done", "error") for fs in got.values()):
                    f = await ws.recv(timeout=600)
                    got[f["id"]].append(f)
                    if all(fs and fs[0]["type"] == "accepted" for fs in got.values()):
                        acked.set()
                return got

        async def main() -> tuple[list[tuple[int, list[str]]], list[dict[str, list[dict[str, Any]]]]]:
            stalled = stalled_reader()
            try:
                async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as c:
                    flags = [asyncio.Event() for _ in range(N_SSE + 2)]
                    sse_tasks = [asyncio.create_task(sse(c, i, flags[i])) for i in range(N_SSE)]
                    ws_tasks = [asyncio.create_task(ws_socket("a", N_WS // 2, flags[N_SSE])),
                                asyncio.create_task(ws_socket("b", N_WS // 2, flags[N_SSE + 1]))]
                    # SIGTERM once every request is acknowledged (16 run, the rest wait in admission).
                    await asyncio.gather(*(f.wait() for f in flags))
                    srv.signal(signal.SIGTERM)
                    return list(await asyncio.gather(*sse_tasks)), list(await asyncio.gather(*ws_tasks))
            finally:
                stalled.close()

        sse_results, ws_results = asyncio.run(main())
        assert srv.wait(600) == 0
    finally:
        srv.stop()
    for n, lines in sse_results:
        assert lines and lines[-1] == "data: [DONE]", lines[-3:]
        assert not any(ln.startswith('data: {"error"') for ln in lines), lines[-3:]
        assert n == TOKENS, lines[-3:]
    for got in ws_results:
        for cid, fs in got.items():
            assert fs[-1]["type"] == "done", (cid, fs[-1])
            assert len(tokens_of(fs)) == TOKENS and fs[-1]["finish_reason"] == "length"
    rows = ledger_rows(db)
    assert len(rows) == N_SSE + N_WS + 1
    assert all(r["state"] == "finished" and r["completion_tokens"] == TOKENS for r in rows.values()), \
        sorted((r["state"], r["completion_tokens"]) for r in rows.values())
