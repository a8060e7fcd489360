"""The ledger's rows as Python values, shared by both backends (`ledger`, `ledger_pg`): the
columns in the order every SELECT reads them, a read row (`RequestRecord`), what an accepted
request writes (`NewRequest`) and what its end writes (`Terminal`)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from server.serving.lifecycle import TERMINAL_STATES

COLUMNS = (
    "request_id, idempotency_key, kind, api, client, model, state, priority, params_json, "
    "prompt_json, created_at, admitted_at, first_token_at, finished_at, prompt_tokens, "
    "completion_tokens, cached_tokens, finish_reason, error, output_text, output_json, request_hash, key_id, "
    "reasoning_tokens, instance_id"
)


@dataclass
class RequestRecord:
    """One ledger row. `output` is the decoded `output_json` (per-sample text, tokens, seq marks)."""

    request_id: str
    idempotency_key: Optional[str]
    kind: str
    api: str
    client: Optional[str]
    model: Optional[str]
    state: str
    priority: int
    params: Optional[dict[str, Any]]
    prompt: Any
    created_at: float
    admitted_at: Optional[float]
    first_token_at: Optional[float]
    finished_at: Optional[float]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: Optional[str]
    error: Optional[str]
    output_text: Optional[str]
    output: Optional[dict[str, Any]]
    request_hash: Optional[str] = None
    key_id: Optional[str] = None  # the API key that owns the request (None: auth was off)
    reasoning_tokens: int = 0  # of completion_tokens, those of the model's thinking
    instance_id: Optional[str] = None  # the replica that accepted it (server.serving.ledger_pg)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> "RequestRecord":
        (rid, key, kind, api, client, model, state, prio, params, prompt, created, admitted,
         first, finished, ptok, ctok, cached, reason, error, text, output, request_hash, key_id,
         reasoning, instance_id) = row
        return cls(
            rid, key, kind, api, client, model, state, prio,
            json.loads(params) if params else None,
            json.loads(prompt) if prompt else None,
            created, admitted, first, finished, ptok, ctok, cached, reason, error, text,
            json.loads(output) if output else None,
            request_hash, key_id, reasoning or 0, instance_id,
        )


@dataclass
class NewRequest:
    """What is known when a request is accepted; written as a `queued` row."""

    request_id: str
    kind: str
    api: str
    client: Optional[str]
    model: Optional[str]
    priority: int
    params: dict[str, Any]
    prompt: Any
    prompt_tokens: int
    created_at: float
    idempotency_key: Optional[str] = None
    request_hash: Optional[str] = None  # fingerprint of the request, kept with an idempotency key
    key_id: Optional[str] = None  # the owning API key


@dataclass
class Terminal:
    """A request's final state, usage and output, written in one statement."""

    state: str
    finish_reason: Optional[str]
    error: Optional[str]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_text: Optional[str]
    output: dict[str, Any]
    first_token_at: Optional[float]
    finished_at: float
    reasoning_tokens: int = 0
