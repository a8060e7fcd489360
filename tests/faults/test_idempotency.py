"""Bug 4: an idempotency key names one request. Empty and overlong keys are 400 over HTTP (as over
WebSocket); the same key with another body or endpoint is 409 `idempotency_key_reused`, from
memory while the request lives and from the ledger's stored fingerprint after a restart."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from tests.server.harness import ServerProcess, WsClient, ledger_rows

BODY = {"model": "demo", "prompt": "Idempotent", "max_tokens": 6, "ignore_eos": True, "temperature": 0}


def _post(srv: ServerProcess, key: str, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(srv.base + path, json=body, headers={"Idempotency-Key": key}, timeout=120)


def _ws_generate(srv: ServerProcess, key: str, prompt: str) -> list[dict[str, Any]]:
    async def main() -> list[dict[str, Any]]:
        async with WsClient(srv.ws_url) as ws:
            got = await ws.run({"w": {"prompt": prompt, "idempotency_key": key,
                                      "params": {"max_tokens": 6, "ignore_eos": True, "temperature": 0}}})
            return got["w"]
    return asyncio.run(main())


def test_idempotency_keys_are_validated_and_never_shared_across_requests(demo_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "idem.db"
    with ServerProcess(demo_model, db) as srv:
        r = _post(srv, "", BODY)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "Idempotency-Key"
        r = _post(srv, "k" * 257, BODY)
        assert r.status_code == 400 and "256" in r.json()["error"]["message"]
        assert _post(srv, "k" * 256, BODY).status_code == 200
        assert ledger_rows(db) and all(row["idempotency_key"] == "k" * 256 for row in ledger_rows(db).values())

        first = _post(srv, "key-A", BODY)
        assert first.status_code == 200
        # The same request again, fields in another order: the original's output, no new row.
        again = _post(srv, "key-A", dict(reversed(list(BODY.items()))))
        assert again.status_code == 200 and again.headers["x-request-id"] == first.headers["x-request-id"]
        assert again.json()["choices"] == first.json()["choices"]
        # Another body under the same key: refused, never answered with key-A's output.
        other = _post(srv, "key-A", {**BODY, "prompt": "Something else"})
        assert other.status_code == 409, other.text
        assert other.json()["error"]["code"] == "idempotency_key_reused"
        assert other.json()["error"]["param"] == "Idempotency-Key"
        assert first.headers["x-request-id"] in other.json()["error"]["message"]
        # Another endpoint under the same key.
        chat = _post(srv, "key-A", {"model": "demo", "messages": [{"role": "user", "content": "Idempotent"}],
                                    "max_tokens": 6}, "/v1/chat/completions")
        assert chat.status_code == 409 and chat.json()["error"]["code"] == "idempotency_key_reused"
        ws = _ws_generate(srv, "key-A", "Idempotent")
        assert ws[-1]["type"] == "error" and ws[-1]["code"] == "idempotency_key_reused", ws
        # A live request's key is checked too (from memory, before its row is terminal).
        ws_first = _ws_generate(srv, "key-W", "socket prompt")
        assert ws_first[-1]["type"] == "done"
        assert _ws_generate(srv, "key-W", "socket prompt")[0]["request_id"] == ws_first[0]["request_id"]
        assert _ws_generate(srv, "key-W", "another prompt")[-1]["code"] == "idempotency_key_reused"
        n_rows = len(ledger_rows(db))

    # After a restart only the ledger remembers: the stored fingerprint decides.
    with ServerProcess(demo_model, db) as srv:
        assert _post(srv, "key-A", BODY).headers["x-request-id"] == first.headers["x-request-id"]
        r = _post(srv, "key-A", {**BODY, "max_tokens": 7})
        assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_key_reused"
        assert len(ledger_rows(db)) == n_rows
        hashes = [row["request_hash"] for row in ledger_rows(db).values()]
        assert all(h is not None and len(h) == 64 for h in hashes)


def test_a_v1_ledger_is_readable_by_the_cli_and_migrated_by_the_server(tmp_path: Path) -> None:
    import sqlite3

    from server.serving.ledger import Ledger
    from server.serving.ledger_sync import get_record, list_records, open_readonly
    from server.serving.schema import MIGRATIONS, SCHEMA_VERSION

    db = tmp_path / "v1.db"
    c = sqlite3.connect(db)
    c.executescript(MIGRATIONS[0] + "; CREATE TABLE schema_version (version INTEGER NOT NULL);"
                    "INSERT INTO schema_version VALUES (1);")
    c.execute("INSERT INTO requests (request_id, idempotency_key, kind, api, state, created_at) "
              "VALUES ('r1', 'old-key', 'completion', 'http', 'finished', 1.0)")
    c.commit()
    c.close()
    ro = open_readonly(db)
    try:
        assert [r.request_id for r in list_records(ro)] == ["r1"]
        rec = get_record(ro, "r1")
        assert rec is not None and rec.request_hash is None
    finally:
        ro.close()

    async def migrate() -> None:
        led = await Ledger.open(db)
        try:
            rec = await led.find_by_idempotency_key("old-key")
            assert rec is not None and rec.request_hash is None  # no fingerprint: accepted as before
        finally:
            await led.close()

    asyncio.run(migrate())
    c = sqlite3.connect(db)
    assert c.execute("SELECT version FROM schema_version").fetchone()[0] == SCHEMA_VERSION == len(MIGRATIONS)
    c.close()
