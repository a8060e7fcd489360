"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the chat path.

POST: read the body (413 beyond the limit) → ResponsesRequest (400 naming the field) → the
previous response's conversation (404 naming previous_response_id) → GenerationSpec
(server.api.responses_format) → `service.start`, the same admission, quotas (429 in OpenAI's
error shape), Idempotency-Key and ledger commit as a chat completion → only then the response
starts. A client that disconnects detaches, which cancels the request. With `store` (the
default) the response is committed to the ledger (server.api.responses_store) before the client
gets it whole or hears `response.completed`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api import responses_store as store
from server.api.context import ApiContext
from server.api.decode import decode
from server.api.http_io import (
    DisconnectWatch,
    Receive,
    Scope,
    Send,
    error_payload,
    header,
    peer,
    read_body,
    retry_headers,
    send_error,
    send_json,
    send_with_timeout,
)
from server.api.openai_responses import EndWaiter, admit_all, end_error
from server.api.responses_events import ResponseEvents
from server.api.responses_format import (
    ResponsesPlan,
    ResponsesRequest,
    response_body,
    response_id_of,
    responses_spec,
    status_of,
    whole_output,
)
from server.gateway.auth import bind, principal_of
from server.serving.errors import GenerationFailed, PagewireError, Unavailable
from server.serving.idempotency import check_header_key
from server.serving.outbox import Outbox, Subscription
from server.serving.service import Admitted
from server.serving.streams import DeltaEvent, EndEvent

log = logging.getLogger("pagewire.http")


def _sse(event: dict[str, Any]) -> bytes:
    import json

    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


def _error_event(e: PagewireError) -> dict[str, Any]:
    """The fields of a stream `error` event (the SDK's ResponseErrorEvent: code, message, param)."""
    return {"code": e.code, "message": e.message, "param": e.param}


