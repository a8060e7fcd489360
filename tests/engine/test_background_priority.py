"""Background work (priority >= BACKGROUND_PRIORITY, the batch tier) runs only in steps with no
foreground work, and is what gets preempted when a foreground request needs room."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.engine.priority import BACKGROUND_PRIORITY
from server.engine.sampling_params import SamplingParams


def _engine(path: Path, **kw: int) -> LLMEngine:
    return LLMEngine(EngineConfig(str(path), kv_cache_tokens=kw.pop("kv", 2048), max_num_seqs=kw.pop("seqs", 8),
                                  max_num_batched_tokens=64, **kw))


def test_background_sits_out_foreground_steps(tiny_model: Callable[..., Path]) -> None:
    eng = _engine(tiny_model("llama"))
    p = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    eng.add_request("bg", list(range(5, 25)), p, priority=BACKGROUND_PRIORITY)
    for _ in range(3):
        eng.step()
    bg = eng.requests["bg"].sequences[0]
    assert bg.num_output_tokens >= 1  # idle steps: it runs
    eng.add_request("fg", list(range(30, 50)), p, priority=0)
    fg = eng.requests["fg"].sequences[0]
    frozen = bg.num_computed_tokens
    while "fg" in eng.requests and not fg.is_finished:
        eng.step()
        if not fg.is_finished:
            assert bg.num_computed_tokens == frozen  # not scheduled while the foreground one lives
    assert fg.num_output_tokens == 12
    while "bg" in eng.requests and not bg.is_finished:
        eng.step()
    assert bg.num_output_tokens == 12  # and it completes once the engine is idle again


def test_background_is_preempted_for_a_foreground_seat(tiny_model: Callable[..., Path]) -> None:
    eng = _engine(tiny_model("llama"), seqs=2)
    p = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
    eng.add_request("bg0", list(range(5, 15)), p, priority=BACKGROUND_PRIORITY)
    eng.add_request("bg1", list(range(15, 25)), p, priority=BACKGROUND_PRIORITY)
    eng.step()
    assert len(eng.scheduler.running) == 2
    eng.add_request("fg", list(range(30, 40)), SamplingParams(max_tokens=4, ignore_eos=True), priority=0)
    eng.step()
    running = {s.request.request_id for s in eng.scheduler.running}
    assert "fg" in running and len(running) == 2
    assert eng.scheduler.num_preemptions == 1
