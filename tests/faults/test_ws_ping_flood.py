"""Bug 10: a WebSocket client that floods pings and never reads is cut after twice the send timeout,
even though the app itself has nothing to send; the server stays healthy for everyone else."""
from __future__ import annotations

import asyncio
import base64
import os
import socket
import struct
import time
from pathlib import Path

import httpx

from tests.server.harness import ServerProcess, WsClient


def _handshake(port: int) -> socket.socket:
    # A tiny receive window, set before connecting so the window is negotiated small: the
    # server's pongs then back up into its own buffers quickly, as with a client that never reads.
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall((f"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(1)
        assert chunk, "server closed during the handshake"
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    return s  # and never read again


def _ping(payload: bytes) -> bytes:
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return struct.pack("!BB", 0x89, 0x80 | len(payload)) + mask + masked


def test_ping_flood_from_a_client_that_never_reads_is_cut(demo_model: Path, tmp_path: Path) -> None:
    # No server pings (--ws-ping-interval 0): an unanswered one is another of the watchdog's
    # observations, and on a loaded machine it could fire before the paused writes did (a full
    # `make test` once took 110 s here and cut on the ping); this test is about the writes.
    with ServerProcess(demo_model, tmp_path / "ping.db", "--send-timeout", "2", "--ws-ping-interval", "0") as srv:
        s = _handshake(srv.port)
        s.settimeout(0.2)
        frame = _ping(b"x" * 125)
        cut = False
        deadline = time.monotonic() + 300  # a bound for a broken server, not a timing assumption
        while time.monotonic() < deadline:
            try:
                s.send(frame)
            except socket.timeout:
                continue  # the server stopped reading us (its pongs are backed up): keep pushing
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
        s.close()
        assert cut, "the server kept a non-reading ping-flooding client's connection open"
        assert "has not read" in srv.log_path.read_text(errors="replace")  # cut by the watchdog
        # Everyone else is unaffected.
        assert httpx.get(srv.base + "/health").status_code == 200

        async def other() -> str:
            async with WsClient(srv.ws_url) as ws:
                got = await ws.run({"x": {"prompt": "fine", "params": {"max_tokens": 3}}})
                return got["x"][-1]["type"]
        assert asyncio.run(other()) == "done"
