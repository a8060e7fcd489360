"""A WebSocket consumer that stops reading is cut off with a resumable error, its requests keep
running, and a new connection resumes them completely."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.harness import ServerProcess, WsClient, ledger_rows, tokens_of


def _masked_text_frame(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj).encode()
    mask = os.urandom(4)
    n = len(data)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def _stalled_client(port: int) -> socket.socket:
    """A WebSocket client with a tiny receive buffer that will not read until told to."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(f"GET /v1/ws HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 101")
    return s


N = 4


def _metric(srv: ServerProcess, name: str) -> float:
    for line in httpx.get(srv.base + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _wait_for_metric(srv: ServerProcess, name: str, value: float, timeout: float = 600.0) -> bool:
    """Poll until the metric reaches `value` (a generous deadline only guards against a hang)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _metric(srv, name) >= value:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_stuck_consumer_is_closed_resumably_and_its_requests_finish(demo_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "slow.db"
    with ServerProcess(demo_model, db, "--outbox-bytes", "4096", "--send-timeout", "1") as srv:
        s = _stalled_client(srv.port)
        # ~4000 deltas with 20 top logprobs each (~5 MB): more than the loopback socket buffers
        # can absorb (tcp_wmem autotunes up to 4 MiB), so the server's writes really block.
        params = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0, "logprobs": True, "top_logprobs": 20}
        for i in range(N):
            s.sendall(_masked_text_frame({"type": "generate", "id": f"g{i}", "prompt": "Slow reader", "params": params}))
        # Wait for the cut itself (an event the server reports), however slowly the server runs.
        assert _wait_for_metric(srv, 'pagewire_slow_consumer_disconnects_total{edge="ws"}', 1.0)
        s.settimeout(60)
        raw = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
        s.close()
        start = raw.index(b'{"type":"error","code":"slow_consumer"')
        err = json.JSONDecoder().raw_decode(raw[start:].decode("utf-8", "replace"))[0]
        assert err["resumable"] is True and len(err["requests"]) == N
        assert raw.endswith(b"\x88\x02\x03\xf5")  # close frame, code 1013 (try again later)

        async def resume_all() -> dict[str, list[dict[str, Any]]]:
            out: dict[str, list[dict[str, Any]]] = {}
            async with WsClient(srv.ws_url) as ws:
                for r in err["requests"]:
                    await ws.send({"type": "resume", "request_id": r["request_id"], "after_seq": 0})
                while len([f for fs in out.values() for f in fs if f["type"] in ("done", "error")]) < N:
                    f = await ws.recv()
                    out.setdefault(f["id"], []).append(f)
            return out

        resumed = asyncio.run(resume_all())
        for frames in resumed.values():
            assert frames[0]["type"] == "accepted" and frames[-1]["type"] == "done"
            assert len(tokens_of(frames)) == 1000 == frames[-1]["usage"]["completion_tokens"]
        rows = ledger_rows(db)
        assert all(r["state"] == "finished" for r in rows.values()) and len(rows) == N
