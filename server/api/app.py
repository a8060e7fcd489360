"""The ASGI application: routes, the lifespan that starts and stops the Runtime, and the small
endpoints (/health, /v1/models, /tokenize, /detokenize, /metrics).

Routes, and where each request goes next:
    POST /v1/completions, /v1/chat/completions → server.api.openai_http → server.serving.service
    /v1/files, /v1/batches                     → server.gateway.http → server.gateway.batch → service
    WS   /v1/ws                                → server.api.ws          → server.serving.service
    GET  /v1/usage                             → server.gateway.usage (SQL over the ledger)
    GET  /v1/requests/{id}                     → server.gateway.requests_view (one ledger row, for its owner)
Every route passes the OriginGuard, then the AuthGuard (server.gateway.auth) first.
    GET  /, /ui/*                              → server.api.ui (the chat page; off with --no-ui)
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import time
from typing import Any, AsyncIterator, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute

from server.api.context import ApiContext
from server.api.decode import decode
from server.api.http_io import error_payload, retry_headers
from server.api.openai_format import messages_to_dicts
from server.api.openai_http import GenerateEndpoint
from server.api.origins import OriginGuard, OriginPolicy
from server.api.protocol import DetokenizeRequest, TokenizeRequest
from server.api.tools import check_tools
from server.api.ui import ui_routes
from server.api.ws import WsEndpoint
from server.api.ws_watchdog import CaptureTransport
from server.gateway.auth import AuthGuard, principal_of
from server.gateway.requests_view import request_route
from server.gateway.usage import usage_report
from server.serving.errors import InvalidRequest, NotFound, PagewireError, PermissionDenied, TooLarge, Unavailable
from server.serving.ledger_health import ledger_health
from server.serving.metrics import CONTENT_TYPE
from server.serving.prompts import render_chat
from server.serving.runtime import Runtime
from server.text.tokenizer import ChatTemplateError
from server.text.vocab import check_token_ids

log = logging.getLogger("pagewire")


def _error(exc: PagewireError) -> JSONResponse:
    return JSONResponse(error_payload(exc), status_code=exc.status,
                        headers={k.decode(): v.decode() for k, v in retry_headers(exc)})


def _epoch(text: Optional[str], name: str) -> Optional[float]:
    """A report bound: Unix seconds, or an ISO date/time (UTC when it names no zone)."""
    if text is None or text == "":
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise InvalidRequest(f"{name}: expected Unix seconds or an ISO date, got {text!r}", param=name) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=datetime.timezone.utc)
    return dt.timestamp()


def build_app(rt: Runtime) -> Starlette:
    """The app for one Runtime. The Runtime starts in the lifespan, before the socket accepts."""
    api = ApiContext(rt)
    from server.gateway.http import BatchGateway  # the batch tier (files, batches); see server/gateway

    gateway = BatchGateway(api)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await rt.start()
        if rt.tokenizer is not None:
            log.info("tool calls (tool_choice auto): parser %s (%s)", api.tool_parser,
                     "--tool-call-parser" if rt.settings.tool_call_parser != "auto" else "from the chat template")
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()
            await rt.close()

    async def body_of(request: Request, typ: Any) -> Any:
        limit = rt.settings.max_request_bytes
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise TooLarge(f"request body exceeds the limit of {limit} bytes")
        obj = decode(body, typ)
        api.check_model(getattr(obj, "model", None))
        return obj

    def load_of(rt: Any) -> dict[str, Any]:
        """What a router reads (server.serving.router_view): queue, running, free KV, prefix hits."""
        from server.serving.router_view import router_view

        return router_view(rt.bridge.stats() if rt.bridge is not None else None,
                           rt.admission.queued if rt.admission is not None else 0, rt.stopping,
                           rt.ledger.instance_id if rt.ledger is not None else None)

    async def health(request: Request) -> Response:
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
        return JSONResponse({"status": "ok", "model": rt.model_name, "ledger": ledger, "load": load_of(rt)})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": rt.model_name, "object": "model", "created": int(time.time()), "owned_by": "pagewire",
            "max_model_len": rt.bridge.max_model_len if rt.bridge and rt.bridge.ready else None,
            # The model's own sampling defaults (generation_config.json / GGUF metadata): what an
            # unset request field means here.
            "default_sampling_params": rt.sampling_defaults,
        }]})

    async def tokenize(request: Request) -> Response:
        try:
            req = await body_of(request, TokenizeRequest)
            tok = rt.tokenizer
            assert tok is not None
            if req.messages is not None:
                tools = check_tools(req.tools) if req.tools is not None else None
                try:
                    text = render_chat(tok, messages_to_dicts(req.messages), req.add_generation_prompt, tools,
                                       api.tool_parser)
                except ChatTemplateError as e:
                    raise InvalidRequest(f"messages: {e}", param="messages") from None
                ids = tok.encode(text, add_special_tokens=False)
            elif req.prompt is not None:
                ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            else:
                raise InvalidRequest("prompt: either prompt or messages is required", param="prompt")
        except PagewireError as e:
            return _error(e)
        max_len = rt.bridge.max_model_len if rt.bridge and rt.bridge.ready else None
        return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids})

    async def detokenize(request: Request) -> Response:
        try:
            req = await body_of(request, DetokenizeRequest)
            tok = rt.tokenizer
            assert tok is not None
            try:
                check_token_ids(req.tokens, tok.vocab_size, "tokens")
            except ValueError as e:
                raise InvalidRequest(str(e), param="tokens") from None
        except PagewireError as e:
            return _error(e)
        return JSONResponse({"prompt": tok.decode(req.tokens)})

    async def metrics(request: Request) -> Response:
        if rt.service is None:
            return _error(Unavailable("starting", code="starting"))
        return Response(rt.metrics.render(), media_type=CONTENT_TYPE)

    async def usage(request: Request) -> Response:
        """GET /v1/usage?start=&end=&group_by=key|model|day: the admin sees every key (or one,
        with `key`), a key only its own usage (server.gateway.usage)."""
        q = request.query_params
        try:
            start, end = _epoch(q.get("start"), "start"), _epoch(q.get("end"), "end")
            who = principal_of(request.scope)
            key = q.get("key")
            if who is not None and not who.admin:
                if key is not None and key != who.key_id:
                    raise PermissionDenied("key: only the admin key may read another key's usage", param="key")
                key = who.key_id
            assert rt.ledger is not None
            group_by = q.get("group_by", "key")
            data = await usage_report(rt.ledger, start, end, group_by, key)
        except PagewireError as e:
            return _error(e)
        return JSONResponse({"object": "usage", "group_by": group_by, "start": start, "end": end, "data": data})

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return _error(NotFound(f"no route {request.method} {request.url.path}", code="route_not_found"))
        err = PagewireError(str(exc.detail), code="method_not_allowed" if exc.status_code == 405 else "http_error")
        err.status = exc.status_code
        err.error_type = "invalid_request_error"
        return _error(err)

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/completions", GenerateEndpoint(api, "completion"), methods=["POST"]),
            Route("/v1/chat/completions", GenerateEndpoint(api, "chat"), methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/usage", usage, methods=["GET"]),
            Route("/v1/requests/{request_id}", request_route(lambda: rt.ledger), methods=["GET"]),
            *gateway.routes(),
            WebSocketRoute("/v1/ws", WsEndpoint(api)),
            *(ui_routes() if rt.settings.ui else []),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
        # Outermost: a page from a disallowed origin is refused before any route runs.
        # Then the AuthGuard: every route but /health and the page needs a key once auth is on.
        middleware=[Middleware(CaptureTransport),
                    Middleware(OriginGuard, policy=OriginPolicy.parse(rt.settings.allowed_origins, rt.settings.host)),
                    Middleware(AuthGuard, auth=lambda: rt.auth)],
    )
