"""The ASGI application: routes, the lifespan that starts and stops the Runtime, and the small
endpoints (/health, /v1/models, /tokenize, /detokenize, /metrics).

Routes, and where each request goes next:
    POST /v1/completions, /v1/chat/completions → server.api.openai_http → server.serving.service
    /v1/files, /v1/batches                     → server.gateway.http → server.gateway.batch → service
    WS   /v1/ws                                → server.api.ws          → server.serving.service
    GET  /, /ui/*                              → server.api.ui (the chat page; off with --no-ui)
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, AsyncIterator

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
from server.api.ui import ui_routes
from server.api.ws import WsEndpoint
from server.api.ws_watchdog import CaptureTransport
from server.serving.errors import InvalidRequest, NotFound, PagewireError, TooLarge, Unavailable
from server.serving.ledger_health import ledger_health
from server.serving.metrics import CONTENT_TYPE
from server.serving.runtime import Runtime
from server.text.tokenizer import ChatTemplateError
from server.text.vocab import check_token_ids


def _error(exc: PagewireError) -> JSONResponse:
    return JSONResponse(error_payload(exc), status_code=exc.status,
                        headers={k.decode(): v.decode() for k, v in retry_headers(exc)})


def build_app(rt: Runtime) -> Starlette:
    """The app for one Runtime. The Runtime starts in the lifespan, before the socket accepts."""
    api = ApiContext(rt)
    from server.gateway.http import BatchGateway  # the batch tier (files, batches); see server/gateway

    gateway = BatchGateway(api)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await rt.start()
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
        return JSONResponse({"status": "ok", "model": rt.model_name, "ledger": ledger})

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
                try:
                    text = tok.apply_chat_template(messages_to_dicts(req.messages),
                                                   add_generation_prompt=req.add_generation_prompt)
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
            *gateway.routes(),
            WebSocketRoute("/v1/ws", WsEndpoint(api)),
            *(ui_routes() if rt.settings.ui else []),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
        # Outermost: a page from a disallowed origin is refused before any route runs.
        middleware=[Middleware(CaptureTransport), Middleware(OriginGuard, policy=OriginPolicy.parse(rt.settings.allowed_origins,
                                                                       rt.settings.host))],
    )
