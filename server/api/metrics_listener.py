"""The `--metrics-port` listener: a second socket of the same server that serves GET /metrics alone.

Prometheus usually scrapes from inside the network without the API's keys; a separate bind lets an
operator expose the metrics there (or to a sidecar) while the API port stays behind keys. Requests
arriving on that port (the ASGI scope's `server` port) may reach /metrics only, anything else is
a 404; they are flagged so the AuthGuard asks for the metrics token there only when one is set
(server.gateway.auth). /metrics on the main port keeps its own rule (admin key or metrics token).
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional

from server.api.http_io import send_error
from server.gateway.auth import METRICS_LISTENER
from server.serving.errors import NotFound, PagewireError

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class MethodNotAllowed(PagewireError):
    status = 405
    code = "method_not_allowed"
    error_type = "invalid_request_error"


class MetricsListener:
    """ASGI middleware: on the metrics port, only GET /metrics passes (flagged for the AuthGuard)."""

    def __init__(self, app: ASGIApp, port: Optional[int]) -> None:
        self.app = app
        self.port = port

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        server = scope.get("server")
        if self.port is None or scope["type"] not in ("http", "websocket") or not server or server[1] != self.port:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope.get("path") != "/metrics":
            await send_error(send, NotFound(f"no route {scope.get('path')} on the metrics port (only GET /metrics)",
                                            code="route_not_found"))
            return
        if scope.get("method") not in ("GET", "HEAD"):
            await send_error(send, MethodNotAllowed("/metrics: only GET"))
            return
        scope[METRICS_LISTENER] = True
        await self.app(scope, receive, send)
