"""Raw ASGI plumbing for the HTTP edge: bounded body reads, JSON and OpenAI-shaped error responses,
and a watcher that notices a client disconnect while a request is in flight.

The generation endpoints are plain ASGI callables (not Starlette request/response functions) so
that they control exactly when the response starts (after the ledger commit) and can react to
`http.disconnect` at any moment, which is what lets a vanished client abort its request.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional

import msgspec

from server.serving.errors import PagewireError, TooLarge

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

_enc = msgspec.json.Encoder()


def header(scope: Scope, name: bytes) -> Optional[str]:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


def peer(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, or TooLarge (413) as soon as it exceeds `limit` bytes."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"request body is {declared} bytes; the limit is {limit} bytes")
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected while sending the body")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"request body exceeds the limit of {limit} bytes")
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts)


def error_payload(exc: PagewireError) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}}


async def send_json(send: Send, status: int, payload: Any, headers: Optional[list[tuple[bytes, bytes]]] = None) -> None:
    body = _enc.encode(payload)
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        + (headers or []),
    })
    await send({"type": "http.response.body", "body": body})


def retry_headers(exc: PagewireError) -> list[tuple[bytes, bytes]]:
    # Extra headers an error carries (the gateway's x-ratelimit-* on a 429).
    extra = [(k.encode(), v.encode()) for k, v in getattr(exc, "headers", {}).items()]
    if exc.retry_after_s is None:
        return extra
    # Retry-After is whole seconds; round up so a client never retries too early. retry-after-ms
    # (which the openai SDK prefers) carries the exact figure.
    return extra + [(b"retry-after", str(max(1, int(-(-exc.retry_after_s // 1)))).encode()),
                    (b"retry-after-ms", str(max(1, int(exc.retry_after_s * 1000))).encode())]


async def send_error(send: Send, exc: PagewireError) -> None:
    await send_json(send, exc.status, error_payload(exc), retry_headers(exc))


class DisconnectWatch:
    """Waits on `receive()` for http.disconnect after the body was read; calls `on_disconnect`.

    ASGI servers deliver the disconnect only to a pending `receive()`, so one task keeps one
    pending for the life of the response.
    """

    def __init__(self, receive: Receive, on_disconnect: Callable[[], None]) -> None:
        self.disconnected = False
        self._receive = receive
        self._on_disconnect = on_disconnect
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                self.disconnected = True
                self._on_disconnect()
                return

    def stop(self) -> None:
        self._task.cancel()


async def send_with_timeout(send: Send, message: dict[str, Any], timeout: float) -> bool:
    """Send one message; False if the client is gone or stayed stuck for `timeout` seconds."""
    try:
        await asyncio.wait_for(send(message), timeout)
        return True
    except (asyncio.TimeoutError, OSError, RuntimeError):
        return False


def sse_bytes(payload: Any) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + _sse_enc.encode(payload) + b"\n\n"


_sse_enc = msgspec.json.Encoder()
