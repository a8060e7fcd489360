"""An in-process server for fault tests that must look inside: a real Runtime (demo model, engine
thread, ledger) and the real WebSocket endpoint, driven through ASGI by scripted clients.

`FakeSocket` stands for the network: it records what the server sends and can hold a send back
(`stall`) and then report it as timed out, which is what `asyncio.wait_for` reports for a send to
a peer that stopped reading. That lets a test decide *when* a consumer counts as stuck (after an
event it waited for), instead of racing a real socket buffer against a timer.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional

from server.api.context import ApiContext
from server.api.ws_endpoint import WsEndpoint
from server.gateway.policy import Gateway
from server.serving.runtime import Runtime
from server.serving.settings import ServeSettings
from tests.server.harness import db_arg

FAST = {"max_num_seqs": 8, "kv_cache_tokens": 4096, "max_num_batched_tokens": 256, "num_threads": 1}


@contextlib.asynccontextmanager
async def running(model_dir: Path, db: Path, **overrides: Any) -> AsyncIterator[Runtime]:
    """A started Runtime whose model has loaded; drained and closed on exit."""
    settings = ServeSettings(db=db_arg(db), **{**FAST, **overrides})
    rt = Runtime(settings, model_dir, "demo", policy=Gateway(settings))  # as server.serve.compose wires it
    await rt.start()
    try:
        assert rt.bridge is not None and rt.pool is not None
        # Loading runs on the engine thread, then the pool marks the lane loaded on the loop (until
        # then requests are answered `starting`); nothing to wait on but the lane's flag.
        while not rt.pool.default.ready:
            if rt.bridge.error is not None:
                raise RuntimeError(f"model failed to load: {rt.bridge.error}")
            await asyncio.sleep(0.02)
        yield rt
    finally:
        await rt.close()


async def until(cond: Callable[[], bool], what: str, limit_s: float = 600.0) -> None:
    """Yield to the loop until `cond()` holds (the limit only turns a hang into a failure)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.005)


class FakeSocket:
    """One WebSocket client connection, at the ASGI level."""

    def __init__(self, stall: bool = False) -> None:
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._inbox.put_nowait({"type": "websocket.connect"})
        self.frames: list[dict[str, Any]] = []  # text frames the client received, parsed
        self.close_code: Optional[int] = None
        # While `stalled`, a send waits for `release`; released, the held send fails as timed out.
        self.stalled = stall
        self._release = asyncio.Event()
        self.sends_attempted = 0

    def send_frame(self, obj: dict[str, Any]) -> None:
        self._inbox.put_nowait({"type": "websocket.receive", "text": json.dumps(obj)})

    def disconnect(self) -> None:
        self._inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})

    def time_out_stalled_send(self) -> None:
        self._release.set()

    async def receive(self) -> dict[str, Any]:
        return await self._inbox.get()

    async def send(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "websocket.send":
            self.sends_attempted += 1
            if self.stalled:
                await self._release.wait()
                self.stalled = False
                raise asyncio.TimeoutError  # as wait_for reports a send that stayed blocked
            self.frames.append(json.loads(msg["text"]))
        elif msg["type"] == "websocket.close":
            self.close_code = msg.get("code", 1000)

    def of(self, cid: str) -> list[dict[str, Any]]:
        return [f for f in self.frames if f.get("id") == cid]


def api_of(rt: Runtime) -> ApiContext:
    """The edge's context for a Runtime that `running` started (its policy is the Gateway)."""
    assert isinstance(rt.policy, Gateway)
    return ApiContext(rt, rt.policy)


def ws_endpoint(rt: Runtime) -> WsEndpoint:
    return WsEndpoint(api_of(rt))


def connect(endpoint: WsEndpoint, sock: FakeSocket) -> "asyncio.Task[None]":
    """Run one connection on the endpoint; the task ends when the connection does."""
    scope = {"type": "websocket", "path": "/v1/ws", "headers": [], "client": ("127.0.0.1", 50000)}
    return asyncio.get_running_loop().create_task(endpoint(scope, sock.receive, sock.send))
