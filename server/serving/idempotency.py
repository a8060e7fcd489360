"""Idempotency keys: what a valid key is, and the fingerprint that ties a key to one request.

A key names one request for good. A retry with the same key and the same request gets the
original's output; the same key with a different body or endpoint is a client bug, answered 409
`idempotency_key_reused` (as Stripe does), never with another request's output. To tell them
apart, the ledger stores with each keyed row a SHA-256 of the canonical request: the endpoint
(api and kind) and everything the client sent that shapes the generation, serialised as JSON
with sorted keys, so field order and whitespace do not matter. How the answer is delivered
(`stream`, `stream_options`) is not part of it: a streamed retry of a whole request may replay it.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

from server.serving.errors import Conflict, InvalidRequest
from server.serving.jobs import GenerationSpec

MAX_KEY_LENGTH = 256  # the WebSocket frame's limit (protocol.IdemKey); HTTP enforces the same


def check_header_key(value: Optional[str], field: str = "Idempotency-Key") -> Optional[str]:
    """The key from an HTTP header or a WebSocket frame's `idempotency_key`, or None when absent.
    An empty, whitespace-only or overlong key is a 400 on both edges: an empty key is not "no
    key" (two clients sending one would share a request)."""
    if value is None:
        return None
    if not value.strip():
        raise InvalidRequest(f"{field}: must not be empty or only whitespace (omit it to send no key)",
                             param=field, code="invalid_idempotency_key")
    if len(value) > MAX_KEY_LENGTH:
        raise InvalidRequest(f"{field}: is {len(value)} characters; at most {MAX_KEY_LENGTH} are allowed",
                             param=field, code="invalid_idempotency_key")
    return value


# How the answer is sent, not what is computed: a retry may change them (an embedding's
# `encoding_format` is the same vector as float or base64).
_DELIVERY = ("stream", "stream_options", "encoding_format")


def _canonical(spec: GenerationSpec) -> dict[str, Any]:
    return {
        "endpoint": f"{spec.api}:{spec.kind}",
        "model": spec.model,
        "prompt": spec.prompt,
        "messages": spec.messages,
        "add_generation_prompt": spec.add_generation_prompt,
        "continue_final_message": spec.continue_final_message,
        "params": {k: v for k, v in spec.params_record.items() if k not in _DELIVERY},
        "sampling": spec.sampling,
        "max_tokens": spec.max_tokens,
        "priority": spec.priority,
        "detach": spec.detach,
        "timeout": spec.timeout_s,
    }


def fingerprint(spec: GenerationSpec) -> str:
    """SHA-256 (hex) of the canonical request."""
    text = json.dumps(_canonical(spec), sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def check_reuse(spec: GenerationSpec, stored: Optional[str], request_id: str) -> None:
    """Raise 409 when the key's original request differs from this one. Rows written before
    fingerprints existed (`stored` None) cannot be compared and are accepted as before."""
    if stored is None or stored == fingerprint(spec):
        return
    # The HTTP APIs (OpenAI's, Anthropic's, Ollama's) take the key as a header.
    field = "Idempotency-Key" if spec.api in ("http", "anthropic", "ollama") else "idempotency_key"
    err = Conflict(
        f"{field}: this key was already used for a different request ({request_id}) with another "
        "body or endpoint; use a new key for a new request", param=field, code="idempotency_key_reused")
    raise err
