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
A key's limits for a model (issue 30) are held the same way under the same key lock: the daily
budget from the key's holds and requests of that model (`quota_holds.model`, `requests.model`:
the name the request used), its buckets in `quota_model_buckets` rows per key, model and kind.
So the daily budget and the per-minute buckets hold across replicas within one request's
reservation. Cost: one extra transaction per request at admission (lock, two reads, up to three
writes) and two statements queued into the group commit at the end; bench/RESULTS.md
has the figures.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

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

    def load_daily(self, used: dict[str, int], day: int,
                   by_model: Optional[dict[tuple[str, str], int]] = None) -> None:
        pass  # derived from the database at every reservation

    def load_window(self, spent: Any, by_model: Any = None) -> None:
        pass

    @staticmethod
    def _where(key_id: str, model: Optional[str]) -> tuple[str, tuple[Any, ...]]:
        """The rows of one scope: the key's (model None) or the key's on one model."""
        return ("key_id = ?", (key_id,)) if model is None else ("key_id = ? AND model = ?", (key_id, model))

    @staticmethod
    def _buckets(model: Optional[str]) -> str:
        return "quota_buckets" if model is None else "quota_model_buckets"

    async def acquire(self, key_id: str, cost: int, hold_id: str, model: Optional[str] = None) -> Reservation:
        lim = self._limits_of(key_id) or Limits()
        mlim = lim.models.get(model) if model is not None else None
        scopes = [(m, sl) for m, sl in ((None, lim), (model, mlim)) if sl is not None and sl.any()]
        if not scopes:
            return super().reserve(key_id, cost, model)  # nothing to hold
        async with self.ledger.key_lock(key_id) as tx:
            now = self.clock()
            day = self.day_of(now)
            start = day * DAY_S
            for m, sl in scopes:
                where, args = self._where(key_id, m)
                held_today, settled_today = (await tx.query(
                    f"SELECT (SELECT COALESCE(SUM(tokens), 0) FROM quota_holds WHERE {where} AND created_at >= ?), "
                    f"(SELECT COALESCE(SUM({BILLABLE_SQL}), 0) FROM requests r WHERE {where} AND created_at >= ? "
                    f"AND {_NO_HOLD})", (*args, start, *args, start)))[0]
                st = self._state(key_id) if m is None else self._model_state(key_id, m)
                st.day, st.used_today, st.reserved = day, int(settled_today or 0), int(held_today or 0)
                st.tokens = st.requests = None
                stored = {str(kind): (float(level), float(t)) for kind, level, t in await tx.query(
                    f"SELECT kind, level, t FROM {self._buckets(m)} WHERE {where} FOR UPDATE", args)}
                for attr, cap in self._kinds(sl):
                    b = Bucket(cap, now)
                    if attr in stored:
                        # A lowered limit keeps what was spent (no free refill); reserve refills it.
                        b.level, b.t = min(float(cap), stored[attr][0]), stored[attr][1]
                    else:
                        b.level = max(0.0, cap - await self._owed(tx, key_id, m, attr, now))
                    setattr(st, attr, b)
            res = super().reserve(key_id, cost, model)  # the checks and messages of the in-memory book
            for m, sl in scopes:
                st = self._state(key_id) if m is None else self._model_state(key_id, m)
                for attr, _ in self._kinds(sl):
                    b = getattr(st, attr)
                    if m is None:
                        await tx.execute(
                            "INSERT INTO quota_buckets (key_id, kind, level, t) VALUES (?, ?, ?, ?) "
                            "ON CONFLICT (key_id, kind) DO UPDATE SET level = excluded.level, t = excluded.t",
                            (key_id, attr, b.level, b.t))
                    else:
                        await tx.execute(
                            "INSERT INTO quota_model_buckets (key_id, model, kind, level, t) VALUES (?, ?, ?, ?, ?) "
                            "ON CONFLICT (key_id, model, kind) DO UPDATE SET level = excluded.level, t = excluded.t",
                            (key_id, m, attr, b.level, b.t))
            await tx.execute("INSERT INTO quota_holds (hold_id, key_id, tokens, created_at, instance_id, model) "
                             "VALUES (?, ?, ?, ?, ?, ?)",
                             (hold_id, key_id, cost, now, self.ledger.instance_id, model))
        res.hold_id = hold_id
        return res

    @staticmethod
    def _kinds(lim: Limits) -> list[tuple[str, int]]:
        return [(attr, cap) for attr, cap in (("tokens", lim.tpm), ("requests", lim.rpm)) if cap is not None]

    async def _owed(self, tx: KeyTx, key_id: str, model: Optional[str], kind: str, now: float) -> float:
        """What the scope's last minute in the ledger charged to `kind`'s bucket, each charge decayed
        by its age: a bucket with no row starts at capacity minus this."""
        since = now - WINDOW_S
        where, args = self._where(key_id, model)
        window = await tx.query(
            f"SELECT created_at, tokens, 1 FROM quota_holds WHERE {where} AND created_at >= ? UNION ALL "
            f"SELECT created_at, {BILLABLE_SQL}, CASE WHEN admitted_at IS NULL THEN 0 ELSE 1 END "
            f"FROM requests r WHERE {where} AND created_at >= ? AND {_NO_HOLD}",
            (*args, since, *args, since))
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
        mlim = lim.models.get(res.model) if res.model is not None else None
        now = self.clock()
        for m, sl in ((None, lim), (res.model, mlim)):
            if sl is None:
                continue
            where, args = self._where(res.key_id, m)
            for kind, cap, back in (("tokens", sl.tpm, res.tokens - actual), ("requests", sl.rpm, 0 if ran else 1)):
                if cap is None or back <= 0:
                    continue
                # Refill to now, then give back: one statement, so it needs no key lock; the row lock
                # orders it with a reservation holding the row FOR UPDATE.
                self.ledger.execute_nowait(
                    f"UPDATE {self._buckets(m)} SET level = LEAST(?, level + GREATEST(0.0, ? - t) * ? / ? + ?), "
                    f"t = GREATEST(t, ?) WHERE {where} AND kind = ?",
                    (float(cap), now, float(cap), WINDOW_S, float(back), now, *args, kind))
