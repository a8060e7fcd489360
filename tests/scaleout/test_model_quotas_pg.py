"""A key's per-model limits held by the database across replicas (issue 30; server.gateway.quota_db).

Two `DbQuotas`, each over its own `PgLedger` (two replicas) on one real PostgreSQL, share a
simulated clock. A model's TPM bucket is shared by the replicas (a `quota_model_buckets` row) and
its daily quota is derived from the key's holds and requests of that model; a refusal by either
the model's limits or the key-wide ones takes nothing from the other. The key store keeps the
per-model limits in a PostgreSQL ledger too.
"""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from server.gateway.quota_db import DbQuotas
from server.gateway.quotas import Limits
from server.serving.errors import RateLimited

KEY = "pw-modelkey0001"
T0 = 20_000 * 86_400.0 + 3_600.0  # 01:00 UTC on some day: the run never crosses midnight


async def _two_replicas(pg_url: str, limits: Limits, clock: Any) -> tuple[Any, Any, DbQuotas, DbQuotas]:
    from server.serving.ledger_pg import PgLedger

    a = await PgLedger.open(pg_url, name="a")
    b = await PgLedger.open(pg_url, name="b")
    return a, b, DbQuotas(a, lambda k: limits, clock), DbQuotas(b, lambda k: limits, clock)


async def _level(ledger: Any, table: str, kind: str = "tokens") -> float:
    rows = await ledger.query(f"SELECT level FROM {table} WHERE key_id = ? AND kind = ?", (KEY, kind))
    return float(rows[0][0])


def test_a_models_bucket_is_shared_and_a_refusal_takes_nothing_key_wide(pg_url: str) -> None:
    now = [T0]

    async def main() -> None:
        a, b, qa, qb = await _two_replicas(pg_url, Limits(tpm=10_000, models={"m": Limits(tpm=100)}),
                                           lambda: now[0])
        try:
            res = await qa.acquire(KEY, 80, "h1", "m")
            assert await _level(a, "quota_model_buckets") == 20 and await _level(a, "quota_buckets") == 9920
            with pytest.raises(RateLimited) as e:
                await qb.acquire(KEY, 30, "h2", "m")  # replica b sees m's bucket spent
            assert e.value.param == "model" and "on model 'm': 100 tokens per minute" in e.value.message
            assert e.value.headers["x-ratelimit-remaining-tokens"] == "20"
            # Nothing taken key-wide, and no hold left behind.
            assert await _level(a, "quota_buckets") == 9920
            assert await a.query("SELECT hold_id FROM quota_holds WHERE hold_id = 'h2'") == []
            await qb.acquire(KEY, 500, "h3", "other")  # another model: the key-wide bucket alone
            assert await _level(b, "quota_buckets") == 9420
            qa.settle(res, 40)  # used 40: 40 go back to m's bucket and to the key-wide one
            await a.execute("SELECT 1")  # the settle's writes are queued FIFO: this waits for them
            assert await _level(a, "quota_model_buckets") == 60 and await _level(a, "quota_buckets") == 9460
            await qb.acquire(KEY, 60, "h4", "m")
            with pytest.raises(RateLimited, match="on model 'm'"):
                await qa.acquire(KEY, 1, "h5", "m")
            now[0] += 6.0  # 6 s refill 10 of m's tokens
            await qa.acquire(KEY, 10, "h6", "m")
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


def test_a_models_daily_quota_is_derived_from_its_holds_and_requests(pg_url: str) -> None:
    now = [T0]

    async def finished(ledger: Any, rid: str, model: str, tokens: int) -> None:
        """The request's terminal row, as the service writes it before settling."""
        await ledger.execute(
            "INSERT INTO requests (request_id, kind, api, model, state, created_at, admitted_at, prompt_tokens, "
            "completion_tokens, key_id) VALUES (?, 'completion', 'http', ?, 'finished', ?, ?, 3, ?, ?)",
            (rid, model, now[0], now[0], tokens - 3, KEY))

    async def main() -> None:
        limits = Limits(daily_tokens=1000, models={"m": Limits(daily_tokens=150)})
        a, b, qa, qb = await _two_replicas(pg_url, limits, lambda: now[0])
        try:
            r1 = await qa.acquire(KEY, 100, "r1", "m")
            with pytest.raises(RateLimited) as e:
                await qb.acquire(KEY, 60, "r2", "m")  # m's hold of 100 counts on the other replica
            assert e.value.code == "daily_quota_exceeded" and e.value.param == "model"
            assert "on model 'm': 50 of 150 tokens left today" in e.value.message
            await finished(a, "r1", "m", 40)
            qa.settle(r1, 40)
            await a.execute("SELECT 1")
            r3 = await qb.acquire(KEY, 110, "r3", "m")  # 40 spent + 110 = 150
            with pytest.raises(RateLimited, match="on model 'm': 0 of 150"):
                await qb.acquire(KEY, 1, "r4", "m")
            await qb.acquire(KEY, 500, "r5", "other")  # key-wide: 40 + 110 + 500 of 1000
            with pytest.raises(RateLimited) as k:
                await qa.acquire(KEY, 400, "r6", "other")
            assert k.value.param is None and "daily token quota reached for this key: 350 of 1000" in k.value.message
            # A request of m settled below its reservation frees m's quota on every replica.
            await finished(b, "r3", "m", 10)
            qb.settle(r3, 10)
            await b.execute("SELECT 1")
            await qa.acquire(KEY, 100, "r7", "m")  # 40 + 10 + 100 = 150
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


def test_the_key_store_keeps_model_limits_in_postgresql(pg_url: str) -> None:
    from server.gateway.keys import KeyStore, load_keys
    from server.serving.ledger_pg import PgLedger
    from server.serving.ledger_pg_sync import open_for_keys

    conn = open_for_keys(pg_url)
    try:
        store = KeyStore(conn)
        key, _ = store.create("pg", model_limits={"small": {"tpm": 1000, "daily_tokens": 5}})
        store.update(key.key_id, model_limits={"small": {"tpm": 0, "rpm": 3}})
    finally:
        conn.close()

    async def main() -> dict[str, Any]:
        ledger = await PgLedger.open(pg_url, name="k")
        try:
            return (await load_keys(ledger))[1]
        finally:
            await ledger.close()

    keys = asyncio.run(main())
    assert keys[key.key_id].model_limits == {"small": {"daily_tokens": 5, "rpm": 3}}
