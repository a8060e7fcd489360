"""Streams: seq-numbered per-request events, the resume buffer, and bounded coalescing outboxes.

Everything here runs on the event loop and never blocks: a producer (the bridge, once per engine
step) appends to a `RequestStream`, which pushes into each subscriber's `Outbox`; a writer task
per connection drains its outbox at the pace of its socket. A slow socket therefore only grows
its own outbox, where consecutive deltas of one sample are merged into one (same seq semantics:
a merged delta carries the seq of its newest part). An outbox that still exceeds its byte bound
is marked `overflowed` (replays, which arrive in one burst by design, do not count); its owner closes the connection with a resumable error, and the client
resumes from the last seq it saw, which the stream's resume buffer still holds.

Sequence numbers: every delta of a request gets the next integer, starting at 1, across all its
samples. `attach(after_seq=k)` replays exactly the deltas with seq > k, then goes live; since
replay and registration happen in one synchronous call on the loop, no delta published in
between can be missed or duplicated.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Union

from server.engine.outputs import SampleDelta, TokenLogprob


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
        return 64 + len(self.text) * 2 + 8 * len(self.token_ids) + (
            48 * sum(1 + len(lp.top) for lp in self.logprobs) if self.logprobs else 0
        )

    def absorb(self, later: "DeltaEvent") -> None:
        """Coalesce a later delta of the same sample into this one."""
        self.seq = later.seq
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finish_reason = later.finish_reason


@dataclass(slots=True)
class EndEvent:
    """The one terminal event of a request, sent after its ledger row is committed.

    `state` is the ledger state: finished and cancelled render as `done`; failed and
    interrupted as an error carrying `code` and `message`.
    """

    request_id: str
    state: str
    finish_reasons: list[Optional[str]]
    usage: Usage
    last_seq: int
    code: Optional[str] = None
    message: Optional[str] = None
    output: Optional[dict[str, Any]] = None  # the stored output (text, tokens, logprobs, marks)

    @property
    def finish_reason(self) -> Optional[str]:
        return self.finish_reasons[0] if self.finish_reasons else None


Event = Union[DeltaEvent, EndEvent]


class Outbox:
    """A bounded buffer of events for one writer (a WebSocket, or one SSE response).

    Keys name the stream an event belongs to on this connection (the client's id for it).
    Pending events of different keys keep their first-arrival order; within a key, order is
    preserved and consecutive deltas of the same sample are merged.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._pending: dict[Hashable, list[Event]] = {}
        self._bytes = 0
        # Bytes pushed live since the writer last took the buffer. Only these count against
        # max_bytes: a replay (resume, idempotent retry) arrives all at once by design and says
        # nothing about the consumer's speed; it is bounded by the request's own output.
        self._live_bytes = 0
        self._wake = asyncio.Event()
        self.overflowed = False
        self.closed = False

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def push(self, key: Hashable, event: Event, replay: bool = False) -> None:
        if self.closed or self.overflowed:
            return  # the client will resume from its last seq; the stream still has these
        items = self._pending.setdefault(key, [])
        before = self._bytes
        if isinstance(event, DeltaEvent):
            last = items[-1] if items else None
            if isinstance(last, DeltaEvent) and last.index == event.index and last.finish_reason is None:
                size = last.size()
                last.absorb(event)
                self._bytes += last.size() - size
            else:
                # Copy: the stream's resume buffer must not see this connection's merges.
                items.append(DeltaEvent(event.seq, event.index, event.text, list(event.token_ids),
                                        list(event.logprobs) if event.logprobs is not None else None,
                                        event.finish_reason))
                self._bytes += event.size()
        else:
            items.append(event)
            self._bytes += 64
        if not replay:
            self._live_bytes += self._bytes - before
            if self._live_bytes > self.max_bytes:
                self.overflowed = True
        self._wake.set()

    def take(self) -> list[tuple[Hashable, Event]]:
        """Everything pending, in order, emptying the buffer (non-blocking)."""
        out = [(k, e) for k, items in self._pending.items() for e in items]
        self._pending.clear()
        self._bytes = 0
        self._live_bytes = 0
        self._wake.clear()
        return out

    async def get(self) -> list[tuple[Hashable, Event]]:
        """Wait for events; returns [] once closed (or overflowed) with nothing left to send."""
        while not self._pending and not self.closed and not self.overflowed:
            await self._wake.wait()
            self._wake.clear()
        if self.overflowed:
            return []
        return self.take()

    def close(self) -> None:
        """Wake the writer; it sends what is pending, then stops. Idempotent."""
        self.closed = True
        self._wake.set()


@dataclass(eq=False)
class Subscription:
    """One consumer of one stream: events go to `outbox` under `key`."""

    outbox: Outbox
    key: Hashable
    on_end: Optional[Callable[[EndEvent], None]] = None

    def push(self, event: Event, replay: bool = False) -> None:
        self.outbox.push(self.key, event, replay)
        if isinstance(event, EndEvent) and self.on_end is not None:
            self.on_end(event)


class RequestStream:
    """One request's events. The resume buffer holds every delta until the registry drops the
    stream (the retention window after its end); after that, resume reads the ledger."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.deltas: list[DeltaEvent] = []
        self.last_seq = 0
        self.end: Optional[EndEvent] = None
        self.subscribers: list[Subscription] = []

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

    def attach(self, sub: Subscription, after_seq: int = 0) -> None:
        """Replay deltas with seq > after_seq (and the end, if any), then go live."""
        # Deltas are in seq order: skip the prefix the client already has.
        lo = 0
        hi = len(self.deltas)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.deltas[mid].seq <= after_seq:
                lo = mid + 1
            else:
                hi = mid
        for ev in self.deltas[lo:]:
            sub.push(ev, replay=True)
        if self.end is not None:
            sub.push(self.end, replay=True)
        else:
            self.subscribers.append(sub)

    def detach(self, sub: Subscription) -> int:
        """Remove a subscriber; returns how many remain."""
        try:
            self.subscribers.remove(sub)
        except ValueError:
            pass
        return len(self.subscribers)


@dataclass
class StreamRegistry:
    """request_id → stream, for live requests and for `retention_s` after they end."""

    retention_s: float
    _streams: dict[str, RequestStream] = field(default_factory=dict)
    _timers: dict[str, Any] = field(default_factory=dict)

    def add(self, stream: RequestStream) -> None:
        self._streams[stream.request_id] = stream

    def get(self, request_id: str) -> Optional[RequestStream]:
        return self._streams.get(request_id)

    def __len__(self) -> int:
        return len(self._streams)

    def ended(self, stream: RequestStream) -> None:
        """Start the retention window of an ended stream."""
        loop = asyncio.get_running_loop()
        self._timers[stream.request_id] = loop.call_later(self.retention_s, self._drop, stream.request_id)

    def _drop(self, request_id: str) -> None:
        self._timers.pop(request_id, None)
        self._streams.pop(request_id, None)

    def clear(self) -> None:
        for t in self._timers.values():
            t.cancel()
        self._timers.clear()
        self._streams.clear()
