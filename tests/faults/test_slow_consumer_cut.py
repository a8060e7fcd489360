"""Issue 29, break 2: the slow-consumer cut must reach the client.

A client that stops reading used to get 1011 "keepalive ping timeout" from the `websockets`
library's own keepalive (or 1006), never the documented `slow_consumer` frame and close 1013, and
its request was cancelled. Now pagewire's liveness owns the decision (server/api/ws_watchdog.py):
the client reads again after the cut and finds, in order, what was sent before, the
`slow_consumer` error naming its request, and close 1013; the request ran on and resumes whole.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any, Optional

import httpx
import pytest

from tests.server.harness import ServerProcess, ledger_rows

MAX_TOKENS = 1500


def _slow_consumer_count(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    m = re.search(r'^pagewire_slow_consumer_disconnects_total\{edge="ws"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _wait_for_cut(srv: ServerProcess, limit_s: float = 120.0) -> None:
    """Poll the server's own counter (it is another process: there is no event to wait on)."""
    deadline = time.monotonic() + limit_s
    while _slow_consumer_count(srv.base) < 1:
        assert srv.proc is not None and srv.proc.poll() is None, srv.read_log()
        assert time.monotonic() < deadline, "the server never cut the client that stopped reading"
        time.sleep(0.05)


async def _stalled_then_read(srv: ServerProcess, params: dict[str, Any]) -> tuple[list[dict[str, Any]], Optional[int]]:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    # The official client stops reading its socket once `max_queue` frames wait unread.
    async with connect(srv.ws_url, proxy=None, max_queue=1, max_size=None, close_timeout=5) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "g", "prompt": "stall",
                                  "params": {"temperature": 0, "ignore_eos": True, "max_tokens": MAX_TOKENS,
                                             **params}}))
        await asyncio.get_running_loop().run_in_executor(None, _wait_for_cut, srv)
        frames: list[dict[str, Any]] = []
        try:
            while True:
                frames.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
        except ConnectionClosed:
            pass
        return frames, ws.close_code


async def _resume(srv: ServerProcess, rid: str) -> list[dict[str, Any]]:
    from websockets.asyncio.client import connect

    async with connect(srv.ws_url, proxy=None, max_size=None) as ws:
        await ws.send(json.dumps({"type": "resume", "id": "r", "request_id": rid, "after_seq": 0}))
        out: list[dict[str, Any]] = []
        while not out or out[-1]["type"] not in ("done", "error"):
            out.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
        return out


@pytest.mark.parametrize("case, extra, params", [
    # A small output that never fills the socket buffers: only an unanswered ping can find it.
    ("ping", ["--send-timeout", "3", "--ws-ping-interval", "1"], {}),
    # Megabytes of logprobs: the buffers fill and the writer's send blocks.
    ("blocked-send", ["--send-timeout", "3"], {"logprobs": True, "top_logprobs": 20}),
])
def test_a_client_that_stops_reading_gets_slow_consumer_and_1013_and_resumes(
        demo_model: Path, tmp_path: Path, case: str, extra: list[str], params: dict[str, Any]) -> None:
    db = tmp_path / f"cut-{case}.db"
    with ServerProcess(demo_model, db, *extra) as srv:
        frames, code = asyncio.run(_stalled_then_read(srv, params))
        assert code == 1013, (code, frames[-3:], srv.read_log())
        errors = [f for f in frames if f["type"] == "error"]
        assert [e["code"] for e in errors] == ["slow_consumer"], errors
        err = errors[0]
        assert frames[-1] is err  # the last frame before the close
        assert err["resumable"] is True
        accepted = next(f for f in frames if f["type"] == "accepted")
        rid = accepted["request_id"]
        done_before_cut = any(f["type"] == "done" for f in frames)
        if not done_before_cut:
            assert err["requests"] == [{"id": "g", "request_id": rid}], err
        # Kept for resume, not cancelled: it runs to its end and resumes whole from seq 0.
        again = asyncio.run(_resume(srv, rid))
        assert again[-1]["type"] == "done", again[-1]
        assert again[-1]["finish_reason"] == "length"
        assert sum(len(f["token_ids"]) for f in again if f["type"] == "delta") == MAX_TOKENS
        log = srv.read_log()
        assert "keepalive ping timeout" not in log
    row = ledger_rows(db)[rid]
    assert row["state"] == "finished" and row["completion_tokens"] == MAX_TOKENS, row


def test_liveness_cuts_a_peer_that_never_answers_a_ping() -> None:
    """The ping rule alone, on a transport whose peer reads nothing and answers no ping."""
    from server.api.ws_watchdog import Liveness

    class Proto:
        close_timeout = 1.0

        def __init__(self) -> None:
            self.pings = 0

        async def ping(self) -> "asyncio.Future[float]":
            self.pings += 1
            return asyncio.get_running_loop().create_future()  # a pong that never comes

    class Transport:
        def __init__(self) -> None:
            self.proto = Proto()
            self.aborted = False

        def get_protocol(self) -> Proto:
            return self.proto

        def is_closing(self) -> bool:
            return self.aborted

        def get_write_buffer_size(self) -> int:
            return 0  # nothing backs up: the writes themselves never block

        def get_write_buffer_limits(self) -> tuple[int, int]:
            return 0, 65536

        def abort(self) -> None:
            self.aborted = True

    async def scenario() -> None:
        transport = Transport()
        reasons: list[str] = []
        cut = asyncio.Event()

        def on_cut(why: str) -> None:
            reasons.append(why)
            live.cutting()
            cut.set()

        live = Liveness(transport, 0.2, 0.1, "peer", on_cut)  # type: ignore[arg-type]
        assert transport.proto.close_timeout == 1.0  # never lowered
        watch = asyncio.get_running_loop().create_task(live.watch())
        delay = live.ping_delay()
        assert delay is not None and delay > 0
        await live.ping()
        await asyncio.wait_for(cut.wait(), 30)
        assert "did not answer a ping" in reasons[0]
        assert live.ping_delay() is None  # no more pings once cut
        await asyncio.wait_for(watch, 30)  # and the transport is aborted after the client's window
        assert transport.aborted and len(reasons) == 1

    asyncio.run(scenario())
