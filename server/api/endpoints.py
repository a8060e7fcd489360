"""The small endpoints, one method each, importable and testable without a Starlette app:
/health, /v1/models and /metrics (`StatusEndpoints`), /tokenize and /detokenize
(`TokenEndpoints`), /v1/usage (`UsageEndpoint`). Each takes the `ApiContext` it answers for;
`server.api.app.build_app` puts them in the route table.
"""
from __future__ import annotations

import datetime
import math
import time
from typing import Optional, TypeVar, cast

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from server.api.context import ApiContext
from server.api.decode import decode
from server.api.http_io import Scope, error_payload, retry_headers
from server.api.http_io import read_body as read_whole_body
from server.api.openai_format import check_continuation, messages_to_dicts
from server.api.protocol import DetokenizeRequest, TokenizeRequest
from server.api.tools import check_tools
from server.gateway.auth import principal_of
from server.gateway.usage import usage_report
from server.serving.errors import InvalidRequest, PagewireError, PermissionDenied, Unavailable
from server.serving.ledger_health import ledger_health
from server.serving.metrics import CONTENT_TYPE
from server.serving.prompts import check_template_kwargs, render_chat
from server.serving.router_view import router_view
from server.text.tokenizer import ChatTemplateError
from server.text.vocab import check_token_ids

T = TypeVar("T")


def error_response(exc: PagewireError) -> JSONResponse:
    """An error in OpenAI's shape, with its retry headers."""
    return JSONResponse(error_payload(exc), status_code=exc.status,
                        headers={k.decode(): v.decode() for k, v in retry_headers(exc)})


async def read_body(api: ApiContext, request: Request, typ: type[T]) -> T:
    """The request body decoded as `typ` (field-naming 400s), within the body limit (413), and
    naming the served model if it names one (404)."""
    # http_io's reader: one join at the end. Appending each chunk to a bytes object copied the
    # body so far every time (quadratic: 0.4 s of loop time for one 7.5 MB /tokenize body here).
    try:
        # Starlette types the scope as a MutableMapping; the ASGI server hands it a dict.
        body = await read_whole_body(cast(Scope, request.scope), request.receive, api.rt.settings.max_request_bytes)
    except ConnectionResetError:
        raise ClientDisconnect() from None
    obj = decode(body, typ)
    api.check_model(getattr(obj, "model", None))
    return obj


def report_bound(text: Optional[str], name: str) -> Optional[float]:
    """A report bound: Unix seconds, or an ISO date/time (UTC when it names no zone)."""
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        # float() takes "nan", "inf" and "1e309" (which overflows to inf); none is a time, and
        # a non-finite bound would reach the JSON answer, which cannot hold it.
        if not math.isfinite(value):
            raise InvalidRequest(f"{name}: must be a finite number of Unix seconds, got {text!r}", param=name)
        return value
    try:
        dt = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise InvalidRequest(f"{name}: expected Unix seconds or an ISO date, got {text!r}", param=name) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=datetime.timezone.utc)
    return dt.timestamp()


class StatusEndpoints:
    """/health (readiness: loading, failed, degraded ledger, stopping), /v1/models, /metrics."""

    def __init__(self, api: ApiContext) -> None:
        self.rt = api.rt

    async def health(self, request: Request) -> Response:
        rt = self.rt
        bridge = rt.bridge
        if rt.stopping:
            return JSONResponse({"status": "stopping"}, status_code=503)
        if bridge is None or not bridge.ready:
            err = bridge.error if bridge is not None else None
            status = {"status": "failed", "error": str(err)} if err else {"status": "loading"}
            return JSONResponse(status, status_code=503, headers={"retry-after": "2"})
        ledger = ledger_health(rt.ledger)
        if ledger["status"] != "ok":  # writes are failing: nothing new can be recorded
            return JSONResponse({"status": "degraded", "model": rt.model_name, "ledger": ledger}, status_code=503)
        # What a router reads (server.serving.router_view): queue, running, free KV, prefix hits.
        load = router_view(bridge.stats(), rt.admission.queued if rt.admission is not None else 0, rt.stopping,
                           rt.ledger.instance_id if rt.ledger is not None else None)
        return JSONResponse({"status": "ok", "model": rt.model_name, "ledger": ledger, "load": load})

    async def models(self, request: Request) -> Response:
        rt = self.rt
        return JSONResponse({"object": "list", "data": [{
            "id": rt.model_name, "object": "model", "created": int(time.time()), "owned_by": "pagewire",
            "max_model_len": rt.bridge.max_model_len if rt.bridge and rt.bridge.ready else None,
            # The model's own sampling defaults (generation_config.json / GGUF metadata): what an
            # unset request field means here.
            "default_sampling_params": rt.sampling_defaults,
        }] + [{
            # A LoRA adapter (--lora), listed as vLLM lists one: its base model is its parent.
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "pagewire", "parent": parent,
            "max_model_len": rt.bridge.max_model_len if rt.bridge and rt.bridge.ready else None,
            "default_sampling_params": rt.sampling_defaults,
        } for name, parent in rt.names.all() if parent is not None]})

    async def metrics(self, request: Request) -> Response:
        if self.rt.service is None:
            return error_response(Unavailable("starting", code="starting"))
        return Response(self.rt.metrics.render(), media_type=CONTENT_TYPE)


