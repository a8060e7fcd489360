"""The CPU thread count following the cores' load (server.engine.thread_governor): the policy on
given step times and a clock the test moves, then its wiring into the engine and the options."""
from __future__ import annotations

import argparse
import threading
from typing import Any, Callable

import pytest
import torch

from server.engine.config import ConfigError, EngineConfig
from server.engine.engine import LLMEngine
from server.engine.sampling_params import SamplingParams
from server.engine.thread_governor import (
    EXPLORE_AFTER,
    EXPLORE_FIRST_S,
    EXPLORE_S,
    HOLD_S,
    MAX_HOLD_S,
    PROBE_GIVE_UP,
    PROBE_STEPS,
    SLOW,
    STRIKES,
    ThreadGovernor,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _governor(threads: int = 2) -> tuple[ThreadGovernor, Clock]:
    clock = Clock()
    return ThreadGovernor(threads, clock), clock


def _steps(g: ThreadGovernor, n: int, seconds: Callable[[int], float], rows: int = 1) -> list[int]:
    """n decode-only steps, each `seconds(threads it ran on)` long; the counts they ran on."""
    ran = []
    for _ in range(n):
        t = g.threads_for(rows, 0)
        ran.append(t)
        g.observe(rows, 0, seconds(t))
    return ran


def _crowd(threads: int) -> float:
    """One busy process beside a 2-thread step: 7 ms alone, 100 ms crowded on 2 threads, 12 on 1."""
    return 0.100 if threads == 2 else 0.012


def _crowded_onto_one(g: ThreadGovernor) -> None:
    _steps(g, 20, lambda t: 0.007)
    _steps(g, STRIKES + PROBE_STEPS, _crowd)
    assert (g.threads, g.switches) == (1, 1)


def test_quiet_steps_and_their_noise_keep_the_count() -> None:
    g, _ = _governor()
    times = [0.007, 0.0072, 0.0069, 0.012, 0.007, 0.0135, 0.007]  # lone spikes under SLOW x best
    ran = [t for i in range(200) for t in _steps(g, 1, lambda _: times[i % len(times)])]
    assert set(ran) == {2} and (g.threads, g.switches) == (2, 0)


def test_a_crowd_moves_the_steps_to_one_thread_where_that_is_faster() -> None:
    g, _ = _governor()
    _steps(g, 20, lambda t: 0.007)
    assert set(_steps(g, STRIKES, _crowd)) == {2}  # the third crowded step makes a probe
    assert g.threads == 2
    assert _steps(g, PROBE_STEPS, _crowd) == [1] * PROBE_STEPS  # the probe's steps run on one thread
    assert (g.threads, g.switches) == (1, 1)
    assert set(_steps(g, 30, _crowd)) == {1}  # held there (the clock has not moved)


def test_a_probe_runs_only_decode_only_steps_of_a_row_count_it_can_compare() -> None:
    g, _ = _governor()
    _steps(g, 20, lambda t: 0.007)
    _steps(g, STRIKES, _crowd)
    # Mid-probe, a prefill chunk, a mixed step and a decode of another batch size keep both threads.
    assert (g.threads_for(0, 128), g.threads_for(1, 40), g.threads_for(3, 0)) == (2, 2, 2)
    for d, p in ((0, 128), (1, 40), (3, 0)):
        g.observe(d, p, 0.3)
    assert g.threads_for(1, 0) == 1
    g.observe(1, 0, 0.012)
    _steps(g, PROBE_STEPS - 1, _crowd)
    assert g.threads == 1


def test_steps_that_grew_slower_by_their_work_keep_the_count_and_reset_the_best() -> None:
    g, _ = _governor()
    _steps(g, 20, lambda t: 0.007)
    # Contexts grew (or the host slowed alike for every count): 2.5x on two threads, one 1.7x that.
    slower = lambda t: 0.0175 if t == 2 else 0.0175 * 1.7  # noqa: E731
    # Probed after the strikes, and the first probe step (1.7x its reference, over ABORT) ended it.
    assert _steps(g, STRIKES + 1, slower) == [2] * STRIKES + [1]
    assert set(_steps(g, 100, slower)) == {2}  # the slower time is the shape's best now: no new probe
    assert g.switches == 0


def test_a_probe_that_wins_by_less_than_the_margin_goes_back() -> None:
    g, _ = _governor()
    _steps(g, 20, lambda t: 0.007)
    near = lambda t: 0.030 if t == 2 else 0.027  # noqa: E731  one thread 0.9x: within WIN, no switch
    assert _steps(g, STRIKES + PROBE_STEPS + 1, near) == [2] * STRIKES + [1] * PROBE_STEPS + [2]
    assert (g.threads, g.switches) == (2, 0)


def test_when_the_crowd_leaves_the_count_goes_back_after_the_hold() -> None:
    g, clock = _governor()
    _crowded_onto_one(g)
    quiet = lambda t: 0.007 if t == 2 else 0.011  # noqa: E731
    assert set(_steps(g, 10, quiet)) == {1}  # not before the hold
    clock.t += HOLD_S
    assert _steps(g, PROBE_STEPS, quiet) == [2] * PROBE_STEPS
    assert (g.threads, g.switches) == (2, 2)
    assert set(_steps(g, 100, quiet)) == {2}


def test_a_crowd_that_stays_doubles_the_hold_up_to_its_cap_and_each_try_costs_one_step() -> None:
    g, clock = _governor()
    _crowded_onto_one(g)
    _steps(g, 5, _crowd)  # references on one thread
    hold = HOLD_S
    for _ in range(6):
        clock.t += hold
        assert _steps(g, 3, _crowd) == [2, 1, 1]  # one step on two threads, ABORT x its reference
        hold = min(MAX_HOLD_S, hold * 2)
        clock.t += hold * 0.9
        assert set(_steps(g, 3, _crowd)) == {1}  # not yet: the hold doubled
        clock.t -= hold * 0.9
    assert (g.threads, g.switches, hold) == (1, 1, MAX_HOLD_S)


def test_a_crowd_there_from_the_start_is_found_by_the_probe_on_the_clock() -> None:
    g, clock = _governor()
    _steps(g, 50, _crowd)  # crowded from the first step: the best is the crowded time, no strikes
    assert g.switches == 0
    clock.t += EXPLORE_FIRST_S
    assert _steps(g, PROBE_STEPS, _crowd) == [1] * PROBE_STEPS
    assert (g.threads, g.switches) == (1, 1)


def test_the_probe_on_the_clock_costs_a_quiet_engine_one_step_each_time() -> None:
    g, clock = _governor()
    quiet = lambda t: 0.007 if t == 2 else 0.013  # noqa: E731
    _steps(g, EXPLORE_AFTER - 1, quiet)
    clock.t += EXPLORE_FIRST_S
    assert set(_steps(g, 1, quiet)) == {2}  # not before EXPLORE_AFTER decode-only steps
    on_one = 0
    for i in range(5):
        clock.t += 0 if i == 0 else EXPLORE_S
        on_one += _steps(g, 10, quiet).count(1)
    assert on_one == 5 and (g.threads, g.switches) == (2, 0)
    assert set(_steps(g, 20, quiet)) == {2}  # nothing more until the next EXPLORE_S


def test_prefill_steps_and_empty_steps_are_not_compared() -> None:
    g, _ = _governor()
    _steps(g, 20, lambda t: 0.007)
    for _ in range(50):
        assert g.threads_for(1, 200) == 2
        g.observe(1, 200, 0.5)  # a decode beside a 200-token prefill chunk: a different shape
        g.observe(0, 64, 0.3)
        g.observe(0, 0, 0.3)
    assert g.switches == 0 and set(_steps(g, 5, lambda t: 0.007)) == {2}


def test_each_row_count_has_its_own_best() -> None:
    g, _ = _governor()
    _steps(g, 20, lambda t: 0.007, rows=1)
    _steps(g, 20, lambda t: 0.020, rows=8)  # batch 8: nearly 3x a batch-1 step, not a crowd
    ran = []
    for _ in range(20):
        ran += _steps(g, 1, lambda t: 0.007, rows=1) + _steps(g, 1, lambda t: 0.020, rows=8)
    assert set(ran) == {2} and g.switches == 0


def test_one_cold_step_is_no_reference() -> None:
    g, clock = _governor()
    _steps(g, EXPLORE_AFTER, lambda t: 0.007, rows=2)
    g.observe(5, 0, 0.070)  # the first step of 5 rows: cold, 7x a settled one (seen in serving)
    clock.t += EXPLORE_FIRST_S
    # The probe on the clock has only 2-row references: the 5-row steps keep both threads, and it
    # ends inconclusive (the cold step as a reference would have read one thread at 0.24x).
    assert set(_steps(g, PROBE_GIVE_UP + 20, lambda t: 0.010 if t == 2 else 0.017, rows=5)) == {2}
    assert (g.threads, g.switches) == (2, 0)


def test_an_inconclusive_try_keeps_the_hold() -> None:
    g, clock = _governor()
    _crowded_onto_one(g)
    _steps(g, 5, _crowd)
    clock.t += HOLD_S
    ran = [t for i in range(PROBE_GIVE_UP) for t in _steps(g, 1, _crowd, rows=2 + i % 5)]
    assert set(ran) == {1}  # a probe of two threads, but no step of a row count it can compare
    clock.t += HOLD_S  # the hold did not double: an inconclusive try is no lost one
    assert _steps(g, 1, _crowd) == [2]


def test_a_slow_rise_with_the_context_never_probes() -> None:
    g, _ = _governor()
    t = 0.007
    ran = []
    for _ in range(2000):
        ran += _steps(g, 1, lambda _: t)
        t *= 1.0015  # 20x over the run, under DRIFT per step
    assert set(ran) == {2} and t / 0.007 > 10 * SLOW / 2


def test_more_threads_halve_a_level_at_a_time() -> None:
    g, _ = _governor(8)
    _steps(g, 20, lambda t: 0.010)
    _steps(g, STRIKES + PROBE_STEPS, lambda t: 0.100 if t == 8 else 0.015)
    assert (g.threads, g.switches) == (4, 1)
    with pytest.raises(ValueError, match="threads"):
        ThreadGovernor(0)


# -- the engine -------------------------------------------------------------------------------------

def _generate(engine: LLMEngine, before_step: Callable[[int], None]) -> tuple[dict[str, list[int]], list[int]]:
    """Three greedy requests stepped to the end on a thread of their own (as the serving engine
    thread does); before_step(i) runs before step i there. Returns the tokens and, per step, the
    stepping thread's torch thread count in each step's forward."""
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 9, 13, 21], sp)
    counts: list[int] = []
    after: set[int] = set()
    tokens: dict[str, list[int]] = {}
    def counted(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            counts.append(torch.get_num_threads())
            return inner(*args, **kwargs)
        return forward

    for name in ("execute", "execute_greedy"):  # the forward, where the step's count applies
        setattr(engine.runner, name, counted(getattr(engine.runner, name)))

    def run() -> None:
        while engine.has_unfinished_requests():
            before_step(len(counts))
            for d in engine.step():
                for s in d.samples:
                    tokens.setdefault(d.request_id, []).extend(s.token_ids)
            after.add(torch.get_num_threads())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert after == {2} and len(counts) > 1  # the engine's count again between steps
    return tokens, counts


def test_the_engine_reports_decode_steps_and_steps_on_the_count_it_sets(tiny_model) -> None:
    model_dir = str(tiny_model("llama"))
    before = torch.get_num_threads()
    try:
        engine = LLMEngine(EngineConfig(model=model_dir, max_model_len=256, kv_cache_tokens=2048, num_threads=2))
        g = engine.thread_governor
        assert g is not None and g.full == 2
        seen: list[tuple[int, int]] = []
        observe = g.observe
        g.observe = lambda d, p, s: (seen.append((d, p)), observe(d, p, s))[1]  # type: ignore[method-assign]

        def switch_at_step_2(i: int) -> None:
            if i == 2:  # what a won probe leaves; then no retry in this test
                g.threads = 1
                g.switches += 1
                g._retry_at = float("inf")

        tokens, counts = _generate(engine, switch_at_step_2)
        assert counts[:2] == [2, 2] and set(counts[2:]) == {1}
        assert seen[0] == (0, 12) and set(seen[1:]) == {(3, 0)}  # one prefill step, then 3-row decodes
        stats = engine.stats()
        assert (stats.cpu_threads, stats.cpu_thread_switches) == (1, 1)
        # The count changes no token (docs/determinism.md: the kernels split by output rows).
        fixed = LLMEngine(EngineConfig(model=model_dir, max_model_len=256, kv_cache_tokens=2048, num_threads=2,
                                       adapt_threads=False))
        assert fixed.thread_governor is None and fixed.stats().cpu_threads == 0
        want, fixed_counts = _generate(fixed, lambda i: None)
        assert set(fixed_counts) == {2} and tokens == want and all(len(v) == 6 for v in want.values())
    finally:
        torch.set_num_threads(before)


def test_options_and_where_the_governor_is_off(tiny_model) -> None:
    from server.serving.settings import add_serve_arguments, settings_from_args

    with pytest.raises(ConfigError, match="^adapt_threads:"):
        EngineConfig(model="/m", adapt_threads="yes")  # type: ignore[arg-type]
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert settings_from_args(p.parse_args([]), {}).engine_config("/m").adapt_threads is None
    assert settings_from_args(p.parse_args(["--adapt-threads", "off"]), {}).engine_config("/m").adapt_threads is False
    assert settings_from_args(p.parse_args([]), {"PAGEWIRE_ADAPT_THREADS": "on"}).adapt_threads is True
    before = torch.get_num_threads()
    try:
        model_dir = str(tiny_model("llama"))
        assert LLMEngine(EngineConfig(model=model_dir, max_model_len=64, num_threads=2,
                                      adapt_threads=False)).thread_governor is None
        assert LLMEngine(EngineConfig(model=model_dir, max_model_len=64, num_threads=1)).thread_governor is None
    finally:
        torch.set_num_threads(before)
