"""A real server (subprocess) with API keys: auth on every route and WebSocket, the secure
default, cross-key isolation of resume, idempotency and usage, live revocation, usage sums, and
secrets absent from the log."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.harness import FAST_ENGINE, ON_POSTGRES, REPO, ServerProcess, db_arg, free_port, ledger_rows

PROMPT = [1, 2, 3]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def _create(db: Path, name: str, *extra: str) -> tuple[str, str]:
    out = _cli("keys", "create", "--name", name, "--db", db_arg(db), "--json", *extra)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    return d["key_id"], d["secret"]


def _h(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def _ws(url: str, frames: list[dict[str, Any]], until: int, headers: Any = None,
              subprotocols: Any = None) -> tuple[list[dict[str, Any]], Any]:
    """Send frames, collect frames until `until` frames ended a request (done/error) or the close."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    got: list[dict[str, Any]] = []
    async with connect(url, proxy=None, additional_headers=headers, subprotocols=subprotocols,
                       close_timeout=1) as ws:
        ends = 0
        try:
            for f in frames:
                await ws.send(json.dumps(f))
        except ConnectionClosed:
            pass  # a refused socket may close before our first send; its error frame is still read below
        try:
            while ends < until:
                f = json.loads(await ws.recv())
                got.append(f)
                if f["type"] in ("done", "error"):
                    ends += 1
        except ConnectionClosed as e:
            return got, e.rcvd.code if e.rcvd else None
        return got, ws.subprotocol


def test_non_loopback_bind_without_keys_refuses_to_start(demo_model: Path, tmp_path: Path) -> None:
    cmd = ["serve", str(demo_model), "--host", "0.0.0.0", "--port", str(free_port()), "--db",
           str(tmp_path / "l.db"), *FAST_ENGINE]
    out = _cli(*cmd)
    assert out.returncode == 2 and "without authentication" in out.stderr and "--insecure-no-auth" in out.stderr
    out = _cli(*cmd, "--auth", "off")
    assert out.returncode == 2 and "loopback" in out.stderr


