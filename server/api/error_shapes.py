"""Which API's error shape an HTTP error is written in, chosen by the route the client called.

Each API a client speaks answers errors in its own shape, also for refusals that happen before a
route runs (the AuthGuard's 401, the OriginGuard's 403, an unknown route's 404, a 405):
  - /v1/messages...  Anthropic's `{"type": "error", "error": {"type", "message"}}`;
  - /api/...         Ollama's `{"error": "message"}`;
  - anything else    OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

from typing import Any, Optional

from server.api.http_io import Send, error_payload, retry_headers, send_json
from server.serving.errors import PagewireError


def payload_for(path: str, exc: PagewireError) -> dict[str, Any]:
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        from server.api.anthropic_format import anthropic_error

        return anthropic_error(exc)
    if path.startswith("/api/"):
        from server.api.ollama_format import ollama_error

        return ollama_error(exc)
    return error_payload(exc)


async def send_error_for(path: str, send: Send, exc: PagewireError,
                         headers: Optional[list[tuple[bytes, bytes]]] = None) -> None:
    """Answer `exc` with its status, its retry headers and the body the route's API expects."""
    await send_json(send, exc.status, payload_for(path, exc), retry_headers(exc) + (headers or []))
