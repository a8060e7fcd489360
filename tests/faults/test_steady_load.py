"""Bug 9 of issue 13: memory crept under steady load. What held it was the resume retention (every
stream kept for the whole window, whatever its size) — a cache, not a leak; it is now bounded in
bytes as well as time. This test checks the structural bound: after 200 requests over several
connections (HTTP-like single requests and multiplexed ones, some with logprobs, some cancelled),
once the retention window has passed (an injected clock, no sleeping), every per-request
structure is back to its baseline: no retained stream, no job, no reservation, no admission or
idempotency entry, no connection — and no Job, RequestStream, DeltaEvent or EndEvent object is
left alive anywhere (gc's own count). The RSS curve of a 10,000-request soak is in
bench/RESULTS.md (bench/soak.py)."""
from __future__ import annotations

import asyncio
import gc
import os
import struct
from pathlib import Path

from server.serving.jobs import Job
from server.serving.outbox import Subscription
from server.serving.streams import DeltaEvent, EndEvent, RequestStream
from tests.faults.inproc import FakeSocket, connect, running, until, ws_endpoint

ROUNDS = 5
PER_ROUND = 40  # 200 requests
TRACKED = (Job, RequestStream, DeltaEvent, EndEvent, Subscription)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _alive() -> dict[str, int]:
    gc.collect()
    counts = {t.__name__: 0 for t in TRACKED}
    for o in gc.get_objects():
        if isinstance(o, TRACKED):
            counts[type(o).__name__] += 1
    return counts


def test_per_request_state_returns_to_baseline_after_the_retention_window(demo_model: Path, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(demo_model, tmp_path / "steady.db", stream_retention=300.0) as rt:
            service = rt.service
            assert service is not None and rt.admission is not None and rt.ledger is not None
            clock = Clock()
            service.registry.clock = clock
            ep = ws_endpoint(rt)
            baseline = _alive()

            for r in range(ROUNDS):
                socks = [FakeSocket() for _ in range(4)]
                conns = [connect(ep, s) for s in socks]
                for i in range(PER_ROUND):
                    s = socks[i % 4]
                    params: dict[str, object] = {"max_tokens": 3 + i % 5, "temperature": 0.7, "ignore_eos": True}
                    if i % 3 == 0:
                        params.update(logprobs=True, top_logprobs=3)
                    s.send_frame({"type": "generate", "id": f"g{i}", "prompt": f"steady {r} {i}", "params": params,
                                  **({"idempotency_key": f"k{r}-{i}"} if i % 4 == 0 else {})})
                    if i % 10 == 9:
                        s.send_frame({"type": "cancel", "id": f"g{i}"})
                await until(lambda: sum(f["type"] in ("done", "error") and f.get("id", "").startswith("g")
                                        for s in socks for f in s.frames) == PER_ROUND, "a round")
                for s in socks:
                    s.disconnect()
                await asyncio.gather(*conns)
                clock.now += 10.0

            assert service.registry.ended_count > 0  # the window holds them for now
            clock.now += 301.0  # the window has passed for all of them
            service.registry.sweep()
            await until(lambda: not service._tasks, "terminal commits")
            assert len(service.registry) == 0 and service.registry.ended_count == 0
            assert service.registry.retained_bytes == 0
            assert not service._jobs and not service._claims.pending
            assert service.budget.reserved == 0 and len(service.budget) == 0
            assert not rt.admission._reserved and not rt.admission.in_engine
            assert not ep.connections
            assert _alive() == baseline

    asyncio.run(scenario())


def _resident_fraction(ptr: int, nbytes: int) -> float:
    """The fraction of the pages under [ptr, ptr + nbytes) that are present in RAM (or swapped out):
    /proc/self/pagemap, one 64-bit entry per page, bit 63 present, bit 62 swapped."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = ptr // page, (ptr + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    entries = struct.unpack(f"{len(raw) // 8}Q", raw)
    return sum(1 for e in entries if e >> 62) / len(entries)


def test_the_kv_pool_is_committed_at_start_so_rss_cannot_creep(demo_model: Path) -> None:
    """What did creep (bug 9): the KV pool's pages were committed lazily, as the block allocator
    cycled through blocks it had never used, so RSS rose for thousands of requests. The pool is
    now committed when the engine is built: every page of it is resident before any request.
    (Measured per page, not as an RSS difference, which memory freed by earlier tests blurs.)"""
    from server.engine.config import EngineConfig
    from server.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(demo_model), kv_cache_tokens=32768, max_num_seqs=8, num_threads=1))
    tensors = [t for kv in engine.runner.kv_caches for t in kv]
    assert sum(t.numel() * t.element_size() for t in tensors) >= 64 * 2**20
    for t in tensors:
        assert _resident_fraction(t.data_ptr(), t.numel() * t.element_size()) > 0.99