def test_keys_auth_ownership_usage_and_revocation(demo_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    a_id, a = _create(db, "alice")
    b_id, b = _create(db, "bob")
    admin_file = tmp_path / "admin.key"
    admin = "admin-" + "x" * 40
    admin_file.write_text(admin + "\n")
    srv = ServerProcess(demo_model, db, "--admin-key-file", str(admin_file), "--log-level", "debug",
                        "--stream-retention", "0.5")
    srv.start()
    try:
        base = srv.base
        # 401 on every API route without a key, in OpenAI's shape; /health stays open.
        assert httpx.get(base + "/health").status_code == 200
        for method, path, body in (("POST", "/v1/completions", {"prompt": "x"}), ("GET", "/v1/models", None),
                                   ("POST", "/tokenize", {"prompt": "x"}), ("GET", "/v1/usage", None)):
            r = httpx.request(method, base + path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
            r = httpx.request(method, base + path, json=body, headers=_h(a[:-2] + "zz"))
            assert r.status_code == 401, path
        # Admin endpoints: 403 for a key, 200 for the admin.
        r = httpx.get(base + "/metrics", headers=_h(a))
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
        assert httpx.get(base + "/metrics", headers=_h(admin)).status_code == 200
        # The batch tier is owned per key (tests/gateway/test_batch_ownership.py): a key lists only its own.
        assert httpx.get(base + "/v1/batches", headers=_h(a)).json()["data"] == []
        assert httpx.get(base + "/v1/batches", headers=_h(admin)).json()["object"] == "list"

        # The openai SDK with a key; the row records its key.
        c = openai.OpenAI(base_url=base + "/v1", api_key=a, max_retries=0)
        done = c.completions.create(model="demo", prompt=PROMPT, max_tokens=5)
        done_rid = done.id.removeprefix("cmpl-")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="sk-wrong", max_retries=0).completions.create(
                model="demo", prompt=PROMPT, max_tokens=5)

        # Idempotency keys are scoped per API key: bob's same key is a different request.
        body = {"model": "demo", "prompt": PROMPT, "max_tokens": 4}
        ra1 = httpx.post(base + "/v1/completions", json=body, headers={**_h(a), "Idempotency-Key": "same"})
        ra2 = httpx.post(base + "/v1/completions", json=body, headers={**_h(a), "Idempotency-Key": "same"})
        rb = httpx.post(base + "/v1/completions", json=body, headers={**_h(b), "Idempotency-Key": "same"})
        assert ra1.json()["id"] == ra2.json()["id"] != rb.json()["id"]

        # WebSocket: a key by header or by subprotocol; without one, an error frame and 1008.
        gen = {"type": "generate", "id": "g", "kind": "completion", "prompt": PROMPT,
               "params": {"max_tokens": 6, "ignore_eos": True}, "detach": True}
        frames, code = asyncio.run(_ws(srv.ws_url, [gen], 2))  # the error frame, then the close
        assert frames[0]["code"] == "invalid_api_key" and code == 1008
        frames, proto = asyncio.run(_ws(srv.ws_url, [gen], 1, subprotocols=["pagewire", f"pagewire-key.{a}"]))
        assert proto == "pagewire" and frames[-1]["type"] == "done"
        a_ws = frames[-1]["request_id"]
        frames, _ = asyncio.run(_ws(srv.ws_url, [gen], 1, headers=_h(b)))
        b_ws = frames[-1]["request_id"]

        # WebSocket idempotency keys are scoped per API key too.
        idem = {**gen, "idempotency_key": "ws-same"}
        fa1, _ = asyncio.run(_ws(srv.ws_url, [idem], 1, headers=_h(a)))
        fa2, _ = asyncio.run(_ws(srv.ws_url, [idem], 1, headers=_h(a)))
        fb, _ = asyncio.run(_ws(srv.ws_url, [idem], 1, headers=_h(b)))
        assert fa1[-1]["request_id"] == fa2[-1]["request_id"] != fb[-1]["request_id"]

        # Resume: another key gets the same 404 as an unknown id; the owner and the admin get it.
        for rid in (a_ws, done_rid):
            resume = {"type": "resume", "id": "r", "request_id": rid}
            frames, _ = asyncio.run(_ws(srv.ws_url, [resume], 1, headers=_h(b)))
            assert frames[-1]["type"] == "error" and frames[-1]["code"] == "request_not_found", frames
            nobody = "req-" + "0" * 24
            frames2, _ = asyncio.run(_ws(srv.ws_url, [{**resume, "request_id": nobody}], 1, headers=_h(b)))
            assert frames2[-1]["message"].replace(nobody, "ID") == frames[-1]["message"].replace(rid, "ID")
        frames, _ = asyncio.run(_ws(srv.ws_url, [{"type": "resume", "id": "r", "request_id": a_ws}], 1, headers=_h(a)))
        assert frames[-1]["type"] == "done"
        frames, _ = asyncio.run(_ws(srv.ws_url, [{"type": "resume", "id": "r", "request_id": b_ws}], 1,
                                    headers=_h(admin)))
        assert frames[-1]["type"] == "done"
        # GET /v1/requests/{id} (`requests show` over HTTP): the owner and the admin see the row;
        # another key gets, word for word, what an unknown id gets.
        for rid, owner_secret, owner_id in ((done_rid, a, a_id), (b_ws, b, b_id)):
            mine = httpx.get(f"{base}/v1/requests/{rid}", headers=_h(owner_secret))
            assert mine.status_code == 200 and mine.json()["key_id"] == owner_id, mine.text
            assert mine.json()["state"] == "finished" and mine.json()["completion_tokens"] > 0
            assert httpx.get(f"{base}/v1/requests/{rid}", headers=_h(admin)).json() == mine.json()
            other = httpx.get(f"{base}/v1/requests/{rid}", headers=_h(b if owner_secret == a else a))
            nobody = "req-" + "1" * 24
            unknown = httpx.get(f"{base}/v1/requests/{nobody}", headers=_h(a))
            assert other.status_code == unknown.status_code == 404
            assert other.json()["error"]["message"].replace(rid, "ID") == \
                unknown.json()["error"]["message"].replace(nobody, "ID")
        assert httpx.get(f"{base}/v1/requests/{done_rid}").status_code == 401
        # Cancel is per connection: bob cannot name alice's request on his socket.
        frames, _ = asyncio.run(_ws(srv.ws_url, [{"type": "cancel", "id": "g"}], 1, headers=_h(b)))
        assert frames[-1]["code"] == "request_not_found"

        # Usage: each key sees its own; the admin sees all; sums equal the per-request rows.
        rows = ledger_rows(db)
        assert {r["key_id"] for r in rows.values()} == {a_id, b_id}
        assert rows[done_rid]["key_id"] == a_id

        def billable(r: dict[str, Any]) -> int:
            return 0 if r["admitted_at"] is None else r["prompt_tokens"] + r["completion_tokens"]

        ua = httpx.get(base + "/v1/usage", headers=_h(a)).json()["data"]
        assert [u["key"] for u in ua] == [a_id]
        assert ua[0]["billable_tokens"] == sum(billable(r) for r in rows.values() if r["key_id"] == a_id)
        assert ua[0]["requests"] == sum(1 for r in rows.values() if r["key_id"] == a_id)
        assert httpx.get(base + "/v1/usage", params={"key": b_id}, headers=_h(a)).status_code == 403
        allk = httpx.get(base + "/v1/usage", params={"group_by": "key"}, headers=_h(admin)).json()["data"]
        assert {u["key"] for u in allk} == {a_id, b_id}
        assert sum(u["billable_tokens"] for u in allk) == sum(billable(r) for r in rows.values())
        assert sum(u["completion_tokens"] for u in allk) == sum(r["completion_tokens"] for r in rows.values())
        by_model = httpx.get(base + "/v1/usage", params={"group_by": "model"}, headers=_h(admin)).json()["data"]
        assert [u["model"] for u in by_model] == ["demo"]
        assert httpx.get(base + "/v1/usage", params={"group_by": "x"}, headers=_h(admin)).status_code == 400
        cli = _cli("usage", "--db", db_arg(db), "--format", "json", "--group-by", "key")
        assert cli.returncode == 0 and json.loads(cli.stdout) == allk
        table = _cli("usage", "--db", db_arg(db), "--format", "table").stdout.splitlines()
        assert table[0].split()[:2] == ["KEY", "REQUESTS"] and {ln.split()[0] for ln in table[1:]} == {a_id, b_id}
        csv_out = _cli("usage", "--db", db_arg(db), "--format", "csv", "--key", a_id)
        assert csv_out.stdout.splitlines()[1].startswith(f"{a_id},{ua[0]['requests']},")

        # `pagewire requests list --key` (the operator's view, from the file) lists one key's rows.
        listed = _cli("requests", "list", "--db", db_arg(db), "--key", a_id, "--json", "--limit", "1000")
        assert listed.returncode == 0, listed.stderr
        mine_ids = {json.loads(ln)["request_id"] for ln in listed.stdout.splitlines()}
        assert mine_ids == {rid for rid, r in rows.items() if r["key_id"] == a_id}
        shown = json.loads(_cli("requests", "show", done_rid, "--db", db_arg(db)).stdout)
        assert shown["key_id"] == a_id and shown["request_id"] == done_rid

        # Prometheus: per-key counters, labelled by key id.
        prom = httpx.get(base + "/metrics", headers=_h(admin)).text
        n_a = sum(1 for r in rows.values() if r["key_id"] == a_id)
        assert f'pagewire_key_requests_total{{key="{a_id}"}} {float(n_a)}' in prom

        # Revoking with the CLI while the server runs (it holds the lock) takes effect at once on
        # SQLite; a PostgreSQL replica polls the keys every Gateway.KEYS_POLL_S (docs/scale-out.md),
        # so there the check waits for the revocation to land, within a bound.
        out = _cli("keys", "revoke", b_id, "--db", db_arg(db))
        assert out.returncode == 0, out.stderr
        r = httpx.post(base + "/v1/completions", json=body, headers=_h(b))
        deadline = time.monotonic() + 30
        while ON_POSTGRES and r.status_code == 200 and time.monotonic() < deadline:
            r = httpx.post(base + "/v1/completions", json=body, headers=_h(b))
        assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]
    finally:
        srv.stop()
    log = srv.read_log() + srv.log_path.read_text(errors="replace")
    assert a_id in _cli("keys", "list", "--db", db_arg(db)).stdout
    for secret in (a, b, admin):
        assert secret not in log and secret.split(".")[-1] not in log
