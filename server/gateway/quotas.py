"""Token quotas and rate limits per API key: a tokens-per-minute bucket, a requests-per-minute
bucket and a daily token quota, all reserved at admission and reconciled at the end; and the same
three, optionally, per model of a key (`Limits.models`, issue 30).

At admission a request reserves `prompt tokens + n × max_tokens` (the most it can cost) against
the key's TPM bucket and daily quota, and one request against its RPM bucket. When it ends the
reservation is replaced by what it actually cost (`settle`): unused tokens go back to the bucket
and the daily quota. A request that never reached the engine (cancelled while queued, refused,
or its ledger write failed) costs nothing. "Actual cost" is defined once, in
`server.gateway.usage.BILLABLE_SQL`, and the in-memory figure follows the same rule, so the daily
usage a restarted server reads back from the ledger is the one it had in memory (an interrupted
request counts the tokens it emitted, which the service writes to its row as it runs).

Per-model limits: a request reserves against its key's key-wide limits AND the limits its key
has for the model name it used (a LoRA adapter's name is a model of its own, as in the ledger).
Every check of both runs before anything is taken, so a refusal by either leaves both untouched;
`settle` gives the unused part back to both. Each (key, model) pair keeps its own daily usage
even without a limit, so a limit added mid-day counts the day from its start, as a restart
reading the ledger (filtered by model) would.

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
    """A key's limits (None: unlimited), and its limits per model name (`models`; a model not in
    it is limited by the key-wide ones alone)."""

    tpm: Optional[int] = None
    rpm: Optional[int] = None
    daily_tokens: Optional[int] = None
    models: dict[str, "Limits"] = field(default_factory=dict)

    def any(self) -> bool:
        return self.tpm is not None or self.rpm is not None or self.daily_tokens is not None


@dataclass
class _KeyState:
    tokens: Optional[Bucket] = None
    requests: Optional[Bucket] = None
    day: int = -1
    used_today: int = 0  # settled cost of requests created today (UTC)
    reserved: int = 0  # outstanding reservations, not yet settled
    live: set[int] = field(default_factory=set)


@dataclass
class _Scope:
    """Where a reservation is checked and taken: the key-wide state (model None) or a model's."""

    model: Optional[str]
    st: _KeyState
    lim: Limits

    @property
    def who(self) -> str:
        return "this key" if self.model is None else f"this key on model '{self.model}'"


Spent = dict[str, list[tuple[float, int]]]
ModelSpent = dict[tuple[str, str], list[tuple[float, int]]]


