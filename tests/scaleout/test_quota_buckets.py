"""One key's per-minute limits held by the database across replicas (server.gateway.quota_db).

Two `DbQuotas`, each over its own `PgLedger` (two replicas) on one real PostgreSQL, share a
simulated clock, so the figures are exact and nothing waits on wall time. The rule they must keep
is a token bucket's: over any run of T seconds a key is admitted at most its capacity plus T
seconds of refill, within one request's reservation (issue 32). The scheme this replaced derived
the level from the last minute's charges, decayed by age, and admitted up to twice the rate.
"""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from server.gateway.quota_db import DbQuotas
from server.gateway.quotas import WINDOW_S, Limits
from server.serving.errors import RateLimited

KEY = "pw-bucketkey0001"
T0 = 20_000 * 86_400.0 + 3_600.0  # 01:00 UTC on some day: the run never crosses midnight


async def _two_replicas(pg_url: str, limits: Limits, clock: Any) -> tuple[Any, Any, DbQuotas, DbQuotas]:
    from server.serving.ledger_pg import PgLedger

    a = await PgLedger.open(pg_url, name="a")
    b = await PgLedger.open(pg_url, name="b")
    return a, b, DbQuotas(a, lambda k: limits, clock), DbQuotas(b, lambda k: limits, clock)


@pytest.mark.parametrize("limit", ["tpm", "rpm"])
def test_a_keys_bucket_is_shared_and_exact_over_three_minutes(pg_url: str, limit: str) -> None:
    cap, cost, step, seconds = (600, 50, 0.5, 180.0) if limit == "tpm" else (20, 50, 0.5, 180.0)
    limits = Limits(tpm=cap) if limit == "tpm" else Limits(rpm=cap)
    now = [T0]

    async def main() -> list[float]:
        a, b, qa, qb = await _two_replicas(pg_url, limits, lambda: now[0])
        admitted: list[float] = []
        try:
            n = 0
            while now[0] < T0 + seconds:
                for q in (qa, qb):  # both replicas try at every step: the key is driven past its limit
                    n += 1
                    try:
                        res = await q.acquire(KEY, cost, f"hold-{n}")
                    except RateLimited:
                        continue
                    admitted.append(now[0])
                    q.settle(res, cost)  # it used its whole reservation
                now[0] += step
        finally:
            await a.close()
            await b.close()
        return admitted

    admitted = asyncio.run(main())
    per = cost if limit == "tpm" else 1
    total = len(admitted) * per
    allowance = cap + cap * seconds / WINDOW_S  # a full bucket, plus its refill over the run
    assert total <= allowance + per, (total, allowance)
    assert total >= allowance - 2 * per, (total, allowance)  # and not far too strict either
    # Any one minute: at most the capacity plus one minute's refill.
    worst = max(sum(per for s in admitted if t <= s < t + WINDOW_S) for t in admitted)
    assert worst <= 2 * cap + per


def test_what_a_request_did_not_use_goes_back_to_the_shared_bucket(pg_url: str) -> None:
    now = [T0]

    async def main() -> None:
        a, b, qa, qb = await _two_replicas(pg_url, Limits(tpm=100), lambda: now[0])
        try:
            res = await qa.acquire(KEY, 100, "h1")  # the whole bucket, on replica a
            with pytest.raises(RateLimited):
                await qb.acquire(KEY, 10, "h2")  # replica b sees it spent
            qa.settle(res, 40)  # it used 40: 60 go back
            await a.execute("SELECT 1")  # the settle's writes are queued FIFO: this waits for them
            await qb.acquire(KEY, 60, "h3")  # replica b can take them, and no more
            with pytest.raises(RateLimited) as e:
                await qa.acquire(KEY, 1, "h4")
            assert "rate limit reached" in str(e.value) and "retry in" in str(e.value)
            now[0] += 6.0  # 6 s refill 10 tokens
            await qa.acquire(KEY, 10, "h5")
            with pytest.raises(RateLimited):
                await qb.acquire(KEY, 1, "h6")
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())
