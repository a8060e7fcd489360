"""The start every request-taking HTTP route shares: read the body, parse and admit it, and answer a
refusal in the route's own API's error shape.

Read (413 beyond the limit; a client gone mid-body ends it without an answer) → the route's `admit`
(its parse into GenerationSpecs, then `service.start`, which reserves the quota and commits the
ledger row) → on a PagewireError, a 429 counts in `pagewire_rejected_total` and the error is
answered through the API's `send_error` (OpenAI's, Anthropic's or Ollama's shape); anything else
is a bug or a broken ledger: logged, and still answered in that shape as a 500 `internal_error`.
OpenAI chat/completions, Responses, Anthropic Messages, Ollama chat/generate and both embeddings
routes go through here, so their refusals cannot drift apart.
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable, Optional, TypeVar

from server import heap
from server.api.context import ApiContext
from server.api.http_io import Receive, Scope, Send, read_body
from server.serving.errors import GenerationFailed, PagewireError

log = logging.getLogger("pagewire.http")

T = TypeVar("T")
# An API's error answer: writes `exc` with its status and retry headers in that API's shape.
SendError = Callable[[Send, PagewireError], Awaitable[None]]


async def refuse(api: ApiContext, send: Send, send_error: SendError, exc: Exception, what: str) -> None:
    """Answer `exc` in the API's shape: a PagewireError as itself (a 429 counted as a rejection),
    anything else as a logged 500 `internal_error`. `what` names the step in the log."""
    if isinstance(exc, PagewireError):
        if exc.status == 429:
            api.rt.metrics.rejected.labels(code=exc.code).inc()
        await send_error(send, exc)
        return
    log.error("%s failed", what, exc_info=exc)
    await send_error(send, GenerationFailed(f"internal error: {exc}", code="internal_error"))


async def read_and_admit(api: ApiContext, scope: Scope, receive: Receive, send: Send, send_error: SendError,
                         admit: Callable[[bytes], Awaitable[T]], what: str = "admitting a request") -> Optional[T]:
    """Read the body and run `admit` on it; its result, or None once the refusal was answered (or
    the client left while sending the body). `admit` must not return None itself."""
    try:
        body = await read_body(scope, receive, api.rt.settings.max_request_bytes)
    except PagewireError as e:
        await send_error(send, e)
        return None
    except ConnectionResetError:
        return None
    try:
        return await admit(body)
    except Exception as e:  # a refusal, or a bug / broken ledger: both answered in the API's shape
        await refuse(api, send, send_error, e, what)
        heap.release_frames(e)  # the body and its parse, held in cycles through the traceback
        return None
