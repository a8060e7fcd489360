"""Following one admitted request for a format layer: wait for its end (a whole response), or
stream its events through a renderer (Anthropic's SSE events, Ollama's NDJSON lines).

This is the single-request form of what `openai_responses` does for OpenAI's (possibly batched)
responses, on the same parts: `service.attach` replays what was missed and follows live output,
an `Outbox` bounds and coalesces the backlog, a `DisconnectWatch` notices a vanished client, and
`service.detach` on the way out cancels the request in the engine at its next step (unless
another subscriber, such as an idempotent retry, still follows it). A consumer that stays stuck
past --send-timeout gets a final error and the request keeps running for an idempotent retry.
Only the bytes are the format layer's: a `StreamRenderer` turns events into them.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional, Protocol, Sequence

from server.api.context import ApiContext
from server.api.http_io import DisconnectWatch, Receive, Send, send_with_timeout
from server.api.openai_responses import EndWaiter
from server.serving.errors import PagewireError, Unavailable
from server.serving.outbox import Outbox, Subscription
from server.serving.service import Admitted
from server.serving.streams import DeltaEvent, EndEvent, Event


class StreamRenderer(Protocol):
    """The bytes of one streamed response, event by event."""

    def start(self) -> bytes:
        """Sent right after the response headers (Anthropic's message_start and ping)."""
        ...

    def delta(self, ev: DeltaEvent) -> bytes:
        ...

    def end(self, ev: EndEvent) -> bytes:
        """The last bytes: the closing events, or the error when the request did not finish."""
        ...

    def error(self, err: PagewireError) -> bytes:
        """A stream cut short by the server (a stuck consumer)."""
        ...


class _Waiter(EndWaiter):
    """An EndWaiter that also reports the request's first output (for Ollama's durations)."""

    def __init__(self, on_first_delta: Optional[Callable[[], None]]) -> None:
        super().__init__()
        self._on_first_delta = on_first_delta

    def push(self, event: Event) -> None:
        if isinstance(event, DeltaEvent) and self._on_first_delta is not None:
            callback, self._on_first_delta = self._on_first_delta, None
            callback()
        super().push(event)


async def wait_end(api: ApiContext, receive: Receive, admitted: Admitted,
                   on_first_delta: Optional[Callable[[], None]] = None) -> Optional[EndEvent]:
    """The request's EndEvent, or None when the client disconnected first (the request is then
    cancelled, as the OpenAI edge does). Raises PagewireError when it cannot be followed."""
    waiter = _Waiter(on_first_delta)
    watch = DisconnectWatch(receive, waiter.cancel)
    stream: Any = None
    try:
        stream = await api.service.attach(admitted.request_id, waiter, 0, admitted.record)
        return await waiter.future
    except asyncio.CancelledError:
        if not watch.disconnected:
            raise
        return None  # `finally` detaches, which cancels what still runs
    finally:
        watch.stop()
        api.service.detach(stream, waiter)


async def wait_ends(api: ApiContext, receive: Receive, admitted: list[Admitted]) -> Optional[list[EndEvent]]:
    """Every request's EndEvent, in order (a batch of embedding inputs), or None when the client
    disconnected first (what still runs is then cancelled). Raises PagewireError when one cannot
    be followed."""
    waiters = [EndWaiter() for _ in admitted]

    def cancel_all() -> None:
        for w in waiters:
            w.cancel()

    watch = DisconnectWatch(receive, cancel_all)
    attached: list[tuple[Any, EndWaiter]] = []
    try:
        for a, w in zip(admitted, waiters):
            attached.append((await api.service.attach(a.request_id, w, 0, a.record), w))
        return list(await asyncio.gather(*(w.future for w in waiters)))
    except asyncio.CancelledError:
        if not watch.disconnected:
            raise
        return None  # `finally` detaches, which cancels what still runs
    finally:
        watch.stop()
        for stream, w in attached:
            api.service.detach(stream, w)


async def follow_stream(api: ApiContext, send: Send, receive: Receive, admitted: Admitted, content_type: bytes,
                        render: StreamRenderer, edge: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Start a 200 streamed response and send the request's events through `render` until its end.
    `edge` labels the slow-consumer metric."""
    rt = api.rt
    outbox = Outbox(rt.settings.outbox_bytes)
    sub = Subscription(outbox, admitted.request_id)
    watch = DisconnectWatch(receive, outbox.close)
    stream: Any = None
    timeout = rt.settings.send_timeout
    ok = await send_with_timeout(send, {
        "type": "http.response.start", "status": 200,
        "headers": [(b"content-type", content_type), (b"cache-control", b"no-cache"),
                    (b"x-request-id", admitted.request_id.encode()), *headers],
    }, timeout)
    try:
        if not ok:
            return
        ok = await send_with_timeout(send, {"type": "http.response.body", "body": render.start(),
                                            "more_body": True}, timeout)
        stream = await api.service.attach(admitted.request_id, sub, 0, admitted.record)
        while ok:
            batch = await outbox.get()
            if outbox.overflowed:
                api.service.keep_for_resume(admitted.request_id)
                rt.metrics.slow_consumers.labels(edge=edge).inc()
                err = Unavailable("stream consumer too slow; retry with the same Idempotency-Key "
                                  "to fetch the result", code="slow_consumer")
                await send_with_timeout(send, {"type": "http.response.body", "body": render.error(err),
                                               "more_body": False}, 1.0)
                return
            if not batch:
                return  # the client disconnected
            chunks: list[bytes] = []
            done = False
            for _, ev in batch:
                if isinstance(ev, DeltaEvent):
                    chunks.append(render.delta(ev))
                elif isinstance(ev, EndEvent):
                    chunks.append(render.end(ev))
                    done = True
                    break
            ok = await send_with_timeout(send, {"type": "http.response.body", "body": b"".join(chunks),
                                                "more_body": not done}, timeout)
            if done:
                return
    finally:
        watch.stop()
        api.service.detach(stream, sub)