class QuotaBook:
    """Per-key buckets and daily counters, and per (key, model) ones. `limits_of(key_id)` gives a
    key's current limits (a key updated with `pagewire keys update` takes effect on its next
    request)."""

    def __init__(self, limits_of: Callable[[str], Optional[Limits]],
                 clock: Callable[[], float] = time.time) -> None:
        self._limits_of = limits_of
        self.clock = clock
        self._keys: dict[str, _KeyState] = {}
        self._models: dict[tuple[str, str], _KeyState] = {}
        self._ids = 0

    @staticmethod
    def day_of(t: float) -> int:
        return int(t // DAY_S)

    def load_daily(self, used: dict[str, int], day: int,
                   by_model: Optional[dict[tuple[str, str], int]] = None) -> None:
        """Seed today's usage (from the ledger at start-up: `usage.daily_usage`, and per (key,
        model) `usage.daily_usage_by_model`)."""
        for key_id, n in used.items():
            st = self._state(key_id)
            st.day, st.used_today = day, int(n)
        for (key_id, model), n in (by_model or {}).items():
            st = self._model_state(key_id, model)
            st.day, st.used_today = day, int(n)

    def load_window(self, spent: Spent, by_model: Optional[ModelSpent] = None) -> None:
        """Seed each key's tokens-per-minute bucket from the ledger at start-up: `spent[key]` holds
        (created_at, billable tokens) of its requests of the last minute. Each one is taken from a
        full bucket and has since refilled in proportion to its age, so a restart (or a crash)
        does not hand a key a fresh minute. `by_model[(key, model)]`: the same for the key's
        per-model buckets (`usage.recent_usage_by_model`)."""
        now = self.clock()
        items_of: list[tuple[_KeyState, Limits, list[tuple[float, int]]]] = []
        for key_id, items in spent.items():
            lim = self._limits_of(key_id)
            if lim is not None:
                items_of.append((self._state(key_id), lim, items))
        for (key_id, model), items in (by_model or {}).items():
            lim = self._limits_of(key_id)
            mlim = lim.models.get(model) if lim is not None else None
            if mlim is not None:
                items_of.append((self._model_state(key_id, model), mlim, items))
        for st, lim, items in items_of:
            if lim.tpm is None:
                continue
            self._sync(st, lim, now)
            assert st.tokens is not None
            owed = sum(n * max(0.0, 1.0 - (now - t) / WINDOW_S) for t, n in items)
            st.tokens.level = max(0.0, st.tokens.capacity - owed)

    def _state(self, key_id: str) -> _KeyState:
        st = self._keys.get(key_id)
        if st is None:
            st = self._keys[key_id] = _KeyState()
        return st

    def _model_state(self, key_id: str, model: str) -> _KeyState:
        st = self._models.get((key_id, model))
        if st is None:
            st = self._models[(key_id, model)] = _KeyState()
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

    def _scopes(self, key_id: str, model: Optional[str], now: float) -> tuple[_Scope, Optional[_Scope]]:
        """The key-wide scope and, when `model` is given, the model's (synced to now; its limits
        are empty when the key has none for it: it then only counts)."""
        lim = self._limits_of(key_id) or Limits()
        key = _Scope(None, self._state(key_id), lim)
        self._sync(key.st, lim, now)
        if model is None:
            return key, None
        scope = _Scope(model, self._model_state(key_id, model), lim.models.get(model) or Limits())
        self._sync(scope.st, scope.lim, now)
        return key, scope

    @staticmethod
    def _bucket_headers(st: _KeyState, now: float) -> dict[str, tuple[Bucket, dict[str, str]]]:
        out: dict[str, tuple[Bucket, dict[str, str]]] = {}
        for kind, b in (("requests", st.requests), ("tokens", st.tokens)):
            if b is not None:
                b._refill(now)
                out[kind] = (b, {f"x-ratelimit-limit-{kind}": str(b.capacity),
                                 f"x-ratelimit-remaining-{kind}": str(max(0, int(b.level))),
                                 f"x-ratelimit-reset-{kind}": _duration(b.reset_s())})
        return out

    def _headers(self, scopes: "list[_Scope]", now: float, first: Optional[_Scope] = None) -> dict[str, str]:
        """OpenAI's x-ratelimit-* for each kind from the bucket with the least left among `scopes`
        (the one that binds next), or from `first` where it has that kind (the scope a refusal
        names)."""
        best: dict[str, tuple[Bucket, dict[str, str]]] = {}
        for sc in scopes:
            for kind, (b, h) in self._bucket_headers(sc.st, now).items():
                if kind not in best or b.level < best[kind][0].level:
                    best[kind] = (b, h)
        if first is not None:
            best.update(self._bucket_headers(first.st, now))
        return {k: v for _, h in best.values() for k, v in h.items()}

    def headers(self, key_id: str, model: Optional[str] = None) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for a key's current state (empty when it has no limits);
        with `model`, each kind's bucket with the least left of the key-wide and the model's."""
        now = self.clock()
        key, scope = self._scopes(key_id, model, now)
        return self._headers([key] + ([scope] if scope is not None else []), now)

    async def acquire(self, key_id: str, cost: int, hold_id: str, model: Optional[str] = None) -> Reservation:
        """`reserve`, awaited by the service: the in-memory book answers at once; the database's
        (server.gateway.quota_db, several replicas) reserves in a transaction."""
        return self.reserve(key_id, cost, model)

    def reserve(self, key_id: str, cost: int, model: Optional[str] = None) -> Reservation:
        """Reserve `cost` tokens and one request for `key_id` (and for its limits on `model`, the
        name the request used), or raise RateLimited having taken nothing."""
        now = self.clock()
        key, scope = self._scopes(key_id, model, now)
        everyone = [key] + ([scope] if scope is not None else [])
        limited = [sc for sc in everyone if sc.lim.any()]
        for sc in limited:  # can never fit: no retry helps
            if sc.st.tokens is not None and cost > sc.st.tokens.capacity:
                by = "" if sc.model is None else f" for model '{sc.model}'"
                raise RateLimited(
                    f"this request can use up to {cost} tokens (prompt + max_tokens), more than this key's "
                    f"limit of {sc.st.tokens.capacity} tokens per minute{by}; lower max_tokens or shorten the prompt",
                    headers={**self._headers(everyone, now, sc), "x-should-retry": "false"}, retry_after_s=None,
                    code="tokens_exceed_limit", param=None if sc.model is None else "model")
        for sc in limited:
            st, lim = sc.st, sc.lim
            if lim.daily_tokens is not None and st.used_today + st.reserved + cost > lim.daily_tokens:
                left = max(0, lim.daily_tokens - st.used_today - st.reserved)
                reset = (st.day + 1) * DAY_S - now
                raise RateLimited(
                    f"daily token quota reached for {sc.who}: {left} of {lim.daily_tokens} tokens left today "
                    f"(UTC) and this request can use up to {cost}",
                    headers={**self._headers(everyone, now, sc),
                             "x-ratelimit-limit-tokens-day": str(lim.daily_tokens),
                             "x-ratelimit-remaining-tokens-day": str(left),
                             "x-ratelimit-reset-tokens-day": _duration(reset),
                             # An SDK retry (seconds apart) cannot outlast a day; tell it not to try.
                             **({"x-should-retry": "false"} if reset > WINDOW_S else {})},
                    retry_after_s=reset, code="daily_quota_exceeded", param=None if sc.model is None else "model")
        # The longest wait of any bucket of either scope: after it, every one of them fits.
        worst: Optional[tuple[float, _Scope, str, int]] = None
        for sc in limited:
            for kind, b, n in (("requests", sc.st.requests, 1), ("tokens", sc.st.tokens, cost)):
                if b is not None:
                    wait = b.wait_for(n, now)
                    if wait > 0 and (worst is None or wait > worst[0]):
                        worst = (wait, sc, kind, b.capacity)
        if worst is not None:
            wait, sc, kind, cap = worst
            what = "requests" if kind == "requests" else f"tokens (this request needs {cost})"
            raise RateLimited(
                f"rate limit reached for {sc.who}: {cap} {kind} per minute; not enough {what} "
                f"left; retry in {wait:.1f}s",
                headers=self._headers(everyone, now, sc), retry_after_s=wait,
                param=None if sc.model is None else "model")
        self._ids += 1
        for sc in everyone:
            if sc.st.requests is not None:
                sc.st.requests.take(1)
            if sc.st.tokens is not None:
                sc.st.tokens.take(cost)
            sc.st.reserved += cost
            sc.st.live.add(self._ids)
        return Reservation(key_id, cost, key.st.day, self._ids, model=model)

    def settle(self, res: Reservation, actual: int, *, ran: bool = True) -> None:
        """Replace a reservation by what the request cost (`actual` tokens), key-wide and for its
        model. `ran=False` (it never reached the engine) also gives its request back to the RPM
        buckets. Idempotent."""
        if res.settled:
            return
        res.settled = True
        now = self.clock()
        states = [self._state(res.key_id)]
        if res.model is not None:
            states.append(self._model_state(res.key_id, res.model))
        for st in states:
            if res.ident not in st.live:
                continue  # not taken here (a state dropped since): nothing to give back
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

    def used_today(self, key_id: str, model: Optional[str] = None) -> int:
        """A key's settled usage today (UTC), key-wide or (`model`) on one model."""
        st = self._state(key_id) if model is None else self._model_state(key_id, model)
        return st.used_today if st.day == self.day_of(self.clock()) else 0
