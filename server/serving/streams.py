"""Streams: seq-numbered per-request events, the resume buffer, paced replays, the byte size model
of output held in memory, and the registry that keeps ended streams for resume.

Everything here runs on the event loop and never blocks: a producer (the bridge, once per engine
step) appends to a `RequestStream`, which pushes each event to its subscribers (a connection's
`server.serving.outbox.Subscription`, or a waiter that wants only the end).

Replays are paced by the consumer, not pushed: a subscriber that attaches after some output exists
(a resume, an idempotent retry) gets a `Replay` cursor over the stream's resume buffer (or over
the output rebuilt from the ledger), which its writer reads only as fast as its socket drains.
Live events published meanwhile land in the same resume buffer, behind the cursor, so a
multi-megabyte replay never has to be queued anywhere.

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
from typing import Any, Callable, Optional, Protocol, Sequence, Union

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
    reasoning_tokens: int = 0  # of completion_tokens, those inside the reasoning block

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class DeltaEvent:
    """New output of one sample: text, token ids, optional logprobs; finish_reason on its last.
    With a reasoning parser (server.text.reasoning), `text` is the answer and `reasoning` the
    thinking; `token_ids` and `logprobs` cover both."""

    seq: int
    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[TokenLogprob]] = None
    finish_reason: Optional[str] = None
    reasoning: str = ""

    def size(self) -> int:
        """Bytes this delta holds in memory (see the constants above: a model, close to CPython's)."""
        return DELTA_BYTES + (len(self.text) + len(self.reasoning)) * CHAR_BYTES + TOKEN_BYTES * len(self.token_ids) + (
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
        if later.reasoning:
            self.reasoning += later.reasoning
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


class Subscriber(Protocol):
    """What a stream delivers to: live events through `push`, the backlog through `catch_up`."""

    def push(self, event: Event) -> None: ...

    def catch_up(self, replay: Replay) -> None: ...


class EndWaiter:
    """A subscriber that only wants the end of a request (non-streamed responses, batch lines)."""

    def __init__(self) -> None:
        self.future: asyncio.Future[EndEvent] = asyncio.get_running_loop().create_future()

    def push(self, event: Event) -> None:
        if isinstance(event, EndEvent) and not self.future.done():
            self.future.set_result(event)

    def catch_up(self, replay: Replay) -> None:
        for ev in replay.drain():  # only the end matters here, and it is at most one event away
            self.push(ev)

    def cancel(self) -> None:
        if not self.future.done():
            self.future.cancel()


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

    def publish(self, samples: list[SampleDelta], want_logprobs: bool,
                reasoning: Optional[dict[int, str]] = None) -> list[DeltaEvent]:
        """Turn one engine step's sample deltas into seq-numbered events and push them;
        `reasoning` is each sample's thinking text of this step (its `text` the answer)."""
        out: list[DeltaEvent] = []
        for s in samples:
            thought = reasoning.get(s.index, "") if reasoning else ""
            if not s.token_ids and not s.text and not thought and s.finish_reason is None:
                continue
            self.last_seq += 1
            ev = DeltaEvent(self.last_seq, s.index, s.text, list(s.token_ids),
                            list(s.logprobs) if (want_logprobs and s.logprobs) else None,
                            s.finish_reason, thought)
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
