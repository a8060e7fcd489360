"""Errors that cross from admission, the ledger and the streams to the network edge.

Each carries what both edges need: the HTTP status, a stable machine-readable `code`, the
offending request field (`param`) when there is one, and a retry hint for backpressure. The
HTTP edge renders them in OpenAI's error shape; the WebSocket edge as `error` frames.
`LedgerError` (an unusable database) is here too, below both the ledger and its lock
(server.serving.db_lock), which raise it.
"""
from __future__ import annotations

from typing import Optional


class PagewireError(Exception):
    """A request-level failure with everything an edge needs to report it.

    Args:
        message: human-readable; names the field and, for limits, gives the numbers.
        status: HTTP status code.
        code: stable machine-readable code (`invalid_request`, `overloaded`, ...).
        param: the request field at fault, if any.
        retry_after_s: for 429/503, how long the client should wait before retrying.
    """

    status: int = 500
    code: str = "internal_error"
    error_type: str = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: Optional[str] = None,
        code: Optional[str] = None,
        retry_after_s: Optional[float] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after_s = retry_after_s


class InvalidRequest(PagewireError):
    status = 400
    code = "invalid_request"
    error_type = "invalid_request_error"


class NotFound(PagewireError):
    status = 404
    code = "not_found"
    error_type = "not_found_error"


class TooLarge(PagewireError):
    status = 413
    code = "request_too_large"
    error_type = "invalid_request_error"


class Overloaded(PagewireError):
    status = 429
    code = "overloaded"
    error_type = "rate_limit_error"


class Unavailable(PagewireError):
    """Starting (weights still loading) or stopping (graceful shutdown in progress)."""

    status = 503
    code = "unavailable"
    error_type = "service_unavailable_error"


class DeadlineExceeded(PagewireError):
    status = 504
    code = "deadline_exceeded"
    error_type = "timeout_error"


class GenerationFailed(PagewireError):
    status = 500
    code = "generation_failed"
    error_type = "server_error"


class Conflict(PagewireError):
    """An idempotent retry of a request that ended without output (cancelled or interrupted)."""

    status = 409
    code = "conflict"
    error_type = "invalid_request_error"


class Interrupted(Conflict):
    """A request the server stopped (shutdown, crash) before it finished: the server's doing, so
    OpenAI's `server_error` type, not the client's `invalid_request_error`. Still 409 for an
    idempotent retry (the key names a request that can no longer produce its output)."""

    code = "request_interrupted"
    error_type = "server_error"


class InvalidApiKey(PagewireError):
    """A missing, wrong, revoked or expired API key (server.gateway.auth)."""

    status = 401
    code = "invalid_api_key"
    error_type = "invalid_request_error"


class PermissionDenied(PagewireError):
    """A valid key without the permission the route needs (e.g. admin-only routes)."""

    status = 403
    code = "permission_denied"
    error_type = "invalid_request_error"


class RateLimited(PagewireError):
    """429 with OpenAI's rate-limit headers (`headers`) and a retry hint (server.gateway.quotas raises it;
    the service and the batch tier catch it by type)."""

    status = 429
    code = "rate_limit_exceeded"
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, headers: dict[str, str], retry_after_s: Optional[float],
                 code: Optional[str] = None, param: Optional[str] = None) -> None:
        # param "model": the limit hit is the key's limit for the request's model, not key-wide.
        super().__init__(message, code=code, retry_after_s=retry_after_s, param=param)
        self.headers = headers


class LedgerError(RuntimeError):
    """The database is unusable (e.g. written by a newer pagewire), or another server holds it."""
