"""Stored responses (the Responses API's `store`), in the ledger's `responses` table (schema v6).

A stored response keeps the object the client got and its conversation (the messages before it
plus its own output as an assistant turn), which a later `previous_response_id` continues. It is
owned like a request: by the API key that made it (`key_id`), and another key's id reads as
unknown (404), so ids leak nothing; the admin key sees all. DELETE keeps the row (a tombstone
with the text removed), so the id is never reused and reads 404 from then on.

The row is committed before the client hears `response.completed` (or gets the whole response),
so a GET or a continuation right after the answer always finds it.
"""
from __future__ import annotations

import json
import time
from typing import Any, Optional

from server.gateway.auth import Principal
from server.serving.errors import NotFound
from server.serving.ledger import Ledger


def _not_found(response_id: str, field: str) -> NotFound:
    return NotFound(f"{field}: no stored response {response_id!r}", param=field, code="response_not_found")


async def save(ledger: Ledger, body: dict[str, Any], conversation: list[dict[str, Any]], request_id: str,
               key_id: Optional[str]) -> None:
    """Store (or, for an idempotent retry, store again) one response; returns once committed."""
    await ledger.execute(
        # The upsert both backends speak (SQLite >= 3.24, PostgreSQL), not SQLite's INSERT OR REPLACE.
        "INSERT INTO responses (response_id, request_id, key_id, previous_response_id, created_at, "
        "body_json, conversation_json) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (response_id) DO UPDATE SET "
        "request_id = excluded.request_id, key_id = excluded.key_id, "
        "previous_response_id = excluded.previous_response_id, created_at = excluded.created_at, "
        "body_json = excluded.body_json, conversation_json = excluded.conversation_json, deleted_at = NULL",
        (body["id"], request_id, key_id, body.get("previous_response_id"), float(body["created_at"]),
         json.dumps(body), json.dumps(conversation)))


async def _row(ledger: Ledger, response_id: str, who: Optional[Principal], field: str) -> tuple[Any, ...]:
    rows = await ledger.query(
        "SELECT key_id, body_json, conversation_json FROM responses WHERE response_id = ? AND deleted_at IS NULL",
        (response_id,))
    if not rows or (who is not None and not who.may_see(rows[0][0])):
        raise _not_found(response_id, field)
    return rows[0]


async def load(ledger: Ledger, response_id: str, who: Optional[Principal]) -> dict[str, Any]:
    """The stored response object (NotFound for an unknown, deleted or another key's id)."""
    return dict(json.loads((await _row(ledger, response_id, who, "response_id"))[1]))


async def conversation(ledger: Ledger, response_id: str, who: Optional[Principal]) -> list[dict[str, Any]]:
    """The conversation a `previous_response_id` continues (NotFound naming that field)."""
    return list(json.loads((await _row(ledger, response_id, who, "previous_response_id"))[2]))


async def delete(ledger: Ledger, response_id: str, who: Optional[Principal]) -> None:
    await _row(ledger, response_id, who, "response_id")
    await ledger.execute(
        "UPDATE responses SET deleted_at = ?, body_json = '{}', conversation_json = '[]' WHERE response_id = ?",
        (time.time(), response_id))
