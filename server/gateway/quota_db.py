"""Token quotas and rate limits held in the shared database, exact across replicas.

Scheme: atomic reserve/settle in the database. A key's reservations run one at a time across
every replica (a transaction holding the key's advisory lock, `PgLedger.key_lock`). Inside it,
the key's state is derived from the ledger itself, never from a replica's memory:
- outstanding reservations are the key's rows in `quota_holds` (one per request, keyed by its
  request id, created in this transaction and deleted when the request's terminal row has
  committed); a request with a hold counts its full reservation, one without counts what
  `usage.BILLABLE_SQL` says it cost;
- the daily quota: holds + settled costs of the key's requests created today (UTC);
- tokens and requests per minute: the same token bucket as `quotas.QuotaBook` (capacity per
  60 s, refilled continuously), its level computed as capacity minus each charge of the last
  minute decayed by its age: what a bucket started full holds after those charges (the rule
  `QuotaBook.load_window` restores a restarted server with).
The limits' checks and messages are `QuotaBook.reserve`'s own, run on that derived state, and the
hold is inserted before the lock is released, so the next reservation on any replica sees it.
A replica that dies leaves holds behind; the lease sweep (`PgLedger.sweep_dead`) deletes them
when it interrupts that replica's rows, which then count what they emitted. The daily budget so
holds across replicas within one request's reservation. The per-minute buckets do not yet: the
decayed sum equals a real bucket only while the window's charges stay within the capacity, and
in steady state it admits up to twice the rate (bench/RESULTS.md); the bucket's own state (level,
time) belongs in a table read and written under the same lock. Cost: one extra
transaction per request at admission (lock, three indexed reads, one insert) and one DELETE
queued into the group commit at the end; bench/RESULTS.md has the figure.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from server.gateway.quotas import DAY_S, WINDOW_S, Bucket, Limits, QuotaBook, Reservation
from server.gateway.usage import BILLABLE_SQL
from server.serving.ledger_pg import PgLedger

_NO_HOLD = "NOT EXISTS (SELECT 1 FROM quota_holds h WHERE h.hold_id = r.request_id)"


class DbQuotas(QuotaBook):
    """`QuotaBook` whose state lives in the database (several replicas); see the module docstring."""

    def __init__(self, ledger: PgLedger, limits_of: Callable[[str], Optional[Limits]],
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(limits_of, clock)
        self.ledger = ledger

    def load_daily(self, used: dict[str, int], day: int) -> None:
        pass  # derived from the database at every reservation

    def load_window(self, spent: dict[str, list[tuple[float, int]]]) -> None:
        pass

    async def acquire(self, key_id: str, cost: int, hold_id: str) -> Reservation:
        lim = self._limits_of(key_id) or Limits()
        if lim.tpm is None and lim.rpm is None and lim.daily_tokens is None:
            return super().reserve(key_id, cost)  # nothing to hold
        async with self.ledger.key_lock(key_id) as tx:
            now = self.clock()
            day = self.day_of(now)
            start, since = day * DAY_S, now - WINDOW_S
            held_today = (await tx.query(
                "SELECT COALESCE(SUM(tokens), 0) FROM quota_holds WHERE key_id = ? AND created_at >= ?",
                (key_id, start)))[0][0]
            settled_today = (await tx.query(
                f"SELECT COALESCE(SUM({BILLABLE_SQL}), 0) FROM requests r WHERE key_id = ? AND created_at >= ? "
                f"AND {_NO_HOLD}", (key_id, start)))[0][0]
            window = await tx.query(
                "SELECT created_at, tokens, 1 FROM quota_holds WHERE key_id = ? AND created_at >= ? UNION ALL "
                f"SELECT created_at, {BILLABLE_SQL}, CASE WHEN admitted_at IS NULL THEN 0 ELSE 1 END "
                f"FROM requests r WHERE key_id = ? AND created_at >= ? AND {_NO_HOLD}",
                (key_id, since, key_id, since))
            st = self._state(key_id)
            st.day, st.used_today, st.reserved = day, int(settled_today or 0), int(held_today or 0)
            st.tokens = st.requests = None
            for attr, cap, charge in (("tokens", lim.tpm, lambda n, ran: n), ("requests", lim.rpm, lambda n, ran: ran)):
                if cap is None:
                    continue
                owed = sum(float(charge(int(n or 0), int(ran))) * max(0.0, 1.0 - (now - float(t)) / WINDOW_S)
                           for t, n, ran in window)
                b = Bucket(cap, now)
                b.level = max(0.0, cap - owed)
                setattr(st, attr, b)
            res = super().reserve(key_id, cost)  # the checks and messages of the in-memory book
            await tx.execute("INSERT INTO quota_holds (hold_id, key_id, tokens, created_at, instance_id) "
                             "VALUES (?, ?, ?, ?, ?)", (hold_id, key_id, cost, now, self.ledger.instance_id))
        res.hold_id = hold_id
        return res

    def settle(self, res: Reservation, actual: int, *, ran: bool = True) -> None:
        already = res.settled
        super().settle(res, actual, ran=ran)
        if not already and res.hold_id is not None:
            # Queued behind the request's terminal write (FIFO, usually the same commit): until
            # both land, the hold counts and the row does not, so nothing is counted twice.
            self.ledger.execute_nowait("DELETE FROM quota_holds WHERE hold_id = ?", (res.hold_id,))
