"""EngineThread: thread-safe submit/abort, one on_step batch per step, clean shutdown."""
from __future__ import annotations

import threading

import pytest

from server.engine.config import EngineConfig
from server.engine.errors import RequestTooLongError
from server.engine.thread import EngineThread
from server.engine.outputs import RequestDelta
from server.engine.sampling_params import SamplingParams


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
