"""Streams: seq-numbered per-request events, the resume buffer, paced replays and bounded
coalescing outboxes.

Everything here runs on the event loop and never blocks: a producer (the bridge, once per engine
step) appends to a `RequestStream`, which pushes into each subscriber's `Outbox`; a writer task
per connection drains its outbox at the pace of its socket. While the socket is slow, consecutive
deltas of one sample merge in the outbox (a merged delta carries the seq of its newest part).

Replays are paced by the socket, not pushed: a subscriber that attaches after some output exists
(a resume, an idempotent retry) gets a `Replay` cursor over the stream's resume buffer (or over
the output rebuilt from the ledger), and the writer pulls the next chunk of it only when it has
sent the previous one. While a subscriber catches up, live events of its request are not queued
for it at all: they land in the same resume buffer, behind the cursor, so a multi-megabyte replay
never fills the outbox and never counts against the consumer. Once the cursor reaches the end of
the buffer, the subscriber goes live in the same synchronous step.

The outbox's byte bound counts only the backlog that builds up while the writer is busy with a
send (what arrives while it waits is taken at once). A live subscription whose next event would
cross the bound does not grow the outbox: it drops its pending events and catches up from the
resume buffer, as a resume would. So a connection never holds more than its bound however slowly
its client reads; a client that stops reading altogether is found by the writer's send timeout,
and its connection is closed with a resumable error (the client resumes from the last seq it
saw). `overflowed` remains for items with no stream behind them (control frames).

Sequence numbers: every delta of a request gets the next integer, starting at 1, across all its
samples. `attach(after_seq=k)` replays exactly the deltas with seq > k, then goes live; since the
switch from cursor to live pushes happens in one synchronous call on the loop, no delta published
in between can be missed or duplicated.
"""
from __future__ import annotations

import asyncio
import bisect
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional, Protocol, Sequence, Union

from server.engine.outputs import SampleDelta, TokenLogprob
from server.serving.lifecycle import END_RULES, EndReason, EndRule, LedgerState

# The size model of output held in memory, used for every byte bound on it (outboxes, the output
# budget, stream retention). Close to what CPython spends: a delta object with its lists, a
# character of text (up to 4 in a str, 1 for ASCII, and merged text is rebuilt), a token id in a
# list, and one (token_id, logprob) entry — a tuple of an int and a float, ~110 bytes.
DELTA_BYTES = 160
CHAR_BYTES = 2
TOKEN_BYTES = 8
LOGPROB_BYTES = 120
# What the output budget assumes for the text of one token (a generous average).
TEXT_CHARS_PER_TOKEN = 16


def delta_bytes_bound(tokens: int, top_logprobs: Optional[int]) -> int:
    """The most bytes `tokens` tokens can take in the resume buffer: each in its own delta."""
    per = DELTA_BYTES + TEXT_CHARS_PER_TOKEN * CHAR_BYTES + TOKEN_BYTES + (
        LOGPROB_BYTES * (1 + top_logprobs) if top_logprobs is not None else 0)
    return tokens * per


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class DeltaEvent:
    """New output of one sample: text, token ids, optional logprobs; finish_reason on its last."""

    seq: int
    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[TokenLogprob]] = None
    finish_reason: Optional[str] = None

    def size(self) -> int:
        """Bytes this delta holds in memory (see the constants above: a model, close to CPython's)."""
        return DELTA_BYTES + len(self.text) * CHAR_BYTES + TOKEN_BYTES * len(self.token_ids) + (
            LOGPROB_BYTES * sum(1 + len(lp.top) for lp in self.logprobs) if self.logprobs else 0
        )

    def absorb(self, later: "DeltaEvent") -> None:
        """Coalesce a later delta of the same sample into this one, in place (so only a private
        copy may absorb: see `_copy`). Its size grows by exactly `later.size() - DELTA_BYTES`.

        In place, not by building new lists: a consumer that lags merges every step's delta into
        the same pending one, and copying the lists each time made that quadratic in the backlog,
        event-loop time that the other streams paid for."""
        self.seq = later.seq
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = list(later.logprobs)
            else:
                self.logprobs.extend(later.logprobs)
        self.finish_reason = later.finish_reason


