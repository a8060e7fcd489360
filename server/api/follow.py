"""Following admitted requests for a format layer: wait for their ends (a whole response), or
stream their events through a renderer (OpenAI's SSE chunks, Responses' typed events, Anthropic's
SSE events, Ollama's NDJSON lines).

One set of parts for every API: `service.attach` replays what was missed and follows live output,
an `Outbox` bounds and coalesces the backlog, a `DisconnectWatch` notices a vanished client, and
`service.detach` on the way out cancels the request in the engine at its next step (unless
another subscriber, such as an idempotent retry, still follows it). A consumer that stays stuck
past --send-timeout gets a final error and the requests keep running for an idempotent retry.
Only the bytes are the format layer's: a renderer turns events into them. A response may cover
several requests (OpenAI's batched prompts), interleaved in the order the engine produced them.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional, Protocol, Sequence

from server.api.admission import SendError
from server.api.context import ApiContext
from server.api.http_io import DisconnectWatch, Receive, Send, send_with_timeout
from server.serving.errors import PagewireError, Unavailable
from server.serving.lifecycle import end_error
from server.serving.outbox import Outbox, Subscription
from server.serving.service import Admitted
from server.serving.streams import DeltaEvent, EndEvent, EndWaiter, Event


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


class EventsRenderer(Protocol):
    """The bytes of one streamed response over one or more requests, event by event."""

    def start(self) -> bytes:
        """Sent once every request is attached, before any event (may be empty)."""
        ...

    def delta(self, request_id: str, ev: DeltaEvent) -> bytes:
        ...

    async def end(self, request_id: str, ev: EndEvent) -> tuple[bytes, bool]:
        """The bytes for one request's end, and whether the response is complete with it."""
        ...

    def error(self, err: PagewireError) -> bytes:
        """A stream cut short by the server (a stuck consumer): the last bytes."""
        ...


class _One:
    """A single request's StreamRenderer as an EventsRenderer: its end ends the response."""

    def __init__(self, render: StreamRenderer) -> None:
        self._render = render

    def start(self) -> bytes:
        return self._render.start()

    def delta(self, request_id: str, ev: DeltaEvent) -> bytes:
        return self._render.delta(ev)

    async def end(self, request_id: str, ev: EndEvent) -> tuple[bytes, bool]:
        return self._render.end(ev), True

    def error(self, err: PagewireError) -> bytes:
        return self._render.error(err)


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


async def wait_finished(api: ApiContext, send: Send, receive: Receive, admitted: Admitted, send_error: SendError,
                        on_first_delta: Optional[Callable[[], None]] = None) -> Optional[EndEvent]:
    """The request's EndEvent when it finished; None when the client left (the request was then
    cancelled) or when it did not finish or could not be followed, which is then answered through
    the API's `send_error`."""
    try:
        end = await wait_end(api, receive, admitted, on_first_delta)
    except PagewireError as e:
        await send_error(send, e)
        return None
    if end is not None and not end.finished:
        await send_error(send, end_error(end.request_id, end.reason, end.message))
        return None
    return end


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
    await follow_streams(api, send, receive, [admitted], content_type, _One(render), edge, headers)


async def follow_streams(api: ApiContext, send: Send, receive: Receive, admitted: Sequence[Admitted],
                         content_type: bytes, render: EventsRenderer, edge: str,
                         headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Start a 200 streamed response and send every request's events through `render` until it says
    the response is complete. `edge` labels the slow-consumer metric; `headers` go on the response
    start beside x-request-id (every request's id, comma-separated)."""
    rt = api.rt
    outbox = Outbox(rt.settings.outbox_bytes)
    subs = [Subscription(outbox, a.request_id) for a in admitted]
    watch = DisconnectWatch(receive, outbox.close)
    attached: list[tuple[Any, Subscription]] = []
    timeout = rt.settings.send_timeout
    ok = await send_with_timeout(send, {
        "type": "http.response.start", "status": 200,
        "headers": [(b"content-type", content_type), (b"cache-control", b"no-cache"),
                    (b"x-request-id", ",".join(a.request_id for a in admitted).encode()), *headers],
    }, timeout)
    try:
        if not ok:
            return
        # Attached before anything else is sent: from here a disconnect (detach) cancels them.
        for a, sub in zip(admitted, subs):
            attached.append((await api.service.attach(a.request_id, sub, 0, a.record), sub))
        first = render.start()
        if first:
            ok = await send_with_timeout(send, {"type": "http.response.body", "body": first, "more_body": True},
                                         timeout)
        while ok:
            batch = await outbox.get()
            if outbox.overflowed:
                for a in admitted:
                    api.service.keep_for_resume(a.request_id)
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
            for rid, ev in batch:
                if isinstance(ev, DeltaEvent):
                    chunks.append(render.delta(str(rid), ev))
                elif isinstance(ev, EndEvent):
                    out, done = await render.end(str(rid), ev)
                    chunks.append(out)
                    if done:
                        break
            ok = await send_with_timeout(send, {"type": "http.response.body", "body": b"".join(chunks),
                                                "more_body": not done}, timeout)
            if done:
                return
    finally:
        watch.stop()
        for stream, sub in attached:
            api.service.detach(stream, sub)
