"""The small endpoints, one method each, importable and testable without a Starlette app:
/health, /v1/models and /metrics (`StatusEndpoints`), /tokenize and /detokenize
(`TokenEndpoints`), /v1/usage (`UsageEndpoint`). Each takes the `ApiContext` it answers for;
`server.api.app.build_app` puts them in the route table.
"""
from __future__ import annotations

import datetime
import math
import time
from typing import Any, Optional, TypeVar, cast

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

    def _models(self) -> dict[str, Any]:
        """Each served model's state (loaded, loading, unloaded; the load's stage), by name."""
        pool = self.rt.pool
        return {name: lane.describe() for name, lane in pool.lanes.items()} if pool is not None else {}

    async def health(self, request: Request) -> Response:
        rt = self.rt
        service = rt.service
        if rt.stopping:
            return JSONResponse({"status": "stopping"}, status_code=503)
        if service is None or not service.started:
            err = service.start_error if service is not None else None
            status: dict[str, Any] = {"status": "failed", "error": err} if err else {"status": "loading"}
            lane = rt.default_lane
            stage = lane.stage_text() if lane is not None else None
            if stage is not None:
                status["stage"] = stage  # what the load is doing (server.models.load_progress)
            return JSONResponse(status, status_code=503, headers={"retry-after": "2"})
        ledger = ledger_health(rt.ledger)
        if ledger["status"] != "ok":  # writes are failing: nothing new can be recorded
            return JSONResponse({"status": "degraded", "model": rt.model_name, "ledger": ledger}, status_code=503)
        # What a router reads (server.serving.router_view): queue, running, free KV, prefix hits.
        bridge = rt.bridge
        pool = rt.pool
        load = router_view(bridge.stats() if bridge is not None else None, pool.queued() if pool is not None else 0,
                           rt.stopping, rt.ledger.instance_id if rt.ledger is not None else None)
        body: dict[str, Any] = {"status": "ok", "model": rt.model_name, "ledger": ledger, "load": load}
        if pool is not None and len(pool.lanes) > 1:
            body["models"] = self._models()
            body["memory"] = {"budget_bytes": pool.budget, "used_bytes": pool.used}
        return JSONResponse(body)

    async def models(self, request: Request) -> Response:
        rt = self.rt
        pool = rt.pool
        created = int(time.time())
        if pool is None:  # not started: the declared models, none loaded yet
            return JSONResponse({"object": "list", "data": [
                {"id": e.name, "object": "model", "created": created, "owned_by": "pagewire", "max_model_len": None,
                 "default_sampling_params": {}, "state": "unloaded", "loaded": False} for e in rt.entries]})
        data = []
        for name in pool.names():
            route = pool.route(name)
            assert route is not None
            lane = route.lane
            entry: dict[str, Any] = {
                "id": name, "object": "model", "created": created, "owned_by": "pagewire",
                "max_model_len": lane.max_model_len if lane.ready else None,
                # The model's own sampling defaults (generation_config.json / GGUF metadata): what an
                # unset request field means here.
                "default_sampling_params": lane.sampling_defaults,
                # Loaded now, or loaded on demand by the first request that names it.
                "state": lane.state.value, "loaded": lane.ready,
            }
            if route.adapter is not None:
                entry["parent"] = lane.name
            data.append(entry)
        return JSONResponse({"object": "list", "data": data})

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
            if rt.service is None:
                raise Unavailable("server is starting", code="starting", retry_after_s=2)
            api = api.for_model(req.model)
            lane = rt.service.lane(req.model)
            tok = lane.tokenizer
            # Long texts are tokenised off the loop, within the same per-client budget as prompts.
            preparer = lane.preparer
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
        max_len = lane.max_model_len if lane.ready else None
        return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        try:
            req = await read_body(self.api, request, DetokenizeRequest)
            service = self.api.rt.service
            if service is None:
                raise Unavailable("server is starting", code="starting", retry_after_s=2)
            tok = service.lane(req.model).tokenizer
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
