"""LLMEngine.step_modes: a loop that holds the step's thread modes (inference mode, batch-invariant
mode, the autotune table) gets the same tokens as steps that enter them one by one, each step then
enters none of them, and a step that finds other modes held still runs in its own."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import server.engine.engine as engine_module
from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.engine.sampling_params import SamplingParams
from server.kernels import autotune, batch_invariant


def _engine(path: Path, **kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(str(path), kv_cache_tokens=4096, block_size=16, max_num_seqs=8,
                                  max_num_batched_tokens=64, **kw))


def _greedy(eng: LLMEngine, hold: bool, seen: list[tuple[bool, bool, object]]) -> list[int]:
    """One greedy request to its end; `seen` gets each step's (inference mode, batch-invariant
    mode, autotune plans) as _step found them."""
    step = eng._step

    def spy() -> Any:
        seen.append((torch.is_inference_mode_enabled(), batch_invariant.enabled(), autotune.active_table()))
        return step()

    eng._step = spy  # type: ignore[method-assign]
    eng.add_request("r", [5, 9, 2, 7, 11, 3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    tokens: list[int] = []

    def run() -> None:
        while eng.has_unfinished_requests():
            for d in eng.step():
                tokens.extend(d.samples[0].token_ids)

    if hold:
        with eng.step_modes():
            run()
    else:
        run()
    return tokens


@pytest.mark.parametrize("deterministic", [False, True])
def test_held_modes_give_the_same_tokens_and_enter_nothing(tiny_model: Callable[..., Path], deterministic: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    eng = _engine(tiny_model("llama"), deterministic=deterministic)
    plans = eng.linear_table.plans if eng.linear_table is not None else None
    entered = {"mode": 0, "active": 0}
    real_mode, real_active = batch_invariant.mode, autotune.active

    def counting(kind: str, real: Any) -> Any:
        def make(*a: Any) -> Any:
            entered[kind] += 1
            return real(*a)
        return make

    monkeypatch.setattr(engine_module.batch_invariant, "mode", counting("mode", real_mode))
    monkeypatch.setattr(engine_module.autotune, "active", counting("active", real_active))
    seen_one: list[tuple[bool, bool, object]] = []
    one_by_one = _greedy(eng, False, seen_one)
    steps = len(seen_one)
    assert entered == {"mode": steps, "active": steps}  # (step_modes below enters each once more)
    seen_held: list[tuple[bool, bool, object]] = []
    held = _greedy(eng, True, seen_held)
    assert held == one_by_one and len(held) == 12
    assert entered == {"mode": steps + 1, "active": steps + 1}
    for _, invariant, table in seen_one + seen_held:
        assert invariant == deterministic and table is plans
    assert all(inference for inference, _, _ in seen_held)


def test_a_step_under_other_modes_runs_in_its_own(tiny_model: Callable[..., Path]) -> None:
    eng = _engine(tiny_model("llama"), deterministic=False)
    seen: list[tuple[bool, bool, object]] = []
    with batch_invariant.mode(True):  # not this engine's mode: the step enters its own
        _greedy(eng, False, seen)
        assert batch_invariant.enabled()  # and leaves the caller's as it found it
    assert seen and all(not invariant for _, invariant, _ in seen)
