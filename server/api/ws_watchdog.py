"""Cutting a WebSocket peer that has stopped reading even when the app itself sends nothing.

The app's writer already cuts a client whose sends stay blocked for `send_timeout`. But a client
can make the *server's protocol layer* write without the app sending anything: each ping it
sends is answered with a pong. A client that floods pings and never reads fills the socket and
then the transport's buffer with pongs; the protocol's reader then waits for the buffer to drain
(so it stops reading the socket), and its keepalive, which should time the peer out, fails on
that same paused writer ("keepalive ping failed ... AssertionError" from `websockets`). The
connection would stay open for as long as the client likes.

The watchdog looks at the transport under the ASGI connection and aborts it once its writes
have stayed paused (the buffer above its high-water mark, the peer not reading) for twice
`send_timeout`. Twice, because it is the backstop, not the first resort: when the app's own
writer finds a stuck consumer (after one `send_timeout`) it queues a resumable `slow_consumer`
error frame and a 1013 close, and a client that then starts reading must get them. Aborting at
the same moment would throw that frame away with the transport's buffer.

It reaches the transport through the server's ASGI `send` callable, which under uvicorn is a
bound method of the connection's protocol. Starlette wraps `send`
before a route sees it, so `CaptureTransport`, the outermost middleware, records the transport
in the scope first. Where none is found (another ASGI server) the watchdog does nothing, and
the app-level send timeout still applies.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

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


async def watch(transport: Optional[asyncio.WriteTransport], send_timeout: float, peer: str) -> None:
    """Run for the life of a connection; abort it once it has been stuck for 2 × `send_timeout`."""
    if transport is None or send_timeout <= 0:
        return
    timeout = 2 * send_timeout
    loop = asyncio.get_running_loop()
    period = max(0.05, min(1.0, timeout / 4))
    stuck_since: Optional[float] = None
    while not transport.is_closing():
        await asyncio.sleep(period)
        if not _stuck(transport):
            stuck_since = None
            continue
        now = loop.time()
        if stuck_since is None:
            stuck_since = now
        elif now - stuck_since >= timeout:
            log.warning("ws %s: the peer has not read for %.1fs (%d bytes waiting); closing the connection",
                        peer, now - stuck_since, transport.get_write_buffer_size())
            transport.abort()
            return