@dataclass(slots=True)
class EndEvent:
    """The one terminal event of a request, sent after its ledger row is committed.

    `reason` says how it ended; `END_RULES[reason]` gives its ledger state, error code, HTTP
    error and WebSocket frame. `message` is set when it did not finish.
    """

    request_id: str
    reason: EndReason
    finish_reasons: list[Optional[str]]
    usage: Usage
    last_seq: int
    message: Optional[str] = None
    output: Optional[dict[str, Any]] = None  # the stored output (text, tokens, logprobs, marks)

    def __post_init__(self) -> None:
        self.reason = EndReason(self.reason)

    @property
    def rule(self) -> EndRule:
        return END_RULES[self.reason]

    @property
    def state(self) -> LedgerState:
        return END_RULES[self.reason].state

    @property
    def code(self) -> Optional[str]:
        return END_RULES[self.reason].code

    @property
    def finished(self) -> bool:
        return self.reason is EndReason.FINISHED

    @property
    def finish_reason(self) -> Optional[str]:
        return self.finish_reasons[0] if self.finish_reasons else None


Event = Union[DeltaEvent, EndEvent]
# What an outbox carries: events, and the edge's own control frames (opaque here, 64 bytes each).
Queued = object


# How much of one replay the writer takes per turn: small enough that a replaying socket does not
# hold up the connection's live frames for long, large enough that frames stay big.
REPLAY_CHUNK_BYTES = 64 * 1024


def _copy(ev: DeltaEvent) -> DeltaEvent:
    """A private copy for merging: the stream's resume buffer must not see a connection's merges."""
    return DeltaEvent(ev.seq, ev.index, ev.text, list(ev.token_ids),
                      list(ev.logprobs) if ev.logprobs is not None else None, ev.finish_reason)


class Replay:
    """The events a subscriber has not seen yet, read lazily as the writer asks for them.

    Over a live stream, `deltas` is the stream's own resume buffer, which keeps growing while the
    request runs, and the end is read from the stream when the cursor gets there. Over a ledger
    row (stream gone), `deltas` is the output rebuilt from the row, and `end` is its end event.
    """

    def __init__(self, deltas: Sequence[DeltaEvent], start: int = 0,
                 stream: Optional["RequestStream"] = None, end: Optional[EndEvent] = None) -> None:
        self._deltas = deltas
        self._pos = start
        self._stream = stream
        self._end = end
        self._end_given = False
        # The seq the subscriber has up to, where this cursor starts.
        self.start_seq = deltas[start - 1].seq if start > 0 else 0

    @property
    def stream(self) -> Optional["RequestStream"]:
        return self._stream

    @property
    def behind(self) -> bool:
        """Whether `next` has an event now."""
        end = self._stream.end if self._stream is not None else self._end
        return self._pos < len(self._deltas) or (end is not None and not self._end_given)

    def next(self) -> Optional[Event]:
        """The next event, or None when caught up (nothing more until the stream publishes)."""
        if self._pos < len(self._deltas):
            ev = self._deltas[self._pos]
            self._pos += 1
            return ev
        end = self._stream.end if self._stream is not None else self._end
        if end is not None and not self._end_given:
            self._end_given = True
            return end
        return None

    def drain(self) -> list[Event]:
        """Everything up to now, at once (for subscribers that keep no socket, such as EndWaiter)."""
        out: list[Event] = []
        while (ev := self.next()) is not None:
            out.append(ev)
        return out


