"""Outboxes: the bounded, coalescing buffer between a connection's streams and its one writer, and
the subscriptions that feed it.

Everything here runs on the event loop and never blocks. A `RequestStream` pushes each event into
its subscribers; a `Subscription` puts it in its connection's `Outbox`, and the connection's writer
task drains the outbox at the pace of its socket. While the socket is slow, consecutive deltas of
one sample merge in the outbox (a merged delta carries the seq of its newest part).

A subscription that is catching up (a resume, an idempotent retry) holds a `Replay` cursor
(`server.serving.streams`) instead of queued events, and the writer pulls the next chunk of it
only when it has sent the previous one. Once the cursor reaches the end of the buffer, the
subscription goes live in the same synchronous step.

The outbox's byte bound counts only the backlog that builds up while the writer is busy with a
send (what arrives while it waits is taken at once). A live subscription whose next event would
cross the bound does not grow the outbox: it drops its pending events and catches up from the
resume buffer, as a resume would. So a connection never holds more than its bound however slowly
its client reads; a client that stops reading altogether is found by the writer's send timeout,
and its connection is closed with a resumable error (the client resumes from the last seq it
saw). `overflowed` remains for items with no stream behind them (control frames).
"""
from __future__ import annotations

import asyncio
import bisect
from dataclasses import dataclass
from typing import Callable, Hashable, Optional

from server.serving.streams import DELTA_BYTES, DeltaEvent, EndEvent, Event, Replay, RequestStream

# What an outbox carries: events, and the edge's own control frames (opaque here, 64 bytes each).
Queued = object


# How much of one replay the writer takes per turn: small enough that a replaying socket does not
# hold up the connection's live frames for long, large enough that frames stay big.
REPLAY_CHUNK_BYTES = 64 * 1024


def _copy(ev: DeltaEvent) -> DeltaEvent:
    """A private copy for merging: the stream's resume buffer must not see a connection's merges."""
    return DeltaEvent(ev.seq, ev.index, ev.text, list(ev.token_ids),
                      list(ev.logprobs) if ev.logprobs is not None else None, ev.finish_reason, ev.reasoning)


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
