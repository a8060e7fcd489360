"""Token quotas and rate limits per API key: a tokens-per-minute bucket, a requests-per-minute
bucket and a daily token quota, all reserved at admission and reconciled at the end.

At admission a request reserves `prompt tokens + n × max_tokens` (the most it can cost) against
the key's TPM bucket and daily quota, and one request against its RPM bucket. When it ends the
reservation is replaced by what it actually cost (`settle`): unused tokens go back to the bucket
and the daily quota. A request that never reached the engine (cancelled while queued, refused,
or its ledger write failed) costs nothing. "Actual cost" is defined once, in
`server.gateway.usage.BILLABLE_SQL`, and the in-memory figure follows the same rule, so the daily
usage a restarted server reads back from the ledger is the one it had in memory (an interrupted
request counts the tokens it emitted, which the service writes to its row as it runs).

Days are UTC days. Buckets refill continuously (capacity per 60 s). The clock is injected so
tests move time without sleeping. Everything runs on the event loop: no locks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from server.serving.access import Reservation
from server.serving.errors import RateLimited

__all__ = ["Limits", "QuotaBook", "RateLimited", "Reservation"]  # RateLimited and Reservation: re-exported

DAY_S = 86400.0
WINDOW_S = 60.0


def _duration(s: float) -> str:
    """OpenAI's reset format: `1s`, `6m0s`, `1h2m3s` (whole seconds, rounded up; `0s` at most 0)."""
    total = max(0, int(-(-s // 1)))
    h, rest = divmod(total, 3600)
    m, sec = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{sec}s"


class Bucket:
    """A token bucket holding at most `capacity`, refilled at `capacity / WINDOW_S` per second."""

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.level = float(capacity)
        self.t = now

    def _refill(self, now: float) -> None:
        if now > self.t:
            self.level = min(float(self.capacity), self.level + (now - self.t) * self.capacity / WINDOW_S)
        self.t = max(self.t, now)

    def wait_for(self, n: float, now: float) -> float:
        """Seconds until `n` can be taken (0 when it can now)."""
        self._refill(now)
        if self.level >= n:
            return 0.0
        return (n - self.level) * WINDOW_S / self.capacity

    def take(self, n: float) -> None:
        self.level -= n

    def give(self, n: float, now: float) -> None:
        self._refill(now)
        self.level = min(float(self.capacity), self.level + n)

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, (self.capacity - self.level) * WINDOW_S / self.capacity)


@dataclass
class Limits:
    """A key's limits (None: unlimited)."""

    tpm: Optional[int] = None
    rpm: Optional[int] = None
    daily_tokens: Optional[int] = None


@dataclass
class _KeyState:
    tokens: Optional[Bucket] = None
    requests: Optional[Bucket] = None
    day: int = -1
    used_today: int = 0  # settled cost of requests created today (UTC)
    reserved: int = 0  # outstanding reservations, not yet settled
    live: set[int] = field(default_factory=set)


class QuotaBook:
    """Per-key buckets and daily counters. `limits_of(key_id)` gives a key's current limits (a key
    updated with `pagewire keys update` takes effect on its next request)."""

    def __init__(self, limits_of: Callable[[str], Optional[Limits]],
                 clock: Callable[[], float] = time.time) -> None:
        self._limits_of = limits_of
        self.clock = clock
        self._keys: dict[str, _KeyState] = {}
        self._ids = 0

    @staticmethod
    def day_of(t: float) -> int:
        return int(t // DAY_S)

    def load_daily(self, used: dict[str, int], day: int) -> None:
        """Seed today's usage (from the ledger at start-up: `usage.daily_usage`)."""
        for key_id, n in used.items():
            st = self._state(key_id)
            st.day, st.used_today = day, int(n)

    def load_window(self, spent: dict[str, list[tuple[float, int]]]) -> None:
        """Seed each key's tokens-per-minute bucket from the ledger at start-up: `spent[key]` holds
        (created_at, billable tokens) of its requests of the last minute. Each one is taken from a
        full bucket and has since refilled in proportion to its age, so a restart (or a crash)
        does not hand a key a fresh minute."""
        now = self.clock()
        for key_id, items in spent.items():
            lim = self._limits_of(key_id)
            if lim is None or lim.tpm is None:
                continue
            st = self._state(key_id)
            self._sync(st, lim, now)
            assert st.tokens is not None
            owed = sum(n * max(0.0, 1.0 - (now - t) / WINDOW_S) for t, n in items)
            st.tokens.level = max(0.0, st.tokens.capacity - owed)

    def _state(self, key_id: str) -> _KeyState:
        st = self._keys.get(key_id)
        if st is None:
            st = self._keys[key_id] = _KeyState()
        return st

    def _sync(self, st: _KeyState, lim: Limits, now: float) -> None:
        """Follow limit changes and the UTC day."""
        for attr, cap in (("tokens", lim.tpm), ("requests", lim.rpm)):
            b: Optional[Bucket] = getattr(st, attr)
            if cap is None:
                setattr(st, attr, None)
            elif b is None or b.capacity != cap:
                nb = Bucket(cap, now)
                if b is not None:  # keep what was spent: a changed limit is not a free refill
                    b._refill(now)
                    nb.level = min(float(cap), b.level)
                setattr(st, attr, nb)
        day = self.day_of(now)
        if st.day != day:
            st.day, st.used_today = day, 0

    def headers(self, key_id: str) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for a key's current state (empty when it has no limits)."""
        lim = self._limits_of(key_id) or Limits()
        st = self._state(key_id)
        now = self.clock()
        self._sync(st, lim, now)
        h: dict[str, str] = {}
        for kind, b in (("requests", st.requests), ("tokens", st.tokens)):
            if b is not None:
                b._refill(now)
                h[f"x-ratelimit-limit-{kind}"] = str(b.capacity)
                h[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(b.level)))
                h[f"x-ratelimit-reset-{kind}"] = _duration(b.reset_s())
        return h

    async def acquire(self, key_id: str, cost: int, hold_id: str) -> Reservation:
        """`reserve`, awaited by the service: the in-memory book answers at once; the database's
        (server.gateway.quota_db, several replicas) reserves in a transaction."""
        return self.reserve(key_id, cost)

    def reserve(self, key_id: str, cost: int) -> Reservation:
        """Reserve `cost` tokens and one request for `key_id`, or raise RateLimited."""
        lim = self._limits_of(key_id) or Limits()
        st = self._state(key_id)
        now = self.clock()
        self._sync(st, lim, now)
        if st.tokens is not None and cost > st.tokens.capacity:
            raise RateLimited(
                f"this request can use up to {cost} tokens (prompt + max_tokens), more than this key's "
                f"limit of {st.tokens.capacity} tokens per minute; lower max_tokens or shorten the prompt",
                headers={**self.headers(key_id), "x-should-retry": "false"}, retry_after_s=None,
                code="tokens_exceed_limit")
        if lim.daily_tokens is not None and st.used_today + st.reserved + cost > lim.daily_tokens:
            left = max(0, lim.daily_tokens - st.used_today - st.reserved)
            reset = (st.day + 1) * DAY_S - now
            raise RateLimited(
                f"daily token quota reached for this key: {left} of {lim.daily_tokens} tokens left today "
                f"(UTC) and this request can use up to {cost}",
                headers={**self.headers(key_id), "x-ratelimit-limit-tokens-day": str(lim.daily_tokens),
                         "x-ratelimit-remaining-tokens-day": str(left),
                         "x-ratelimit-reset-tokens-day": _duration(reset),
                         # An SDK retry (seconds apart) cannot outlast a day; tell it not to try.
                         **({"x-should-retry": "false"} if reset > WINDOW_S else {})},
                retry_after_s=reset, code="daily_quota_exceeded")
        waits = []
        if st.requests is not None:
            waits.append(("requests", st.requests.wait_for(1, now), st.requests.capacity))
        if st.tokens is not None:
            waits.append(("tokens", st.tokens.wait_for(cost, now), st.tokens.capacity))
        for kind, wait, cap in waits:
            if wait > 0:
                what = "requests" if kind == "requests" else f"tokens (this request needs {cost})"
                raise RateLimited(
                    f"rate limit reached for this key: {cap} {kind} per minute; not enough {what} "
                    f"left; retry in {wait:.1f}s",
                    headers=self.headers(key_id), retry_after_s=wait)
        if st.requests is not None:
            st.requests.take(1)
        if st.tokens is not None:
            st.tokens.take(cost)
        st.reserved += cost
        self._ids += 1
        st.live.add(self._ids)
        return Reservation(key_id, cost, st.day, self._ids)

    def settle(self, res: Reservation, actual: int, *, ran: bool = True) -> None:
        """Replace a reservation by what the request cost (`actual` tokens). `ran=False` (it never
        reached the engine) also gives its request back to the RPM bucket. Idempotent."""
        if res.settled:
            return
        res.settled = True
        st = self._state(res.key_id)
        now = self.clock()
        st.live.discard(res.ident)
        st.reserved = max(0, st.reserved - res.tokens)
        unused = res.tokens - actual
        if st.tokens is not None and unused > 0:
            st.tokens.give(unused, now)
        elif st.tokens is not None and unused < 0:  # cannot happen (max_tokens bounds it); keep exact
            st.tokens.take(-unused)
        if not ran and st.requests is not None:
            st.requests.give(1, now)
        if self.day_of(now) == res.day and st.day == res.day:
            st.used_today += actual

    def used_today(self, key_id: str) -> int:
        st = self._state(key_id)
        return st.used_today if st.day == self.day_of(self.clock()) else 0
