"""A network pause to the database at the worst moment: a request's row commits on PostgreSQL but
the acknowledgement never reaches pagewire. The deadline is honoured (the client gets 503
`ledger_unavailable` within the commit deadline, not a hang), and the ambiguous commit is
reconciled by the idempotency key: the client's retry with the same key gets one request and one
output, never two rows and never the orphan's silence."""
from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.gateway.conftest import InProcessServer
from tests.scaleout.netpause import PausingRelay
from tests.scaleout.postgres import PostgresServer


def test_ambiguous_commit_reconciled_by_idempotency_key(demo_model: Path, postgres: PostgresServer) -> None:
    import psycopg

    url = postgres.new_database()
    relay = PausingRelay(postgres.port)
    srv = InProcessServer(demo_model, relay.url(url.rsplit("/", 1)[1])).start()  # type: ignore[arg-type]
    try:
        body = {"model": "demo", "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0}
        h = {"Idempotency-Key": "k-ambiguous"}
        relay.armed.set()
        t0 = time.monotonic()
        first = httpx.post(srv.base + "/v1/completions", json=body, headers=h, timeout=120)
        took = time.monotonic() - t0
        assert relay.paused.is_set()  # the pause did hit a request row's commit
        assert first.status_code == 503 and first.json()["error"]["code"] == "ledger_unavailable", first.text
        assert srv.rt.ledger is not None
        assert took < srv.rt.ledger.commit_timeout_s + 10  # type: ignore[attr-defined]
        # The commit did land (PostgreSQL got COMMIT before the pause): an orphan row, queued.
        with psycopg.connect(url) as c:
            rows = c.execute("SELECT request_id, state FROM requests WHERE idempotency_key = %s",
                             ("k-ambiguous",)).fetchall()
        assert len(rows) == 1 and rows[0][1] == "queued", rows
        orphan = rows[0][0]
        # The retry with the same key: one request, one output.
        second = httpx.post(srv.base + "/v1/completions", json=body, headers=h, timeout=120)
        assert second.status_code == 200, second.text
        third = httpx.post(srv.base + "/v1/completions", json=body, headers=h, timeout=120)
        assert third.headers["x-request-id"] == second.headers["x-request-id"] != orphan
        assert third.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
        with psycopg.connect(url) as c:
            rows = c.execute("SELECT request_id, state, completion_tokens FROM requests WHERE idempotency_key = %s",
                             ("k-ambiguous",)).fetchall()
        assert rows == [(second.headers["x-request-id"], "finished", 6)]
    finally:
        srv.stop()
        relay.close()
