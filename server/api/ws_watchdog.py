"""WebSocket liveness: the one mechanism that decides a peer has stopped reading, or is gone.

uvicorn's own keepalive (the `websockets` library's ping every 20 s, closing with 1011 when no
pong comes within 20 s) is turned off (`ws_ping_interval=None` in `server.serve`): it
raced the slow-consumer cut and won, so a client that stopped reading got 1011 "keepalive ping
timeout" (or 1006) and its requests were cancelled, never the documented resumable
`slow_consumer` error and close 1013. pagewire owns liveness instead, with one rule: **a peer
that has not taken what the server wrote for `send_timeout` seconds is stuck**, and a stuck peer
is cut by `WsConnection.request_cut` (the `slow_consumer` frame listing its requests, which are
kept for `resume`, then close 1013). Three observations feed the rule:

* the connection's writer finds one of its sends blocked for `send_timeout` (the app's frames);
* a ping the writer sent every `ping_interval` seconds is not answered within `send_timeout`. A
  pong comes only after the client has read everything sent before the ping, so this catches a
  client that stops reading while its kernel buffers still have room (the writer's sends then
  never block), and a peer that has vanished;
* the transport's writes stay paused (its buffer above the high-water mark) for `send_timeout`
  while the app sends nothing: the protocol layer itself is writing, e.g. pongs to a client that
  floods pings and never reads.

Only the writer task writes frames, pings included: the `websockets` protocol allows one pending
drain at a time (`_drain_helper` asserts it), so a ping from another task while a send is
blocked would fail. After a cut the client has another `send_timeout` to read the error frame
and the close; then the transport is aborted (a client that never reads again must not hold the
socket), and the protocol's `close_timeout` is raised to match so that the close handshake does
not give up sooner.

The transport and protocol are reached through the server's ASGI `send` callable, which under
uvicorn is a bound method of the connection's protocol. Starlette wraps `send` before a route
sees it, so `CaptureTransport`, the outermost middleware, records the transport in the scope
first. Where none is found (another ASGI server) there are no pings and no transport checks, and
the writer's send timeout alone applies.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Optional

log = logging.getLogger("pagewire.ws")


SCOPE_KEY = "pagewire.transport"


class CaptureTransport:
    """Outermost ASGI middleware: put a WebSocket connection's transport in its scope."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            scope[SCOPE_KEY] = transport_of(send)
        await self.app(scope, receive, send)


def transport_of(send: Any) -> Optional[asyncio.WriteTransport]:
    proto = getattr(send, "__self__", None)
    transport = getattr(proto, "transport", None)
    if transport is None or not hasattr(transport, "get_write_buffer_size"):
        return None
    return transport


def _stuck(transport: asyncio.WriteTransport) -> bool:
    """True while the peer is not taking what the server writes: the buffer holds more than the
    high-water mark (writes are paused) or the protocol says its writing is paused."""
    proto_paused = getattr(getattr(transport, "get_protocol", lambda: None)(), "_paused", None)
    if proto_paused is True:
        return True
    try:
        _, high = transport.get_write_buffer_limits()
    except (AttributeError, NotImplementedError):
        high = 64 * 1024
    return transport.get_write_buffer_size() > high


def _quiet(fut: "asyncio.Future[Any]") -> None:
    """Retrieve a pong waiter's outcome: it fails with ConnectionClosed when the socket goes."""
    if not fut.cancelled():
        fut.exception()


class Liveness:
    """One connection's liveness state: pings (sent by the writer), their pongs, and the cut.

    `watch()` runs for the life of the connection and calls `cut(reason)` once the peer is stuck.
    """

    def __init__(self, transport: Optional[asyncio.WriteTransport], send_timeout: float,
                 ping_interval: float, peer: str, cut: Callable[[str], None]) -> None:
        self.transport = transport
        self.send_timeout = send_timeout
        self.peer = peer
        self._cut = cut
        proto = transport.get_protocol() if transport is not None else None
        ping = getattr(proto, "ping", None)
        self._ping: Optional[Callable[[], Awaitable[Awaitable[float]]]] = (
            ping if callable(ping) and ping_interval > 0 and send_timeout > 0 else None)
        self.ping_interval = ping_interval
        close_timeout = getattr(proto, "close_timeout", None)  # the websockets protocol's, when it is one
        if proto is not None and send_timeout > 0 and isinstance(close_timeout, (int, float)):
            ws_proto: Any = proto  # BaseProtocol's stubs know nothing of websockets' attribute
            ws_proto.close_timeout = max(float(close_timeout), send_timeout)
        self._loop = asyncio.get_running_loop()
        self._next_ping = self._loop.time() + ping_interval
        self._pong: Optional[asyncio.Future[Any]] = None
        self._ping_sent_at = 0.0
        self.cut_at: Optional[float] = None

    def ping_delay(self) -> Optional[float]:
        """Seconds until the writer should send the next ping (<= 0: now); None: no pings."""
        if self._ping is None or self.cut_at is not None:
            return None
        return self._next_ping - self._loop.time()

    async def ping(self) -> None:
        """Send one ping (the writer calls this; only it writes). A ping still unanswered is not
        replaced: its deadline keeps running."""
        assert self._ping is not None
        self._next_ping = self._loop.time() + self.ping_interval
        if self._pong is not None and not self._pong.done():
            return
        self._ping_sent_at = self._loop.time()
        waiter = await self._ping()
        fut = asyncio.ensure_future(waiter)
        fut.add_done_callback(_quiet)
        self._pong = fut

    def cutting(self) -> None:
        """The connection has begun its slow-consumer cut: the client's last window starts."""
        if self.cut_at is None:
            self.cut_at = self._loop.time()

    async def watch(self) -> None:
        """Run for the life of the connection (cancelled when it ends)."""
        transport = self.transport
        if transport is None or self.send_timeout <= 0:
            return
        timeout = self.send_timeout
        period = max(0.05, min(1.0, timeout / 4))
        stuck_since: Optional[float] = None
        while not transport.is_closing():
            await asyncio.sleep(period)
            now = self._loop.time()
            if self.cut_at is not None:
                if now - self.cut_at >= timeout:
                    log.warning("ws %s: the client did not read its slow_consumer error within %.1fs "
                                "(%d bytes waiting); dropping the connection", self.peer, now - self.cut_at,
                                transport.get_write_buffer_size())
                    transport.abort()
                    return
                continue
            pong = self._pong
            if pong is not None and not pong.done() and now - self._ping_sent_at >= timeout:
                self._cut(f"it did not answer a ping within {timeout:g}s")
                continue
            if not _stuck(transport):
                stuck_since = None
                continue
            if stuck_since is None:
                stuck_since = now
            elif now - stuck_since >= timeout:
                self._cut(f"the client has not read for {now - stuck_since:.1f}s")

