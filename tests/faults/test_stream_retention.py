"""Stream retention is bounded in time and in bytes (issue 13, bugs 6 and 9): ended streams go,
oldest first, when the window passes or when their bytes pass the budget, and nothing of them
stays behind. Driven by an injected clock: no sleeping."""
from __future__ import annotations

import asyncio

from server.engine.outputs import SampleDelta
from server.serving.lifecycle import EndReason
from server.serving.streams import EndEvent, RequestStream, StreamRegistry, Usage


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _ended_stream(rid: str, tokens: int) -> RequestStream:
    st = RequestStream(rid)
    for i in range(tokens):
        st.publish([SampleDelta(index=0, text="tok ", token_ids=[i])], want_logprobs=False)
    st.finish(EndEvent(rid, EndReason.FINISHED, ["length"], Usage(3, tokens), st.last_seq,
                       output={"samples": [], "last_seq": st.last_seq}))
    return st


def test_ended_streams_leave_by_window_and_by_bytes_oldest_first() -> None:
    async def scenario() -> None:
        clock = Clock()
        one = _ended_stream("probe", 10).retained_bytes
        reg = StreamRegistry(retention_s=300.0, retention_bytes=3 * one, clock=clock)
        for i in range(3):
            st = _ended_stream(f"r{i}", 10)
            reg.add(st)
            reg.ended(st)
            clock.now += 10
        assert reg.ended_count == 3 and reg.retained_bytes == 3 * one
        st = _ended_stream("r3", 10)
        reg.add(st)
        reg.ended(st)  # past the byte budget: the oldest goes now
        assert [reg.get(f"r{i}") is not None for i in range(4)] == [False, True, True, True]
        assert reg.retained_bytes == 3 * one
        live = RequestStream("live")
        reg.add(live)
        big = _ended_stream("big", 1000)  # larger than the budget alone: not kept at all
        reg.add(big)
        reg.ended(big)
        assert reg.get("big") is None and reg.retained_bytes == 3 * one

        clock.now += 300 - 20 + 0.5  # r1 (ended at t+10) has passed its window; r2, r3 have not
        reg.sweep()
        assert [reg.get(f"r{i}") is not None for i in range(1, 4)] == [False, True, True]
        clock.now += 1000
        reg.sweep()
        # Back to baseline: only the live stream is left, and nothing is counted for ended ones.
        assert len(reg) == 1 and reg.get("live") is live
        assert reg.ended_count == 0 and reg.retained_bytes == 0
        reg.clear()

    asyncio.run(scenario())


def test_zero_retention_keeps_nothing() -> None:
    async def scenario() -> None:
        reg = StreamRegistry(retention_s=0.0)
        st = _ended_stream("r", 5)
        reg.add(st)
        reg.ended(st)
        assert len(reg) == 0 and reg.retained_bytes == 0

    asyncio.run(scenario())