def _turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """This response's output as the assistant turn a continuation shows the model."""
    text = "".join(c["text"] for i in items if i["type"] == "message" for c in i["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    turn: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _created(plan: ResponsesPlan, admitted: Admitted) -> int:
    """The response's created_at: when it was parsed, or an idempotent retry's original request's."""
    rec = admitted.record
    return int(rec.created_at if rec is not None else plan.created_at)


class ResponsesEndpoint:
    """POST /v1/responses (a plain ASGI app, like the chat endpoints: it controls when the
    response starts and sees the disconnect at any moment)."""

    def __init__(self, api: ApiContext) -> None:
        self.api = api
        self.rt = api.rt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_body(scope, receive, self.rt.settings.max_request_bytes)
        except PagewireError as e:
            await send_error(send, e)
            return
        except ConnectionResetError:
            return
        try:
            plan = await self._parse(scope, body)
            admitted = (await admit_all(self.api, [plan.spec]))[0]
        except PagewireError as e:
            if e.status == 429:
                self.rt.metrics.rejected.labels(code=e.code).inc()
            await send_error(send, e)
            return
        except Exception as e:  # a bug or a broken ledger: still answer in OpenAI's shape
            log.exception("admitting a responses request failed")
            await send_error(send, GenerationFailed(f"internal error: {e}", code="internal_error"))
            return
        limits = self.api.limit_headers(plan.spec.key_id)
        headers = [(b"x-request-id", admitted.request_id.encode()), *limits]
        if plan.req.stream:
            await self._stream(send, receive, plan, admitted, headers)
        else:
            await self._whole(send, receive, plan, admitted, headers)

    async def _parse(self, scope: Scope, body: bytes) -> ResponsesPlan:
        idem = check_header_key(header(scope, b"idempotency-key"))
        req = decode(body, ResponsesRequest)
        self.api.check_model(req.model)
        who = principal_of(scope)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            assert self.rt.ledger is not None
            history = await store.conversation(self.rt.ledger, req.previous_response_id, who)
        plan = responses_spec(req, peer(scope), self.rt.model_name, idem, self.api.tool_parser,
                              self.api.tool_marker_special, history)
        bind(plan.spec, who)
        return plan

    async def _finish(self, plan: ResponsesPlan, admitted: Admitted, end: EndEvent,
                      items: list[dict[str, Any]]) -> dict[str, Any]:
        """The final response object, stored (committed) first when `store` is on."""
        response_id = response_id_of(admitted.request_id)
        finish = end.finish_reason
        body = response_body(plan, response_id, _created(plan, admitted), status_of(finish), items, end.usage, finish)
        if plan.req.store:
            assert self.rt.ledger is not None
            await store.save(self.rt.ledger, body, plan.conversation + [_turn(items)], admitted.request_id,
                             plan.spec.key_id)
        return body

    async def _whole(self, send: Send, receive: Receive, plan: ResponsesPlan, admitted: Admitted,
                     headers: list[tuple[bytes, bytes]]) -> None:
        waiter = EndWaiter()
        watch = DisconnectWatch(receive, waiter.cancel)
        stream_ = None
        try:
            stream_ = await self.api.service.attach(admitted.request_id, waiter, 0, admitted.record)
            end = await waiter.future
        except asyncio.CancelledError:
            if not watch.disconnected:
                raise
            return  # the client left; `finally` detaches, which cancels the request
        except PagewireError as e:
            await send_error(send, e)
            return
        finally:
            watch.stop()
            if stream_ is not None:
                self.api.service.detach(stream_, waiter)
        if not end.finished:
            await send_error(send, end_error(end))
            return
        items = whole_output(plan, end, response_id_of(admitted.request_id))
        try:
            body = await self._finish(plan, admitted, end, items)
            await send_json(send, 200, body, headers)
        except PagewireError as e:
            await send_error(send, e)
        except OSError:
            pass

    async def _stream(self, send: Send, receive: Receive, plan: ResponsesPlan, admitted: Admitted,
                      headers: list[tuple[bytes, bytes]]) -> None:
        rt = self.rt
        response_id = response_id_of(admitted.request_id)
        outbox = Outbox(rt.settings.outbox_bytes)
        sub = Subscription(outbox, admitted.request_id)
        watch = DisconnectWatch(receive, outbox.close)
        events = ResponseEvents(response_id, admitted.request_id, plan.tools)
        timeout = rt.settings.send_timeout
        created = _created(plan, admitted)
        stream_ = None
        ok = await send_with_timeout(send, {
            "type": "http.response.start", "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *headers],
        }, timeout)
        try:
            if not ok:
                return
            # Attached before anything else is sent: from here a disconnect (detach) cancels it.
            stream_ = await self.api.service.attach(admitted.request_id, sub, 0, admitted.record)
            start = response_body(plan, response_id, created, "in_progress", [], None)
            first = _sse(events.event("response.created", response=start)) + \
                _sse(events.event("response.in_progress", response=start))
            ok = await send_with_timeout(send, {"type": "http.response.body", "body": first, "more_body": True},
                                         timeout)
            while ok:
                batch = await outbox.get()
                if outbox.overflowed:  # stuck consumer: keep it running for an idempotent retry
                    self.api.service.keep_for_resume(admitted.request_id)
                    rt.metrics.slow_consumers.labels(edge="sse").inc()
                    err = Unavailable("stream consumer too slow; retry with the same Idempotency-Key to fetch "
                                      "the result", code="slow_consumer")
                    await send_with_timeout(send, {"type": "http.response.body", "more_body": False,
                                                   "body": _sse(events.event("error", **_error_event(err)))},
                                            1.0)
                    return
                if not batch:
                    return  # the client disconnected
                chunks: list[bytes] = []
                done = False
                for _rid, ev in batch:
                    if isinstance(ev, DeltaEvent):
                        chunks += [_sse(e) for e in events.delta(ev.reasoning, ev.text, ev.finish_reason)]
                    elif isinstance(ev, EndEvent):
                        chunks += await self._end(plan, admitted, ev, events)
                        done = True
                        break
                ok = await send_with_timeout(send, {"type": "http.response.body", "body": b"".join(chunks),
                                                    "more_body": not done}, timeout)
                if done:
                    return
        finally:
            watch.stop()
            if stream_ is not None:
                self.api.service.detach(stream_, sub)

    async def _end(self, plan: ResponsesPlan, admitted: Admitted, end: EndEvent,
                   events: ResponseEvents) -> list[bytes]:
        if not end.finished:
            err = end_error(end)
            failed = response_body(plan, events.response_id, int(time.time()), "failed", events.items, end.usage,
                                   error={"code": "server_error", "message": err.message})
            return [_sse(events.event("response.failed", response=failed))]
        out = [_sse(e) for e in events.close("incomplete" if end.finish_reason == "length" else "completed")]
        try:
            body = await self._finish(plan, admitted, end, events.items)
        except PagewireError as e:  # the store did not commit: say so instead of `completed`
            return out + [_sse(events.event("error", **_error_event(e)))]
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return out + [_sse(events.event(kind, response=body))]


def _error(exc: PagewireError) -> JSONResponse:
    return JSONResponse(error_payload(exc), status_code=exc.status,
                        headers={k.decode(): v.decode() for k, v in retry_headers(exc)})


def stored_routes(api: ApiContext) -> list[Any]:
    """GET and DELETE /v1/responses/{id}, for the owning key (another key's id: 404)."""
    from starlette.routing import Route

    async def get(request: Request) -> Response:
        try:
            assert api.rt.ledger is not None
            body = await store.load(api.rt.ledger, request.path_params["response_id"], principal_of(request.scope))
        except PagewireError as e:
            return _error(e)
        return JSONResponse(body)

    async def delete(request: Request) -> Response:
        rid = request.path_params["response_id"]
        try:
            assert api.rt.ledger is not None
            await store.delete(api.rt.ledger, rid, principal_of(request.scope))
        except PagewireError as e:
            return _error(e)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    return [Route("/v1/responses/{response_id}", get, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete, methods=["DELETE"])]


def routes(api: ApiContext) -> list[Any]:
    from starlette.routing import Route

    return [Route("/v1/responses", ResponsesEndpoint(api), methods=["POST"]), *stored_routes(api)]

