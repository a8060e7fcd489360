"""The daily quota survives a SIGKILL: a request cut off mid-generation counts the tokens it had
emitted (written to its row as it ran), and the restarted server reads the day's usage back from
the ledger, refusing exactly what would exceed the quota."""
from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from tests.gateway.test_isolation_live import PROMPT, _create, _h
from tests.server.harness import ON_POSTGRES, ServerProcess, ledger_query, ledger_rows

DAILY = 1900


def _completion_tokens(db: Path, rid: str) -> int:
    rows = ledger_query(db, "SELECT completion_tokens FROM requests WHERE request_id = ?", (rid,))
    return int(rows[0][0]) if rows else 0


async def _start_detached(url: str, secret: str, db: Path) -> str:
    """Start a long request and return once its row records at least 16 emitted tokens."""
    from websockets.asyncio.client import connect

    async with connect(url, proxy=None, additional_headers=_h(secret), close_timeout=1) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "long", "kind": "completion", "prompt": PROMPT,
                                  "detach": True, "params": {"max_tokens": 1800, "ignore_eos": True}}))
        rid = ""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            f: dict[str, Any] = json.loads(await ws.recv())
            if f["type"] == "accepted":
                rid = f["request_id"]
            assert f["type"] in ("accepted", "delta"), f
            # The progress write is fire-and-forget; each delta is a chance to see it landed.
            if f["type"] == "delta" and _completion_tokens(db, rid) >= 16:
                return rid
        raise AssertionError("no progress recorded")


def test_daily_quota_counts_an_interrupted_request_across_sigkill(demo_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    key_id, secret = _create(db, "daily", "--daily-tokens", str(DAILY))
    srv = ServerProcess(demo_model, db).start()
    try:
        small = httpx.post(srv.base + "/v1/completions", headers=_h(secret), timeout=120,
                           json={"model": "demo", "prompt": PROMPT, "max_tokens": 7, "ignore_eos": True})
        assert small.status_code == 200, small.text
        rid = asyncio.run(_start_detached(srv.ws_url, secret, db))
        srv.signal(signal.SIGKILL)
        srv.wait(30)
    finally:
        srv.stop()
    srv2 = ServerProcess(demo_model, db).start()
    try:
        row = ledger_rows(db)[rid]
        # On SQLite the restart interrupts the dead process's rows at open; a PostgreSQL replica
        # sweeps another's rows only once that replica's lease has lapsed (--instance-lease, 10 s),
        # so there the check waits for the sweep, within a bound.
        deadline = time.monotonic() + 120
        while ON_POSTGRES and row["state"] == "running" and time.monotonic() < deadline:
            time.sleep(0.2)
            row = ledger_rows(db)[rid]
        assert row["state"] == "interrupted" and row["completion_tokens"] >= 16
        used = 10 + 3 + row["completion_tokens"]
        usage = httpx.get(srv2.base + "/v1/usage", headers=_h(secret)).json()["data"]
        assert usage[0]["billable_tokens"] == used
        left = DAILY - used
        over = httpx.post(srv2.base + "/v1/completions", headers=_h(secret), timeout=120,
                          json={"model": "demo", "prompt": PROMPT, "max_tokens": left - 3 + 1})
        assert over.status_code == 429, over.text
        err = over.json()["error"]
        assert err["code"] == "daily_quota_exceeded" and f"{left} of {DAILY}" in err["message"]
        assert over.headers["x-ratelimit-remaining-tokens-day"] == str(left) and int(over.headers["retry-after"]) > 0
        fits = httpx.post(srv2.base + "/v1/completions", headers=_h(secret), timeout=300,
                          json={"model": "demo", "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True})
        assert fits.status_code == 200, fits.text
        # Its reservation was settled to 5 tokens; the rest of the day's quota is free again.
        again = httpx.post(srv2.base + "/v1/completions", headers=_h(secret), timeout=120,
                           json={"model": "demo", "prompt": PROMPT, "max_tokens": left - 5 - 3 + 1})
        assert again.status_code == 429 and f"{left - 5} of {DAILY}" in again.json()["error"]["message"]
    finally:
        srv2.stop()


def test_tpm_bucket_survives_sigkill(demo_model: Path, tmp_path: Path) -> None:
    """A restart after a SIGKILL does not hand a key a fresh minute: its TPM bucket is rebuilt from
    the ledger's last minute, each request refilled in proportion to its age."""
    db = tmp_path / "l.db"
    tpm = 1000
    key_id, secret = _create(db, "tpm", "--tpm", str(tpm))
    srv = ServerProcess(demo_model, db).start()
    try:
        sent = time.monotonic()
        big = httpx.post(srv.base + "/v1/completions", headers=_h(secret), timeout=300,
                         json={"model": "demo", "prompt": PROMPT, "max_tokens": 797, "ignore_eos": True})
        took = time.monotonic() - sent
        assert big.status_code == 200, big.text
        # The 800-token reservation leaves 200; the header is read a moment after the reservation,
        # and the bucket refills tpm/60 tokens a second meanwhile (a loaded host took > 60 ms: 201).
        left = int(big.headers["x-ratelimit-remaining-tokens"])
        assert tpm - 800 <= left <= tpm - 800 + tpm * took / 60, (left, took)
        srv.signal(signal.SIGKILL)
        srv.wait(30)
    finally:
        srv.stop()
    created = next(r["created_at"] for r in ledger_rows(db).values() if r["key_id"] == key_id)
    srv2 = ServerProcess(demo_model, db).start()
    try:
        small = httpx.post(srv2.base + "/v1/completions", headers=_h(secret), timeout=120,
                           json={"model": "demo", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True})
        age = time.time() - created  # an upper bound on the big request's age when the bucket was read
    finally:
        srv2.stop()
    assert small.status_code == 200, small.text
    # What is left can be no more than a bucket that has been refilling (tpm / 60 per second) for
    # `age` seconds since the 800 tokens were taken, less this request's 8; a fresh bucket (what a
    # restart that forgot the minute would give) says tpm - 8.
    bound = min(tpm, tpm - 800 + age * tpm / 60.0) - 8
    assert int(small.headers["x-ratelimit-remaining-tokens"]) <= bound + 1, (age, bound)
