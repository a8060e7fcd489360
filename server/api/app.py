"""The ASGI application: routes, the lifespan that starts and stops the Runtime, and the small
endpoints (/health, /v1/models, /tokenize, /detokenize, /metrics, /v1/usage: server.api.endpoints).

Routes, and where each request goes next:
    POST /v1/completions, /v1/chat/completions → server.api.openai_http → server.serving.service
    POST /v1/embeddings                        → server.api.embeddings_http → server.serving.service
    POST /v1/responses, GET|DELETE /v1/responses/{id} → server.api.responses_http → service
    POST /v1/messages[/count_tokens]           → server.api.anthropic_http → server.serving.service
    /api/chat, /api/generate, /api/tags, ...   → server.api.ollama_http    → server.serving.service
    /v1/files, /v1/batches                     → server.api.batch_http → server.serving.batch → service
    WS   /v1/ws                                → server.api.ws          → server.serving.service
    GET  /v1/usage                             → server.gateway.usage (SQL over the ledger)
    GET  /v1/requests/{id}                     → server.api.requests_view (one ledger row, for its owner)
Every route passes the OriginGuard, then the AuthGuard (server.api.auth_guard, applying server.gateway.auth) first.
    GET  /, /ui/*                              → server.api.ui (the chat page; off with --no-ui)
"""
from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute

from server.api.anthropic_http import CountTokensEndpoint, MessagesEndpoint
from server.api.auth_guard import AuthGuard
from server.api.batch_http import BatchRoutes
from server.api.context import ApiContext
from server.api.embeddings_http import EmbeddingsEndpoint
from server.api.endpoints import StatusEndpoints, TokenEndpoints, UsageEndpoint
from server.api.error_shapes import payload_for
from server.api.http_io import retry_headers
from server.api.metrics_listener import MetricsListener
from server.api.ollama_http import OllamaApi
from server.api.openai_http import GenerateEndpoint
from server.api.origins import OriginGuard, OriginPolicy
from server.api.requests_view import request_route
from server.api.responses_http import routes as responses_routes
from server.api.ui import ui_routes
from server.api.ws_endpoint import WsEndpoint
from server.api.ws_watchdog import CaptureTransport
from server.gateway.policy import Gateway
from server.serving.errors import NotFound, PagewireError
from server.serving.runtime import Runtime

log = logging.getLogger("pagewire")


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405, in the error shape of the API the path belongs to (Anthropic's,
    Ollama's or OpenAI's)."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err: PagewireError = NotFound(f"no route {request.method} {request.url.path}", code="route_not_found")
    else:
        err = PagewireError(str(exc.detail), code="method_not_allowed" if exc.status_code == 405 else "http_error")
        err.status = exc.status_code
        err.error_type = "invalid_request_error"
    return JSONResponse(payload_for(request.url.path, err), status_code=err.status,
                        headers={k.decode(): v.decode() for k, v in retry_headers(err)})


def build_app(rt: Runtime, gateway: Gateway, metrics_port: Optional[int] = None) -> Starlette:
    """The app for one Runtime and its Gateway (the Runtime's access policy). The Runtime, and
    with it the gateway, starts in the lifespan, before the socket accepts. `metrics_port`: the
    port of the --metrics-port listener, which serves /metrics alone."""
    api = ApiContext(rt, gateway)
    batches = BatchRoutes(api)  # the batch tier's routes (files, batches); see docs/batch.md
    status, tokens, usage = StatusEndpoints(api), TokenEndpoints(api), UsageEndpoint(api)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            await rt.start()
        except Exception as e:
            # A serving process exits with one line (server.serve); uvicorn would print the
            # traceback instead. Nothing else starts; the shutdown below closes what did.
            if not rt.start_failed(e):
                raise
            try:
                yield
            finally:
                await rt.close()
            return
        if rt.tokenizer is not None:
            log.info("tool calls (tool_choice auto): parser %s (%s)", api.tool_parser,
                     "--tool-call-parser" if rt.settings.tool_call_parser != "auto" else "from the chat template")
        await batches.start()
        try:
            yield
        finally:
            await batches.stop()
            await rt.close()

    return Starlette(
        routes=[
            Route("/health", status.health, methods=["GET"]),
            Route("/v1/models", status.models, methods=["GET"]),
            Route("/v1/completions", GenerateEndpoint(api, "completion"), methods=["POST"]),
            Route("/v1/chat/completions", GenerateEndpoint(api, "chat"), methods=["POST"]),
            Route("/v1/embeddings", EmbeddingsEndpoint(api), methods=["POST"]),
            Route("/v1/messages", MessagesEndpoint(api), methods=["POST"]),
            Route("/v1/messages/count_tokens", CountTokensEndpoint(api), methods=["POST"]),
            *responses_routes(api),
            *OllamaApi(api).routes(),
            Route("/tokenize", tokens.tokenize, methods=["POST"]),
            Route("/detokenize", tokens.detokenize, methods=["POST"]),
            Route("/metrics", status.metrics, methods=["GET"]),
            Route("/v1/usage", usage.usage, methods=["GET"]),
            Route("/v1/requests/{request_id}", request_route(lambda: rt.ledger), methods=["GET"]),
            *batches.routes(),
            WebSocketRoute("/v1/ws", WsEndpoint(api)),
            *(ui_routes() if rt.settings.ui else []),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
        # Outermost: a page from a disallowed origin is refused before any route runs.
        # Then the AuthGuard: every route but /health and the page needs a key once auth is on.
        middleware=[Middleware(CaptureTransport),
                    Middleware(MetricsListener, port=metrics_port),
                    Middleware(OriginGuard, policy=OriginPolicy.parse(rt.settings.allowed_origins, rt.settings.host)),
                    Middleware(AuthGuard, auth=lambda: gateway.auth)],
    )
