"""The AuthGuard: the ASGI middleware that authenticates every request before any route runs.

Who a caller is, and which paths are open or admin-only, is the gateway's policy
(`server.gateway.auth`); this module only applies it at the edge: it records the caller in the
ASGI scope (`principal_of` reads it back) or answers the refusal itself.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Optional

from server.api.error_shapes import send_error_for
from server.gateway.auth import (
    ADMIN_PATHS,
    METRICS_LISTENER,
    METRICS_PATHS,
    OPEN_PATHS,
    SCOPE_KEY,
    Authenticator,
    credentials,
    ws_subprotocol,
)
from server.serving.errors import InvalidApiKey, PagewireError, PermissionDenied


class AuthGuard:
    """ASGI middleware: authenticates every request before any route runs.

    A refused WebSocket is accepted and then sent one `error` frame (`invalid_api_key`) and closed
    with 1008, because a browser shows nothing of an HTTP 401 on an upgrade.
    """

    def __init__(self, app: Any, auth: Callable[[], Optional[Authenticator]]) -> None:
        self.app = app
        self._auth = auth

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        auth = self._auth()
        if scope["type"] not in ("http", "websocket") or auth is None:
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if scope["type"] == "http" and (path in OPEN_PATHS or path == "/" or path.startswith("/ui/")):
            await self.app(scope, receive, send)
            return
        try:
            secret = credentials(scope)
            if scope.get(METRICS_LISTENER):
                # The --metrics-port listener (it lets /metrics alone through): open, or the
                # metrics token (or the admin key) once one is set.
                if auth.has_metrics_token and not (auth.is_metrics_token(secret) or auth.is_admin(secret)):
                    raise InvalidApiKey("/metrics on the metrics port needs the metrics token "
                                        "(--metrics-key-file) as `Authorization: Bearer <token>`")
                await self.app(scope, receive, send)
                return
            if path in METRICS_PATHS and auth.is_metrics_token(secret):
                await self.app(scope, receive, send)
                return
            who = auth.authenticate(secret)
            if path in ADMIN_PATHS and auth.required and not (who is not None and who.admin):
                raise PermissionDenied(f"{path} needs the admin key or the metrics token")
        except PagewireError as e:
            await self._refuse(scope, receive, send, e)
            return
        scope[SCOPE_KEY] = who
        await self.app(scope, receive, send)

    async def _refuse(self, scope: dict[str, Any], receive: Any, send: Any, e: PagewireError) -> None:
        if scope["type"] == "http":
            await send_error_for(scope.get("path", ""), send, e)  # in the shape of the API called
            return
        msg = await receive()
        if msg["type"] != "websocket.connect":
            return
        accept: dict[str, Any] = {"type": "websocket.accept"}
        sub = ws_subprotocol(scope)
        if sub is not None:
            accept["subprotocol"] = sub
        await send(accept)
        await send({"type": "websocket.send", "text": json.dumps(
            {"type": "error", "code": e.code, "status": e.status, "message": e.message})})
        await send({"type": "websocket.close", "code": 1008})
