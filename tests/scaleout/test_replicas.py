"""Two pagewire replicas (in-process servers) on one real PostgreSQL database: what holds across
them. Idempotency (one request, one output, decided by the unique constraint), every replica's
rows seen by GET /v1/requests/{id}, `pagewire requests` and `pagewire usage`, one key's TPM held
across both, resume of a stream that ended on the other replica (from the ledger) and of one still
running there (a clear error naming it), and a batch created on one replica seen on the other."""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from server.serving.db_url import parse_db
from tests.gateway.conftest import InProcessServer


def make_key(url: str, name: str, **limits: Any) -> tuple[str, str]:
    from server.gateway.cli import _open_for_keys
    from server.gateway.keys import KeyStore

    conn, _ = _open_for_keys(parse_db(url))
    try:
        key, secret = KeyStore(conn).create(name, **limits)
    finally:
        conn.close()
    return key.key_id, secret


@pytest.fixture
def replicas(demo_model: Path, pg_url: str) -> Iterator[Any]:
    servers: list[InProcessServer] = []

    def start(n: int = 2, **settings: Any) -> list[InProcessServer]:
        for _ in range(n):
            servers.append(InProcessServer(demo_model, pg_url, **settings).start())  # type: ignore[arg-type]
        return servers

    yield start
    for s in servers:
        s.stop()


def _cli(*argv: str) -> str:
    from server.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(argv)) == 0
    return out.getvalue()


