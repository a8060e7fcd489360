"""POST /v1/completions and /v1/chat/completions: parse, admit, then answer whole or as SSE.

The path of one HTTP request: read the body (413 beyond the limit) → msgspec Struct (400 naming
the field) → GenerationSpec(s) → `service.start` (ledger row committed) → only then the
response starts (`openai_responses`). While it runs, a DisconnectWatch turns a vanished client
into `service.detach`, which aborts the request in the engine at its next step (unless another
subscriber, such as an idempotent retry, still follows it).
"""
from __future__ import annotations

from typing import Any, Optional

from server.api import openai_responses as respond
from server.api.admission import read_and_admit
from server.api.context import ApiContext
from server.api.decode import decode
from server.api.http_io import Receive, Scope, Send, header, peer, send_error
from server.api.openai_format import chat_spec, completion_specs
from server.api.protocol import ChatCompletionRequest, CompletionRequest
from server.api.tools import ToolPlan, plan_request
from server.gateway.auth import bind, principal_of
from server.serving.idempotency import check_header_key
from server.serving.jobs import GenerationSpec
from server.serving.service import Admitted


class GenerateEndpoint:
    """One ASGI app per endpoint; `kind` is "completion" or "chat"."""

    def __init__(self, api: ApiContext, kind: str) -> None:
        self.api = api
        self.rt = api.rt
        self.kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def admit(body: bytes) -> tuple[list[GenerationSpec], list[Admitted], bool, bool, int,
                                              Optional[ToolPlan]]:
            specs, stream, include_usage, n, tools = self._parse(scope, body)
            return specs, await respond.admit_all(self.api, specs), stream, include_usage, n, tools

        got = await read_and_admit(self.api, scope, receive, send, send_error, admit)
        if got is None:
            return
        specs, admitted, stream, include_usage, n, tools = got
        api = self.api.for_model(specs[0].model)
        limits = api.limit_headers(specs[0].key_id, specs[0].model)
        if stream:
            await respond.stream(api, send, receive, self.kind, admitted, n, include_usage, tools, limits)
        else:
            await respond.whole(api, send, receive, self.kind, admitted, n, tools, limits)

    def _parse(self, scope: Scope, body: bytes) -> tuple[list[GenerationSpec], bool, bool, int, Optional[ToolPlan]]:
        idem = check_header_key(header(scope, b"idempotency-key"))
        if self.kind == "chat":
            req: Any = decode(body, ChatCompletionRequest)
        else:
            req = decode(body, CompletionRequest)
        api = self.api.for_model(req.model)
        tools: Optional[ToolPlan] = None
        if self.kind == "chat":
            tools = plan_request(req.tools, req.tool_choice, req.parallel_tool_calls, api.tool_parser,
                                 api.tool_marker_special)
            specs = [chat_spec(req, "http", peer(scope), api.model_name, idem, tools)]
        else:
            specs = completion_specs(req, "http", peer(scope), api.model_name, idem, respond.MAX_BATCH)
        who = principal_of(scope)
        for spec in specs:
            bind(spec, who)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return specs, req.stream, include_usage, req.n, tools
