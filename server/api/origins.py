"""Browser-origin safety: which web pages may drive this server, enforced on every HTTP request and
WebSocket upgrade, with proper CORS answers for the pages that may.

Why: a server on 127.0.0.1 is reachable from any page the user's browser opens. A "simple"
cross-origin request (a `text/plain` POST needs no preflight) runs before the browser decides
whether the page may read the answer, and WebSocket upgrades are not covered by CORS at all. So
the check is a refusal before the app runs, not merely a missing CORS header: any request that
carries an `Origin` the policy does not allow gets 403 (`origin_not_allowed`), and such a
WebSocket upgrade is refused (HTTP 403). Requests without `Origin` (curl, SDKs, servers) are not
browser requests and pass.

The policy (`--allowed-origins`, comma-separated; parsed by `server.serving.origin_policy`):
    loopback    pages served from localhost, *.localhost, 127.0.0.0/8 or [::1], any port (default)
    <origin>    an exact origin, e.g. https://app.example.com:8443
    *           any origin
    null        the opaque `null` origin (sandboxed frames, file:// pages); never implied by `*`
Same-origin requests are always allowed, but only when the Host is loopback or the bind address:
otherwise a DNS-rebinding page (evil.example resolving to 127.0.0.1) would be "same origin".

Starlette's CORSMiddleware answers preflights but lets a disallowed simple request run and does
not see WebSockets, which is the hole this closes, hence this small guard.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional

from server.api.error_shapes import payload_for
from server.api.http_io import send_json
from server.serving.errors import PagewireError
from server.serving.origin_policy import OriginPolicy

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

_ALLOW_METHODS = b"GET, POST, DELETE, OPTIONS"
_DEFAULT_ALLOW_HEADERS = b"content-type, authorization, idempotency-key"
_EXPOSE_HEADERS = b"x-request-id, retry-after"


class OriginNotAllowed(PagewireError):
    status = 403
    code = "origin_not_allowed"
    error_type = "permission_error"


def _header(scope: Scope, name: bytes) -> Optional[str]:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


class OriginGuard:
    """ASGI middleware enforcing an OriginPolicy (see the module docstring)."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        origin = _header(scope, b"origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        allowed = self.policy.allows(origin, _header(scope, b"host"))
        if scope["type"] == "websocket":
            if allowed:
                await self.app(scope, receive, send)
                return
            # Close before accepting: the server answers the upgrade with HTTP 403.
            msg = await receive()
            if msg["type"] == "websocket.connect":
                await send({"type": "websocket.close", "code": 1008})
            return
        if scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method") is not None:
            await self._preflight(scope, send, origin, allowed)
            return
        if not allowed:
            err = OriginNotAllowed(
                f"Origin: {origin} may not call this server; start it with --allowed-origins "
                f"including that origin to allow it", param="Origin")
            await send_json(send, err.status, payload_for(scope.get("path", ""), err), [(b"vary", b"origin")])
            return
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"origin"),
                (b"access-control-expose-headers", _EXPOSE_HEADERS)]

        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _preflight(self, scope: Scope, send: Any, origin: str, allowed: bool) -> None:
        if not allowed:
            # No CORS headers: the browser refuses the actual request.
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"vary", b"origin"), (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        requested = _header(scope, b"access-control-request-headers")
        headers = [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-allow-methods", _ALLOW_METHODS),
            (b"access-control-allow-headers", requested.encode("latin-1") if requested else _DEFAULT_ALLOW_HEADERS),
            (b"access-control-max-age", b"600"),
            (b"vary", b"origin"),
            (b"content-length", b"0"),
        ]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