class Outbox:
    """A bounded buffer of events for one writer (a WebSocket, or one SSE response).

    Keys name the stream an event belongs to on this connection (the client's id for it).
    Pending events of different keys keep their first-arrival order; within a key, order is
    preserved and consecutive deltas of the same sample are merged. Keys that are catching up
    hold a `Replay` instead of pending events; each `get` takes all pending events and the next
    chunk of each replay.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._pending: dict[Hashable, list[Queued]] = {}
        self._replays: dict[Hashable, "Subscription"] = {}
        self._owners: dict[Hashable, "Subscription"] = {}  # live keys: told what the writer took
        self._bytes = 0
        # Live bytes pushed while the writer was not parked in `get` (it was sending, or there is
        # no writer yet). Only these count against max_bytes: they measure how far the consumer
        # lags. Bytes pushed while the writer is parked are taken as soon as it runs, so a burst
        # of one engine step, or a loop that ran several steps' callbacks back to back, says
        # nothing about the consumer.
        self._backlog = 0
        self._parked = False
        self._wake = asyncio.Event()
        self.overflowed = False
        self.closed = False

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    @property
    def replaying(self) -> int:
        """How many keys are still catching up."""
        return len(self._replays)

    def would_overflow(self, event: Event) -> bool:
        """Whether pushing `event` now would take the backlog past the bound."""
        size = event.size() if isinstance(event, DeltaEvent) else 64
        return not self._parked and self._backlog + size > self.max_bytes

    def push(self, key: Hashable, event: Queued, owner: Optional["Subscription"] = None) -> None:
        """Queue one live event (or a control frame) for `key`; `owner` is told when the writer
        takes a delta of it (see `Subscription.delivered_seq`)."""
        if self.closed or self.overflowed:
            return  # the client will resume from its last seq; the stream still has these
        if owner is not None:
            self._owners[key] = owner
        items = self._pending.setdefault(key, [])
        before = self._bytes
        if isinstance(event, DeltaEvent):
            last = items[-1] if items else None
            if isinstance(last, DeltaEvent) and last.index == event.index and last.finish_reason is None:
                last.absorb(event)  # `last` is the outbox's own copy
                self._bytes += event.size() - DELTA_BYTES
            else:
                items.append(_copy(event))
                self._bytes += event.size()
        else:
            items.append(event)
            self._bytes += 64
        if not self._parked:
            self._backlog += self._bytes - before
            if self._backlog > self.max_bytes:
                self.overflowed = True
        self._wake.set()

    def discard_events(self, key: Hashable) -> None:
        """Drop `key`'s pending deltas and end (its replay will send them again); control
        frames, such as `accepted`, stay where they are."""
        items = self._pending.get(key)
        if not items:
            return
        keep = [e for e in items if not isinstance(e, (DeltaEvent, EndEvent))]
        dropped = sum(e.size() if isinstance(e, DeltaEvent) else 64 for e in items
                      if isinstance(e, (DeltaEvent, EndEvent)))
        if keep:
            self._pending[key] = keep
        else:
            del self._pending[key]
        self._bytes -= dropped
        self._backlog = max(0, min(self._backlog - dropped, self._bytes))

    def add_replay(self, sub: "Subscription") -> None:
        """Let the writer pull `sub`'s replay at the socket's pace (see `Subscription.pull`)."""
        if self.closed or self.overflowed:
            return
        self._owners.pop(sub.key, None)
        self._replays[sub.key] = sub
        self._wake.set()

    def take(self) -> list[tuple[Hashable, Queued]]:
        """Everything pending and the next chunk of each replay, in order (non-blocking).

        A key's pending events (such as its `accepted` frame) precede its replay: a replaying
        key gets no live events until its cursor has caught up.
        """
        out = [(k, e) for k, items in self._pending.items() for e in items]
        self._pending.clear()
        for k, e in out:
            owner = self._owners.get(k)
            if owner is not None:
                if isinstance(e, DeltaEvent):
                    owner.delivered_seq = e.seq
                elif isinstance(e, EndEvent):
                    del self._owners[k]
        self._bytes = 0
        self._backlog = 0
        self._wake.clear()
        for key, sub in list(self._replays.items()):
            budget = REPLAY_CHUNK_BYTES
            merging: Optional[DeltaEvent] = None
            while budget > 0:
                ev = sub.pull()
                if ev is None:  # caught up: `sub` is live from here on
                    del self._replays[key]
                    break
                if isinstance(ev, DeltaEvent):
                    if merging is not None and merging.index == ev.index and merging.finish_reason is None:
                        merging.absorb(ev)
                    else:
                        merging = _copy(ev)
                        out.append((key, merging))
                    budget -= ev.size()
                else:
                    merging = None
                    out.append((key, ev))
        return out

    async def get(self) -> list[tuple[Hashable, Queued]]:
        """Wait for events; returns [] once closed (or overflowed) with nothing left to send."""
        while not self.overflowed:
            if self._pending or self._replays:
                batch = self.take()
                if batch:
                    self._parked = False
                    return batch
                continue  # every replay had just caught up
            if self.closed:
                return []
            self._parked = True
            self._backlog = 0
            await self._wake.wait()
            self._wake.clear()
        self._parked = False
        return []

    def close(self) -> None:
        """Wake the writer; it sends what is pending (replays included), then stops. Idempotent."""
        self.closed = True
        self._wake.set()


@dataclass(eq=False)
class Subscription:
    """One consumer of one stream: events go to `outbox` under `key`.

    While `replay` is set the subscription is catching up: the outbox's writer pulls from the
    cursor, and live events are ignored here because the cursor will read them from the stream.
    A live subscription whose next event would take the outbox past its bound falls back to the
    same: its pending events are dropped and it catches up from the stream's resume buffer after
    `delivered_seq`, so a slow reader costs the connection no more than the bound, and only a
    send that stays blocked (the writer's timeout) marks a consumer as stuck.
    """

    outbox: Outbox
    key: Hashable
    on_end: Optional[Callable[[EndEvent], None]] = None
    replay: Optional[Replay] = None
    stream: Optional["RequestStream"] = None
    delivered_seq: int = 0  # the newest seq the writer has taken for this subscription
    _ended: bool = False

    def push(self, event: Event) -> None:
        if self.replay is not None:
            return  # published into the resume buffer, behind the cursor
        if self.stream is not None and self.outbox.would_overflow(event):
            self.outbox.discard_events(self.key)
            deltas = self.stream.deltas
            self._start(Replay(deltas, bisect.bisect_right(deltas, self.delivered_seq, key=lambda d: d.seq),
                               stream=self.stream))
            return
        self.outbox.push(self.key, event, self)
        self._saw(event)

    def catch_up(self, replay: Replay) -> None:
        self.stream = replay.stream
        self.delivered_seq = replay.start_seq
        if replay.behind:
            self._start(replay)
        # else nothing to replay: live from the start

    def _start(self, replay: Replay) -> None:
        self.replay = replay
        self.outbox.add_replay(self)

    def pull(self) -> Optional[Event]:
        """The next replayed event, or None once caught up (the subscription is then live)."""
        ev = self.replay.next() if self.replay is not None else None
        if ev is None:
            self.replay = None
            return None
        if isinstance(ev, DeltaEvent):
            self.delivered_seq = ev.seq
        self._saw(ev)
        return ev

    def _saw(self, event: Event) -> None:
        # A live end dropped by a fallback to replay comes round again: report it once.
        if isinstance(event, EndEvent) and not self._ended:
            self._ended = True
            if self.on_end is not None:
                self.on_end(event)


class Subscriber(Protocol):
    """What a stream delivers to: live events through `push`, the backlog through `catch_up`."""

    def push(self, event: Event) -> None: ...

    def catch_up(self, replay: Replay) -> None: ...


class RequestStream:
    """One request's events. The resume buffer holds every delta until the registry drops the
    stream (the retention window after its end); after that, resume reads the ledger."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.deltas: list[DeltaEvent] = []
        self.bytes = 0  # the size of `deltas` (DeltaEvent.size), kept as they are added
        self.last_seq = 0
        self.end: Optional[EndEvent] = None
        self.subscribers: list[Subscriber] = []

    @property
    def retained_bytes(self) -> int:
        """What keeping this stream costs: its deltas and, once ended, the stored form of the output
        its end carries (the same content again)."""
        return self.bytes * 2 if self.end is not None and self.end.output is not None else self.bytes

    def publish(self, samples: list[SampleDelta], want_logprobs: bool) -> list[DeltaEvent]:
        """Turn one engine step's sample deltas into seq-numbered events and push them."""
        out: list[DeltaEvent] = []
        for s in samples:
            if not s.token_ids and not s.text and s.finish_reason is None:
                continue
            self.last_seq += 1
            ev = DeltaEvent(self.last_seq, s.index, s.text, list(s.token_ids),
                            list(s.logprobs) if (want_logprobs and s.logprobs) else None,
                            s.finish_reason)
            self.deltas.append(ev)
            self.bytes += ev.size()
            out.append(ev)
        for ev in out:
            for sub in self.subscribers:
                sub.push(ev)
        return out

    def finish(self, end: EndEvent) -> None:
        self.end = end
        subs, self.subscribers = self.subscribers, []
        for sub in subs:
            sub.push(end)

    def attach(self, sub: "Subscriber", after_seq: int = 0) -> None:
        """Replay deltas with seq > after_seq (and the end, if any) at the subscriber's pace, then
        go live. A subscriber of a running stream counts as one from now on (see `detach`)."""
        # Deltas are in seq order: skip the prefix the client already has.
        lo = bisect.bisect_right(self.deltas, after_seq, key=lambda d: d.seq)
        if self.end is None:
            self.subscribers.append(sub)
        sub.catch_up(Replay(self.deltas, lo, stream=self))

    def detach(self, sub: "Subscriber") -> int:
        """Remove a subscriber; returns how many remain."""
        try:
            self.subscribers.remove(sub)
        except ValueError:
            pass
        return len(self.subscribers)


class StreamRegistry:
    """request_id → stream, for live requests, and for ended ones while they fit the retention
    window (`retention_s`) and the retention byte budget (`retention_bytes`).

    Ended streams are kept in the order they ended; since the window is the same for all, the
    oldest is always the next to expire, so one timer (armed for the oldest) serves them all. When
    a new end takes the retained bytes past the budget, the oldest ended streams go at once. A
    dropped stream loses nothing: a resume or an idempotent retry then reads the ledger row.
    `clock` is injectable so a test can move past the window without sleeping (then `sweep()`).
    """

    def __init__(self, retention_s: float, retention_bytes: int = 64 * 1024 * 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.retention_s = retention_s
        self.retention_bytes = retention_bytes
        self.clock = clock
        self._streams: dict[str, RequestStream] = {}
        self._ended: OrderedDict[str, tuple[float, int]] = OrderedDict()  # id → (expiry, bytes)
        self.retained_bytes = 0  # the ended streams' `retained_bytes`, summed
        self._timer: Optional[asyncio.TimerHandle] = None

    def add(self, stream: RequestStream) -> None:
        self._streams[stream.request_id] = stream

    def get(self, request_id: str) -> Optional[RequestStream]:
        return self._streams.get(request_id)

    def __len__(self) -> int:
        return len(self._streams)

    @property
    def ended_count(self) -> int:
        return len(self._ended)

    def live_bytes(self) -> int:
        """The resume buffers of streams that have not ended (bounded by the output budget)."""
        return sum(s.bytes for rid, s in self._streams.items() if rid not in self._ended)

    def ended(self, stream: RequestStream) -> None:
        """Start the retention of an ended stream, within the window and the byte budget."""
        size = stream.retained_bytes
        if self.retention_s <= 0 or size > self.retention_bytes:
            self._streams.pop(stream.request_id, None)
            return
        self._ended[stream.request_id] = (self.clock() + self.retention_s, size)
        self.retained_bytes += size
        while self.retained_bytes > self.retention_bytes:
            self._drop_oldest()
        if self._timer is None:
            self._arm()

    def _drop_oldest(self) -> None:
        rid, (_, size) = self._ended.popitem(last=False)
        self.retained_bytes -= size
        self._streams.pop(rid, None)

    def sweep(self) -> None:
        """Drop every ended stream whose window has passed."""
        now = self.clock()
        while self._ended and next(iter(self._ended.values()))[0] <= now:
            self._drop_oldest()

    def _arm(self) -> None:
        self._timer = None
        if self._ended:
            expiry = next(iter(self._ended.values()))[0]
            self._timer = asyncio.get_running_loop().call_later(max(0.0, expiry - self.clock()), self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.sweep()
        self._arm()

    def clear(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._ended.clear()
        self._streams.clear()
        self.retained_bytes = 0
