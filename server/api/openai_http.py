"""POST /v1/completions and /v1/chat/completions: parse, admit, then answer whole or as SSE.

The path of one HTTP request: read the body (413 beyond the limit) → msgspec Struct (400 naming
the field) → GenerationSpec → `service.start` (ledger row committed) → only then the response
starts. While it runs, a DisconnectWatch turns a vanished client into `service.detach`, which
aborts the request in the engine at its next step (unless another subscriber, such as an
idempotent retry, still follows it).
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any


from server.api.decode import decode
from server.api import openai_batch
from server.api.http_io import (DisconnectWatch, Receive, Scope, Send, error_payload, header, peer,
                                read_body, send_error, send_json, send_with_timeout, sse_bytes)
from server.api.openai_format import chat_spec, completion_specs
from server.api.protocol import ChatCompletionRequest, CompletionRequest
from server.errors import (Conflict, DeadlineExceeded, GenerationFailed, NotFound, PagewireError,
                           Unavailable)
from server.streams import DeltaEvent, EndEvent, Event, Outbox, Subscription

if TYPE_CHECKING:
    from server.runtime import Runtime

log = logging.getLogger("pagewire.http")


class EndWaiter:
    """A subscriber that only wants the end of a request (non-streamed responses)."""

    def __init__(self) -> None:
        self.future: asyncio.Future[EndEvent] = asyncio.get_running_loop().create_future()

    def push(self, event: Event, replay: bool = False) -> None:
        if isinstance(event, EndEvent) and not self.future.done():
            self.future.set_result(event)

    def cancel(self) -> None:
        if not self.future.done():
            self.future.cancel()


def end_error(end: EndEvent) -> PagewireError:
    """The error a request that did not finish is reported as (also for idempotent retries)."""
    if end.state == "cancelled":
        return Conflict(f"request {end.request_id} was cancelled", code="request_cancelled")
    if end.state == "interrupted":
        return Conflict(f"request {end.request_id} was interrupted: {end.message}", code="request_interrupted")
    if end.code == "deadline_exceeded":
        return DeadlineExceeded(f"request {end.request_id}: {end.message}")
    return GenerationFailed(f"request {end.request_id} failed: {end.message}")


class GenerateEndpoint:
    """One ASGI app per endpoint; `kind` is "completion" or "chat"."""

    def __init__(self, runtime: "Runtime", kind: str) -> None:
        self.rt = runtime
        self.kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_body(scope, receive, self.rt.settings.max_request_bytes)
        except PagewireError as e:
            await send_error(send, e)
            return
        except ConnectionResetError:
            return
        try:
            specs, stream, include_usage, n = self._parse(scope, body)
            if len(specs) > 1:
                batch = await openai_batch.admit_all(self.rt, specs)
            else:
                admitted = await self.rt.service.start(specs[0])
        except PagewireError as e:
            if e.status == 429:
                self.rt.metrics.rejected.labels(code=e.code).inc()
            await send_error(send, e)
            return
        except Exception as e:  # a bug or a broken ledger: still answer in OpenAI's shape
            log.exception("admitting a request failed")
            await send_error(send, GenerationFailed(f"internal error: {e}", code="internal_error"))
            return
        if len(specs) > 1:
            if stream:
                await openai_batch.stream(self.rt, send, receive, batch, n, include_usage, end_error)
            else:
                await openai_batch.whole(self.rt, send, receive, batch, n, end_error, EndWaiter)
        elif stream:
            await self._stream(send, receive, admitted, include_usage)
        else:
            await self._whole(send, receive, admitted)

    def _parse(self, scope: Scope, body: bytes) -> tuple[list[Any], bool, bool, int]:
        rt = self.rt
        idem = header(scope, b"idempotency-key")
        if self.kind == "chat":
            req: Any = decode(body, ChatCompletionRequest)
        else:
            req = decode(body, CompletionRequest)
        if req.model is not None and req.model != rt.model_name:
            raise NotFound(f"model: '{req.model}' does not exist; this server serves '{rt.model_name}'",
                           param="model", code="model_not_found")
        if self.kind == "chat":
            specs = [chat_spec(req, "http", peer(scope), rt.model_name, idem)]
        else:
            specs = completion_specs(req, "http", peer(scope), rt.model_name, idem, openai_batch.MAX_BATCH)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return specs, req.stream, include_usage, req.n

    async def _whole(self, send: Send, receive: Receive, admitted: Any) -> None:
        waiter = EndWaiter()
        watch = DisconnectWatch(receive, waiter.cancel)
        stream = None
        try:
            stream = await self.rt.service.attach(admitted.request_id, waiter, 0, admitted.record)
            end = await waiter.future
        except asyncio.CancelledError:
            if not watch.disconnected:
                raise
            return  # the client left; `finally` cancels the request
        except PagewireError as e:
            await send_error(send, e)
            return
        finally:
            watch.stop()
            self.rt.service.detach(stream, waiter)
        if end.state != "finished":
            await send_error(send, end_error(end))
            return
        fmt = self.rt.formatter
        payload = fmt.chat_response(end) if self.kind == "chat" else fmt.completion_response(end)
        try:
            await send_json(send, 200, payload, [(b"x-request-id", end.request_id.encode())])
        except OSError:
            pass

    async def _stream(self, send: Send, receive: Receive, admitted: Any, include_usage: bool) -> None:
        rt = self.rt
        outbox = Outbox(rt.settings.outbox_bytes)
        sub = Subscription(outbox, admitted.request_id)
        watch = DisconnectWatch(receive, outbox.close)
        stream = None
        timeout = rt.settings.send_timeout
        ok = await send_with_timeout(send, {
            "type": "http.response.start", "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                        (b"x-request-id", admitted.request_id.encode())],
        }, timeout)
        try:
            if not ok:
                return
            stream = await rt.service.attach(admitted.request_id, sub, 0, admitted.record)
            first: set[int] = set()
            while ok:
                batch = await outbox.get()
                if outbox.overflowed:
                    # Stuck consumer: keep the request running for an idempotent retry and stop here.
                    job = rt.service.jobs.get(admitted.request_id)
                    if job is not None:
                        job.detached = True
                    err = Unavailable("stream consumer too slow; retry with the same Idempotency-Key "
                                      "to fetch the result", code="slow_consumer")
                    await send_with_timeout(send, _sse(error_payload(err)), 1.0)
                    return
                if not batch:
                    return  # the client disconnected
                chunks: list[bytes] = []
                ended = False
                for _, ev in batch:
                    ended = self._render(ev, admitted.request_id, first, include_usage, chunks) or ended
                ok = await send_with_timeout(send, {"type": "http.response.body", "body": b"".join(chunks),
                                                    "more_body": not ended}, timeout)
                if ended:
                    return
        finally:
            watch.stop()
            rt.service.detach(stream, sub)
            if not ok or watch.disconnected:
                log.debug("stream %s: client gone", admitted.request_id)

    def _render(self, ev: Event, rid: str, first: set[int], include_usage: bool, out: list[bytes]) -> bool:
        """Append SSE bytes for one event; True when it was the end."""
        fmt = self.rt.formatter
        if isinstance(ev, DeltaEvent):
            if self.kind == "chat":
                out.append(sse_bytes(fmt.chat_chunk(rid, ev, ev.index not in first, include_usage)))
                first.add(ev.index)
            else:
                out.append(sse_bytes(fmt.completion_chunk(rid, ev, include_usage)))
            return False
        if isinstance(ev, EndEvent):
            if ev.state != "finished":
                out.append(sse_bytes(error_payload(end_error(ev))))
            elif include_usage:
                out.append(sse_bytes(fmt.usage_chunk(self.kind, ev)))
            out.append(b"data: [DONE]\n\n")
            return True
        return False



def _sse(payload: Any) -> dict[str, Any]:
    return {"type": "http.response.body", "body": sse_bytes(payload) + b"data: [DONE]\n\n", "more_body": False}