def _complete(base: str, secret: str, key: str | None = None, max_tokens: int = 8, prompt: Any = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return httpx.post(base + "/v1/completions", headers=headers, timeout=120,
                      json={"model": "demo", "prompt": prompt or [1, 2, 3], "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True})


def test_idempotency_requests_and_usage_across_replicas(replicas: Any, pg_url: str) -> None:
    key_id, secret = make_key(pg_url, "app")
    a, b = replicas(2)

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": "demo", "prompt": [4, 5, 6], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            h = {"Authorization": f"Bearer {secret}", "Idempotency-Key": "same-key"}
            return list(await asyncio.gather(*[c.post(s.base + "/v1/completions", json=body, headers=h)
                                               for s in (a, b, a, b)]))
    rs = asyncio.run(both())
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    ids = {r.headers["x-request-id"] for r in rs}
    texts = {r.json()["choices"][0]["text"] for r in rs}
    assert len(ids) == 1 and len(texts) == 1  # one request, one output
    rid = ids.pop()
    # A later retry on either replica gets the same.
    assert _complete(b.base, secret, "same-key", prompt=[4, 5, 6]).headers["x-request-id"] == rid

    # Each replica's own request is visible from the other.
    ra = _complete(a.base, secret).headers["x-request-id"]
    rb = _complete(b.base, secret).headers["x-request-id"]
    for srv, other in ((a, rb), (b, ra)):
        g = httpx.get(f"{srv.base}/v1/requests/{other}", headers={"Authorization": f"Bearer {secret}"}, timeout=30)
        assert g.status_code == 200 and g.json()["state"] == "finished", g.text
    listed = [json.loads(ln) for ln in _cli("requests", "list", "--db", pg_url, "--json").splitlines()]
    assert {rid, ra, rb} == {r["request_id"] for r in listed}
    assert len({r.get("instance_id") for r in listed} | set()) >= 1
    usage = json.loads(_cli("usage", "--db", pg_url, "--format", "json"))
    assert usage == [{"key": key_id, "requests": 3, "prompt_tokens": 9, "completion_tokens": 24, "reasoning_tokens": 0,
                      "cached_tokens": usage[0]["cached_tokens"], "billable_tokens": 33}]
    day = json.loads(_cli("usage", "--db", pg_url, "--format", "json", "--group-by", "day"))
    assert len(day) == 1 and day[0]["requests"] == 3


def test_one_keys_tpm_holds_across_replicas(replicas: Any, pg_url: str) -> None:
    """Requests alternate between the replicas until the key's TPM refuses them: what was admitted
    in the minute never exceeds the limit by more than one request's reservation."""
    tpm, cost = 200, 3 + 20  # prompt 3 + max_tokens 20
    _, secret = make_key(pg_url, "tpm", tpm=tpm)
    a, b = replicas(2)
    admitted, refused = 0, []
    start = last_admitted = time.monotonic()
    for i in range(2 * tpm // cost):
        r = _complete((a, b)[i % 2].base, secret, max_tokens=20)
        if r.status_code == 200:
            admitted += 1
            last_admitted = time.monotonic()
        else:
            assert r.status_code == 429, r.text
            refused.append(r)
    assert refused, "the limit never refused a request"
    # Each admitted request cost all of its reservation (ignore_eos): the sum is bounded by the limit
    # plus what the bucket refilled (tpm/60 a second) while the admitted ones were being sent, which
    # a loaded host stretches to seconds (one such run admitted 10 × 23 against 200 + 23).
    refill = tpm * (last_admitted - start) / 60
    assert admitted * cost <= tpm + cost + refill, (admitted, refill)
    assert admitted * cost > tpm - 2 * cost  # and the limit was not far too strict either
    assert refused[0].json()["error"]["code"] == "rate_limit_exceeded"


def test_resume_on_another_replica(replicas: Any, pg_url: str) -> None:
    _, secret = make_key(pg_url, "ws")
    a, b = replicas(2)
    hdr = {"Authorization": f"Bearer {secret}"}

    async def main() -> None:
        from websockets.asyncio.client import connect

        async with connect(a.base.replace("http", "ws") + "/v1/ws", proxy=None, additional_headers=hdr) as wa:
            await wa.send(json.dumps({"type": "generate", "id": "g", "prompt": "long one", "detach": True,
                                      "params": {"max_tokens": 400, "ignore_eos": True, "temperature": 0}}))
            acc = json.loads(await asyncio.wait_for(wa.recv(), 120))
            assert acc["type"] == "accepted"
            rid = acc["request_id"]
            first = json.loads(await asyncio.wait_for(wa.recv(), 120))  # one delta: it is running on A
            assert first["type"] == "delta"
            # Running on A: B names A instead of replaying a partial row.
            async with connect(b.base.replace("http", "ws") + "/v1/ws", proxy=None, additional_headers=hdr) as wb:
                await wb.send(json.dumps({"type": "resume", "request_id": rid, "after_seq": 0, "id": "r"}))
                err = json.loads(await asyncio.wait_for(wb.recv(), 120))
                assert err["type"] == "error" and err["code"] == "request_running_elsewhere", err
                assert "127.0.0.1" in err["message"] and rid in err["message"]
            tokens: list[int] = list(first["token_ids"])
            while True:
                f = json.loads(await asyncio.wait_for(wa.recv(), 120))
                if f["type"] == "delta":
                    tokens.extend(f["token_ids"])
                if f["type"] == "done":
                    break
        # Ended on A: B replays it from the ledger, from any cursor, with no gap.
        async with connect(b.base.replace("http", "ws") + "/v1/ws", proxy=None, additional_headers=hdr) as wb:
            await wb.send(json.dumps({"type": "resume", "request_id": rid, "after_seq": 0, "id": "r"}))
            got: list[int] = []
            while True:
                f = json.loads(await asyncio.wait_for(wb.recv(), 120))
                if f["type"] == "delta":
                    got.extend(f["token_ids"])
                if f["type"] in ("done", "error"):
                    assert f["type"] == "done", f
                    break
        assert got == tokens and len(tokens) == 400
    asyncio.run(main())


def test_batch_created_on_one_replica_runs_once_seen_on_both(replicas: Any, pg_url: str) -> None:
    _, secret = make_key(pg_url, "batch")
    a, b = replicas(2)
    hdr = {"Authorization": f"Bearer {secret}"}
    lines = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "demo", "prompt": [1, 2, i + 3], "max_tokens": 4,
                                         "temperature": 0}}) + "\n" for i in range(12))
    up = httpx.post(a.base + "/v1/files", headers=hdr, timeout=60, data={"purpose": "batch"},
                    files={"file": ("in.jsonl", lines.encode(), "application/jsonl")})
    assert up.status_code == 200, up.text
    fid = up.json()["id"]
    assert httpx.get(f"{b.base}/v1/files/{fid}", headers=hdr, timeout=30).status_code == 200  # B sees A's file
    cr = httpx.post(a.base + "/v1/batches", headers=hdr, timeout=60,
                    json={"input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "24h"})
    assert cr.status_code == 200, cr.text
    bid = cr.json()["id"]
    assert a.rt is not None
    # Wait on A's manager: the batch ends when its last line is recorded, by either replica.
    while True:
        g = httpx.get(f"{b.base}/v1/batches/{bid}", headers=hdr, timeout=30).json()
        if g["status"] in ("completed", "failed", "cancelled"):
            break
        asyncio.run(asyncio.sleep(0.2))
    assert g["status"] == "completed" and g["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    out = httpx.get(f"{b.base}/v1/files/{g['output_file_id']}/content", headers=hdr, timeout=30).text
    cids = sorted(json.loads(ln)["custom_id"] for ln in out.splitlines())
    assert cids == sorted(f"c{i}" for i in range(12))
    # No line ran twice: one finished request row per line, with its line's idempotency key.
    import psycopg

    with psycopg.connect(pg_url) as c:
        rows = c.execute("SELECT idempotency_key, state FROM requests WHERE idempotency_key LIKE %s",
                         (f"%batch-{bid}-%",)).fetchall()
    assert len(rows) == 12 and all(s == "finished" for _, s in rows)
