"""`GET /v1/requests/{request_id}`: what the ledger recorded about one request, for its owner.

The HTTP face of `pagewire requests show` (which reads the ledger file as an operator): the same
JSON (`record_json`), from the server's ledger reader. Ownership as for resume and idempotent
retries: a key sees only its own requests, and another key's id gets the 404 an unknown id gets,
word for word, so ids leak nothing; the admin key (and everyone when authentication is off) sees
every request. What the row holds of the prompt and output follows `--ledger-text`.
"""
from __future__ import annotations

from typing import Any, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.http_io import error_payload
from server.gateway.auth import Principal, principal_of
from server.serving.errors import NotFound, PagewireError, Unavailable
from server.serving.ledger import Ledger, RequestRecord


def record_summary(r: RequestRecord) -> dict[str, Any]:
    """A row's state, usage and timings (one line of `pagewire requests list --json`)."""
    return {
        "request_id": r.request_id, "state": r.state, "kind": r.kind, "api": r.api, "client": r.client,
        "model": r.model, "key_id": r.key_id, "priority": r.priority, "idempotency_key": r.idempotency_key,
        "created_at": r.created_at, "admitted_at": r.admitted_at, "first_token_at": r.first_token_at,
        "finished_at": r.finished_at, "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens, "cached_tokens": r.cached_tokens,
        "reasoning_tokens": r.reasoning_tokens,
        "finish_reason": r.finish_reason, "error": r.error,
    }


def record_json(r: RequestRecord) -> dict[str, Any]:
    """Everything recorded about a request (`requests show`, `GET /v1/requests/{id}`)."""
    return {"object": "request", **record_summary(r), "params": r.params, "prompt": r.prompt,
            "output_text": r.output_text}


async def visible_record(ledger: Ledger, request_id: str, who: Optional[Principal]) -> RequestRecord:
    """The row, if `who` may see it (None: authentication is off); else the unknown id's 404."""
    rec = await ledger.get(request_id)
    if rec is None or (who is not None and not who.may_see(rec.key_id)):
        raise NotFound(f"request_id: no request {request_id!r}", param="request_id", code="request_not_found")
    return rec


def request_route(ledger_of: Any) -> Any:
    """The route handler; `ledger_of()` gives the running server's ledger (None while starting)."""

    async def show(request: Request) -> Response:
        try:
            ledger: Optional[Ledger] = ledger_of()
            if ledger is None:
                raise Unavailable("server is starting", code="starting", retry_after_s=2)
            rec = await visible_record(ledger, request.path_params["request_id"], principal_of(request.scope))
        except PagewireError as e:
            return JSONResponse(error_payload(e), status_code=e.status)
        return JSONResponse(record_json(rec))

    return show