class TokenEndpoints:
    """/tokenize (a prompt, or messages through the chat template with tools) and /detokenize."""

    def __init__(self, api: ApiContext) -> None:
        self.api = api

    async def tokenize(self, request: Request) -> Response:
        api, rt = self.api, self.api.rt
        try:
            req = await read_body(api, request, TokenizeRequest)
            tok = rt.tokenizer
            if tok is None or rt.service is None:
                raise Unavailable("server is starting", code="starting", retry_after_s=2)
            # Long texts are tokenised off the loop, within the same per-client budget as prompts.
            preparer = rt.service.preparer
            who = principal_of(request.scope)
            client = who.key_id if who is not None else (request.client.host if request.client else "unknown")
            if req.messages is not None:
                tools = check_tools(req.tools) if req.tools is not None else None
                try:
                    check_continuation(req.continue_final_message, req.add_generation_prompt, req.messages)
                    text = render_chat(tok, messages_to_dicts(req.messages), req.add_generation_prompt, tools,
                                       api.tool_parser, check_template_kwargs(req.chat_template_kwargs),
                                       req.continue_final_message)
                except ChatTemplateError as e:
                    raise InvalidRequest(f"messages: {e}", param="messages") from None
                ids = await preparer.encode_text(text, client, add_special_tokens=False)
            elif req.prompt is not None:
                ids = await preparer.encode_text(req.prompt, client, add_special_tokens=req.add_special_tokens)
            else:
                raise InvalidRequest("prompt: either prompt or messages is required", param="prompt")
        except PagewireError as e:
            return error_response(e)
        max_len = rt.bridge.max_model_len if rt.bridge and rt.bridge.ready else None
        return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        try:
            req = await read_body(self.api, request, DetokenizeRequest)
            tok = self.api.rt.tokenizer
            if tok is None:
                raise Unavailable("server is starting", code="starting", retry_after_s=2)
            try:
                check_token_ids(req.tokens, tok.vocab_size, "tokens")
            except ValueError as e:
                raise InvalidRequest(str(e), param="tokens") from None
        except PagewireError as e:
            return error_response(e)
        return JSONResponse({"prompt": tok.decode(req.tokens)})


class UsageEndpoint:
    """GET /v1/usage?start=&end=&group_by=key|model|day: the admin sees every key (or one, with
    `key`), a key only its own usage (server.gateway.usage)."""

    def __init__(self, api: ApiContext) -> None:
        self.rt = api.rt

    async def usage(self, request: Request) -> Response:
        q = request.query_params
        try:
            start, end = report_bound(q.get("start"), "start"), report_bound(q.get("end"), "end")
            who = principal_of(request.scope)
            key = q.get("key")
            if who is not None and not who.admin:
                if key is not None and key != who.key_id:
                    raise PermissionDenied("key: only the admin key may read another key's usage", param="key")
                key = who.key_id
            if self.rt.ledger is None:
                raise Unavailable("server is starting", code="starting", retry_after_s=2)
            group_by = q.get("group_by", "key")
            data = await usage_report(self.rt.ledger, start, end, group_by, key)
        except PagewireError as e:
            return error_response(e)
        return JSONResponse({"object": "usage", "group_by": group_by, "start": start, "end": end, "data": data})
