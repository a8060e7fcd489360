"""Issue 29's smaller items: a whitespace-only idempotency key is refused on the WebSocket as over
HTTP; a server-side interruption is reported with a server error type, over HTTP and SSE."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from tests.server.harness import ServerProcess, WsClient, ledger_rows


def test_whitespace_idempotency_keys_are_refused_on_both_edges(demo_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "ws-idem.db"

    async def ws_frames(key: str) -> list[dict[str, Any]]:
        async with WsClient(srv.ws_url) as ws:
            got = await ws.run({"a": {"prompt": "x", "idempotency_key": key, "params": {"max_tokens": 2}}})
            return got["a"]

    with ServerProcess(demo_model, db) as srv:
        for key in (" ", "\t\n", "   "):
            frames = asyncio.run(ws_frames(key))
            assert frames[-1]["type"] == "error", frames
            assert frames[-1]["code"] == "invalid_idempotency_key" and frames[-1]["param"] == "idempotency_key"
        # (HTTP refused such keys already; httpx cannot even send a blank header value.)
        assert asyncio.run(ws_frames(" padded key "))[-1]["type"] == "done"  # blanks inside are fine
    assert not any(row["idempotency_key"] in (" ", "\t\n", "   ") for row in ledger_rows(db).values())


def test_an_interrupted_request_is_a_server_error_for_its_retry(demo_model: Path, tmp_path: Path) -> None:
    """Interrupt a request by a SIGKILL; its idempotent retry after the restart is 409
    `request_interrupted` with OpenAI's `server_error` type (it was the server's doing)."""
    db = tmp_path / "interrupt.db"
    srv = ServerProcess(demo_model, db).start()
    try:
        with httpx.Client(timeout=120) as c, c.stream(
                "POST", srv.base + "/v1/completions", headers={"Idempotency-Key": "k-int"},
                json={"model": "demo", "prompt": "run", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            # Hold the line iterator: a dropped generator closes httpx's stream, which hangs up,
            # and a server that sees the hang-up first ends the request as the client's cancel.
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            srv.kill()
    finally:
        srv.stop()
    with ServerProcess(demo_model, db) as again:
        r = httpx.post(again.base + "/v1/completions", headers={"Idempotency-Key": "k-int"},
                       json={"model": "demo", "prompt": "run", "max_tokens": 1500, "ignore_eos": True}, timeout=60)
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "request_interrupted" and err["type"] == "server_error", err
        # A client's own cancellation stays the client's: the type is unchanged there.
    from server.serving.lifecycle import EndReason, end_error

    assert end_error("req-x", EndReason.CANCELLED, None).error_type == "invalid_request_error"
    assert end_error("req-x", EndReason.INTERRUPTED, None).error_type == "server_error"
