"""Token quotas and rate limits held in the shared database, exact across replicas.

Scheme: atomic reserve/settle in the database. A key's reservations run one at a time across
every replica (a transaction holding the key's advisory lock, `PgLedger.key_lock`). Inside it:
- the daily quota is derived from the ledger itself, never from a replica's memory: outstanding
  reservations are the key's rows in `quota_holds` (one per request, keyed by its request id,
  created in this transaction and deleted when the request's terminal row has committed); a
  request with a hold counts its full reservation, one without counts what `usage.BILLABLE_SQL`
  says it cost; the budget is holds + settled costs of the key's requests created today (UTC);
- tokens and requests per minute are `quotas.Bucket`s whose state (level, and the time it was
  computed at) is a `quota_buckets` row per key and kind, read `FOR UPDATE`, refilled and taken
  by `QuotaBook.reserve` and written back in the same transaction; `settle` gives the unused part
  of a reservation back with one UPDATE that refills and adds in SQL (the row lock orders it with
  a concurrent reservation, so neither write is lost). A key with no bucket row yet (its first
  request, or a limit newly set) starts from the ledger's last minute, each charge decayed by its
  age (the rule `QuotaBook.load_window` restores a restarted server with).
The limits' checks and messages are `QuotaBook.reserve`'s own, run on that state, and the hold is
inserted before the lock is released, so the next reservation on any replica sees it. A replica
that dies leaves holds behind; the lease sweep (`PgLedger.sweep_dead`) deletes them when it
interrupts that replica's rows, which then count what they emitted. Its buckets keep the full
reservations taken (nothing gives the unused part back): conservative, never over the limit.
So the daily budget and the per-minute buckets hold across replicas within one request's
reservation. Cost: one extra transaction per request at admission (lock, two reads, up to three
writes) and two statements queued into the group commit at the end; bench/RESULTS.md
has the figures.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from server.gateway.quotas import DAY_S, WINDOW_S, Bucket, Limits, QuotaBook, Reservation
from server.gateway.usage import BILLABLE_SQL
from server.serving.ledger_pg import KeyTx, PgLedger

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
            start = day * DAY_S
            held_today, settled_today = (await tx.query(
                "SELECT (SELECT COALESCE(SUM(tokens), 0) FROM quota_holds WHERE key_id = ? AND created_at >= ?), "
                f"(SELECT COALESCE(SUM({BILLABLE_SQL}), 0) FROM requests r WHERE key_id = ? AND created_at >= ? "
                f"AND {_NO_HOLD})", (key_id, start, key_id, start)))[0]
            st = self._state(key_id)
            st.day, st.used_today, st.reserved = day, int(settled_today or 0), int(held_today or 0)
            st.tokens = st.requests = None
            stored = {str(kind): (float(level), float(t)) for kind, level, t in await tx.query(
                "SELECT kind, level, t FROM quota_buckets WHERE key_id = ? FOR UPDATE", (key_id,))}
            kinds = [(attr, cap) for attr, cap in (("tokens", lim.tpm), ("requests", lim.rpm)) if cap is not None]
            for attr, cap in kinds:
                b = Bucket(cap, now)
                if attr in stored:
                    # A lowered limit keeps what was spent (no free refill); reserve refills it.
                    b.level, b.t = min(float(cap), stored[attr][0]), stored[attr][1]
                else:
                    b.level = max(0.0, cap - await self._owed(tx, key_id, attr, now))
                setattr(st, attr, b)
            res = super().reserve(key_id, cost)  # the checks and messages of the in-memory book
            for attr, _ in kinds:
                b = getattr(st, attr)
                await tx.execute(
                    "INSERT INTO quota_buckets (key_id, kind, level, t) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (key_id, kind) DO UPDATE SET level = excluded.level, t = excluded.t",
                    (key_id, attr, b.level, b.t))
            await tx.execute("INSERT INTO quota_holds (hold_id, key_id, tokens, created_at, instance_id) "
                             "VALUES (?, ?, ?, ?, ?)", (hold_id, key_id, cost, now, self.ledger.instance_id))
        res.hold_id = hold_id
        return res

    async def _owed(self, tx: KeyTx, key_id: str, kind: str, now: float) -> float:
        """What the key's last minute in the ledger charged to `kind`'s bucket, each charge decayed by
        its age: a bucket with no row starts at capacity minus this."""
        since = now - WINDOW_S
        window = await tx.query(
            "SELECT created_at, tokens, 1 FROM quota_holds WHERE key_id = ? AND created_at >= ? UNION ALL "
            f"SELECT created_at, {BILLABLE_SQL}, CASE WHEN admitted_at IS NULL THEN 0 ELSE 1 END "
            f"FROM requests r WHERE key_id = ? AND created_at >= ? AND {_NO_HOLD}",
            (key_id, since, key_id, since))
        return sum(float(int(n or 0) if kind == "tokens" else int(ran)) * max(0.0, 1.0 - (now - float(t)) / WINDOW_S)
                   for t, n, ran in window)

    def settle(self, res: Reservation, actual: int, *, ran: bool = True) -> None:
        already = res.settled
        super().settle(res, actual, ran=ran)
        if already or res.hold_id is None:
            return
        # Queued behind the request's terminal write (FIFO, usually the same commit): until
        # both land, the hold counts and the row does not, so nothing is counted twice.
        self.ledger.execute_nowait("DELETE FROM quota_holds WHERE hold_id = ?", (res.hold_id,))
        lim = self._limits_of(res.key_id) or Limits()
        now = self.clock()
        for kind, cap, back in (("tokens", lim.tpm, res.tokens - actual), ("requests", lim.rpm, 0 if ran else 1)):
            if cap is None or back <= 0:
                continue
            # Refill to now, then give back: one statement, so it needs no key lock; the row lock
            # orders it with a reservation holding the row FOR UPDATE.
            self.ledger.execute_nowait(
                "UPDATE quota_buckets SET level = LEAST(?, level + GREATEST(0.0, ? - t) * ? / ? + ?), "
                "t = GREATEST(t, ?) WHERE key_id = ? AND kind = ?",
                (float(cap), now, float(cap), WINDOW_S, float(back), now, res.key_id, kind))
