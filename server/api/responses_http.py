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

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api import responses_store as store
from server.api.admission import read_and_admit
from server.api.context import ApiContext
from server.api.decode import decode
from server.api.follow import follow_streams, wait_finished
from server.api.http_io import (
    Receive,
    Scope,
    Send,
    error_payload,
    header,
    peer,
    retry_headers,
    send_error,
    send_json,
)
from server.api.openai_responses import admit_all, end_error
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
from server.serving.errors import PagewireError
from server.serving.idempotency import check_header_key
from server.serving.service import Admitted
from server.serving.streams import DeltaEvent, EndEvent


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
        async def admit(body: bytes) -> tuple[ResponsesPlan, Admitted]:
            plan = await self._parse(scope, body)
            return plan, (await admit_all(self.api, [plan.spec]))[0]

        got = await read_and_admit(self.api, scope, receive, send, send_error, admit,
                                   "admitting a responses request")
        if got is None:
            return
        plan, admitted = got
        headers = self.api.limit_headers(plan.spec.key_id, plan.spec.model)
        if plan.req.stream:
            await self._stream(send, receive, plan, admitted, headers)
        else:
            await self._whole(send, receive, plan, admitted, headers)

    async def _parse(self, scope: Scope, body: bytes) -> ResponsesPlan:
        idem = check_header_key(header(scope, b"idempotency-key"))
        req = decode(body, ResponsesRequest)
        api = self.api.for_model(req.model)
        who = principal_of(scope)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            assert self.rt.ledger is not None
            history = await store.conversation(self.rt.ledger, req.previous_response_id, who)
        plan = responses_spec(req, peer(scope), api.model_name, idem, api.tool_parser,
                              api.tool_marker_special, history)
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
        end = await wait_finished(self.api, send, receive, admitted, send_error)
        if end is None:
            return  # the client left (the request was cancelled), or the error was answered
        items = whole_output(plan, end, response_id_of(admitted.request_id))
        try:
            body = await self._finish(plan, admitted, end, items)
            await send_json(send, 200, body, [(b"x-request-id", admitted.request_id.encode()), *headers])
        except PagewireError as e:
            await send_error(send, e)
        except OSError:
            pass

    async def _stream(self, send: Send, receive: Receive, plan: ResponsesPlan, admitted: Admitted,
                      headers: list[tuple[bytes, bytes]]) -> None:
        events = ResponseEvents(response_id_of(admitted.request_id), admitted.request_id, plan.tools)
        await follow_streams(self.api, send, receive, [admitted], b"text/event-stream",
                             _EventStream(self, plan, admitted, events), "sse", headers)

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


class _EventStream:
    """Responses' typed SSE events for one response: the EventsRenderer that `follow_streams` drives.
    Its end stores the response (when `store`) before `response.completed` is sent."""

    def __init__(self, owner: ResponsesEndpoint, plan: ResponsesPlan, admitted: Admitted,
                 events: ResponseEvents) -> None:
        self.owner = owner
        self.plan = plan
        self.admitted = admitted
        self.events = events

    def start(self) -> bytes:
        start = response_body(self.plan, self.events.response_id, _created(self.plan, self.admitted),
                              "in_progress", [], None)
        return _sse(self.events.event("response.created", response=start)) + \
            _sse(self.events.event("response.in_progress", response=start))

    def delta(self, request_id: str, ev: DeltaEvent) -> bytes:
        return b"".join(_sse(e) for e in self.events.delta(ev.reasoning, ev.text, ev.finish_reason))

    async def end(self, request_id: str, ev: EndEvent) -> tuple[bytes, bool]:
        return b"".join(await self.owner._end(self.plan, self.admitted, ev, self.events)), True

    def error(self, err: PagewireError) -> bytes:
        return _sse(self.events.event("error", **_error_event(err)))


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

