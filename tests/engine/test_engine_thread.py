"""EngineThread: thread-safe submit/abort, one on_step batch per step, clean shutdown."""
from __future__ import annotations

import threading
from typing import Optional

import pytest

from server.engine.config import EngineConfig
from server.engine.errors import KVCapacityError, RequestTooLongError
from server.engine.outputs import RequestDelta
from server.engine.sampling_params import SamplingParams
from server.engine.thread import EngineThread


def test_submit_stream_abort_and_shutdown(tiny_model) -> None:
    model_dir = tiny_model("llama")
    batches: list[list[RequestDelta]] = []
    done = threading.Event()
    c_started = threading.Event()
    d_started = threading.Event()
    finished: set[str] = set()

    def on_step(deltas: list[RequestDelta]) -> None:
        assert threading.current_thread().name == "pagewire-engine"
        batches.append(deltas)
        if any(d.request_id == "c" for d in deltas):
            c_started.set()
        if any(d.request_id == "d" for d in deltas):
            d_started.set()
        finished.update(d.request_id for d in deltas if d.finished)
        if {"a", "b", "c"} <= finished:
            done.set()

    et = EngineThread(EngineConfig(model=str(model_dir), max_model_len=512, kv_cache_tokens=2048), on_step)
    et.start()
    assert et.wait_ready(60) and et.max_model_len == 512
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    et.submit("a", [5, 6, 7, 8], greedy)
    et.submit("b", [9, 10, 11], greedy)
    et.submit("c", list(range(5, 60)), SamplingParams(temperature=0.0, max_tokens=440, ignore_eos=True))
    assert c_started.wait(60)
    et.abort("c")  # mid-generation: 440 tokens take far longer than this hop
    with pytest.raises(RequestTooLongError, match="max_model_len"):
        et.submit("too-long", list(range(5, 200)), greedy.clone(max_tokens=400))
    assert done.wait(60)
    by_id: dict[str, list[RequestDelta]] = {}
    for batch in batches:
        ids = [d.request_id for d in batch]
        assert len(ids) == len(set(ids)), "one delta per request per step"
        for d in batch:
            by_id.setdefault(d.request_id, []).append(d)
    assert sum(len(s.token_ids) for d in by_id["a"] for s in d.samples) == 8
    assert by_id["a"][-1].samples[-1].finish_reason == "length"
    assert by_id["c"][-1].samples[-1].finish_reason == "abort"
    stats = et.stats()
    assert stats.num_running == 0 and stats.generation_tokens >= 16
    # A request still running at shutdown gets an abort delta.
    et.submit("d", [5, 6], SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
    assert d_started.wait(60)
    et.shutdown(10)
    last = [d for b in batches for d in b if d.request_id == "d"]
    assert last and last[-1].finished and last[-1].samples[-1].finish_reason == "abort"
    with pytest.raises(RuntimeError, match="shutting down"):
        et.submit("e", [5], greedy)


def test_load_failure_is_reported_not_raised(tmp_path) -> None:
    et = EngineThread(EngineConfig(model=str(tmp_path / "missing")), lambda d: None)
    et.start()
    assert not et.wait_ready(30)
    assert isinstance(et.error, FileNotFoundError) and "missing" in str(et.error)


class _RecordingEvent(threading.Event):
    """An Event that records the timeout of every wait (None: blocks until set)."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[Optional[float]] = []

    def wait(self, timeout: Optional[float] = None) -> bool:
        self.timeouts.append(timeout)
        return super().wait(timeout)


def test_idle_engine_thread_blocks_instead_of_polling(tiny_model) -> None:
    model_dir = tiny_model("llama")
    done = threading.Event()
    steps: list[int] = []

    def on_step(deltas: list[RequestDelta]) -> None:
        steps.append(len(deltas))
        if any(d.finished for d in deltas):
            done.set()

    et = EngineThread(EngineConfig(model=str(model_dir), max_model_len=64, kv_cache_tokens=64), on_step)
    wake = _RecordingEvent()
    et._wake = wake  # observe how the loop waits
    et.start()
    assert et.wait_ready(60)
    # 4 blocks of 16 minus a 1-block watermark: 55 + 9 tokens fit max_model_len but need 4 blocks,
    # so the request could never be admitted. It is refused on the caller's thread, naming the
    # limit, instead of being queued to spin.
    with pytest.raises(KVCapacityError, match="at most 3 .*watermark of 1"):
        et.submit("huge", list(range(5, 60)), SamplingParams(max_tokens=9))
    et.submit("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert done.wait(60)
    et.shutdown(10)
    # Every wait blocked without a timeout: an idle thread sleeps until a message or shutdown
    # wakes it. One submit and one shutdown wake it at most twice, plus the wait it started in.
    assert wake.timeouts and all(t is None for t in wake.timeouts)
    assert len(wake.timeouts) <= 3
    assert len(steps) <= 4  # three tokens (the first with the prefill), one delta batch each


def test_a_step_that_schedules_nothing_does_not_freeze_running_requests(tiny_model) -> None:
    # Issue 13, bug 1: the thread used to wait for the next message after a step that scheduled
    # nothing. During a graceful drain no message comes (nothing new is admitted), so a liveness
    # bug froze every stream until the grace ran out. Now it steps again by itself.
    model_dir = tiny_model("llama")
    done = threading.Event()

    def on_step(deltas: list[RequestDelta]) -> None:
        if any(d.request_id == "a" and d.finished for d in deltas):
            done.set()

    et = EngineThread(EngineConfig(model=str(model_dir), max_model_len=64, kv_cache_tokens=256), on_step)
    et.start()
    assert et.wait_ready(60)
    engine = et._engine
    assert engine is not None
    real_step = engine.step
    empty_steps = 0

    def step() -> list[RequestDelta]:
        nonlocal empty_steps
        if empty_steps < 3:  # the first three steps with the request pending schedule nothing
            empty_steps += 1
            engine.last_step_progressed = False
            return []
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    et.submit("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    try:
        assert done.wait(120), "the request froze after a step that scheduled nothing"
        assert empty_steps == 3
    finally:
        et.shutdown(10)
