"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the one request path.

A request goes the way an OpenAI chat request goes: bounded body read (413) → msgspec Struct (400
naming the field) → the same GenerationSpec (server.api.anthropic_format) bound to the caller's
key → `service.start` (quota reserve, ledger row committed) → only then the response starts, whole
or as Anthropic's SSE events (server.api.follow). A vanished client detaches, which cancels the
request at the engine's next step. The key comes as `x-api-key` or `Authorization: Bearer`
(server.gateway.auth); `anthropic-version` and `anthropic-beta` are accepted and not needed;
`Idempotency-Key` works as on the OpenAI routes. Every error is in Anthropic's shape.
"""
from __future__ import annotations

from typing import Any, Optional

from server.api.admission import read_and_admit
from server.api.anthropic_format import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error,
    messages_spec,
    prompt_spec,
    thinking_mode,
)
from server.api.anthropic_output import MessageStream, message_body
from server.api.context import ApiContext
from server.api.decode import decode
from server.api.follow import follow_stream, wait_finished
from server.api.http_io import Receive, Scope, Send, header, peer, retry_headers, send_json
from server.api.tools import ToolPlan
from server.gateway.auth import bind, principal_of
from server.serving.errors import PagewireError
from server.serving.idempotency import check_header_key
from server.serving.jobs import GenerationSpec
from server.serving.service import Admitted


async def send_error(send: Send, exc: PagewireError, headers: Optional[list[tuple[bytes, bytes]]] = None) -> None:
    await send_json(send, exc.status, anthropic_error(exc), retry_headers(exc) + (headers or []))


class MessagesEndpoint:
    """POST /v1/messages."""

    def __init__(self, api: ApiContext) -> None:
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = self.api

        async def admit(body: bytes) -> tuple[MessagesRequest, GenerationSpec, ToolPlan, Admitted, ApiContext]:
            idem = check_header_key(header(scope, b"idempotency-key"))
            req: MessagesRequest = decode(body, MessagesRequest)
            mapi = api.for_model(req.model)
            spec, plan = messages_spec(req, peer(scope), mapi.model_name, mapi.tool_parser,
                                       mapi.tool_marker_special, idem)
            bind(spec, principal_of(scope))
            return req, spec, plan, await api.service.start(spec), mapi

        got = await read_and_admit(api, scope, receive, send, send_error, admit)
        if got is None:
            return
        req, spec, plan, admitted, api = got
        thinking = thinking_mode(req) is True  # checked with max_tokens when the spec was built
        rid = admitted.request_id.encode()
        headers = [(b"request-id", rid), *api.limit_headers(spec.key_id, spec.model)]
        if req.stream:
            render = MessageStream(admitted.request_id, api.model_name, plan, req.stop_sequences,
                                   admitted.prompt_tokens, thinking)
            await follow_stream(api, send, receive, admitted, b"text/event-stream", render, "anthropic", headers)
            return
        end = await wait_finished(api, send, receive, admitted, send_error)
        if end is None:
            return  # the client left (the request was cancelled), or the error was answered
        out = message_body(end, plan, api.model_name, req.stop_sequences, thinking)
        try:
            await send_json(send, 200, out, [(b"x-request-id", rid), *headers])
        except OSError:
            pass


class CountTokensEndpoint:
    """POST /v1/messages/count_tokens: the prompt's tokens, rendered exactly as /v1/messages renders
    it (system, messages, tools, through the chat template)."""

    def __init__(self, api: ApiContext) -> None:
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = self.api

        async def count(body: bytes) -> int:
            req: CountTokensRequest = decode(body, CountTokensRequest)
            mapi = api.for_model(req.model)
            spec, _ = prompt_spec(req, peer(scope), mapi.model_name, mapi.tool_parser, mapi.tool_marker_special)
            ids: list[Any] = await api.service.lane(spec.model).preparer.token_ids(spec)
            return len(ids)

        n = await read_and_admit(api, scope, receive, send, send_error, count, "counting tokens")
        if n is not None:
            await send_json(send, 200, {"input_tokens": n})
