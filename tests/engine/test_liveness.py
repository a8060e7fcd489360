"""Liveness: a request is refused at add_request, naming the limit, or it finishes; no empty steps.

The property test drives a real LLMEngine (tiny random model) through random KV pools, block
sizes, max_model_len, budgets, prompt and output lengths, `n`, arrival steps, aborts and
priorities. It checks, independently of the engine's own check:
- a request is refused exactly when the test's capacity rule says it can never be scheduled
  (context, n > max_num_seqs, or one sample at its longest outgrowing the pool minus the
  watermark), and the error names that limit;
- every step taken with unfinished requests schedules at least one token;
- every accepted request ends (finished delta) within a bound on steps computed below, and the
  KV pool is whole afterwards.

The bound: after the last arrival, the best-ordered unfinished sample H is never preempted (only
later samples are victims, and it fits the pool alone). Each step either advances H by a token,
advances some running sample's decode by one token (at most the total output, O), or, while H
waits, advances the best-ordered running sample, which is not preempted either. So H finishes
within sum(L) + O steps, where L is each sample's longest length, and the K samples within
K * (sum(L) + O) steps after the last arrival.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server import LLM, SamplingParams
from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.engine.errors import KVCapacityError, RequestTooLongError
from server.engine.scheduler import SchedulerOutput


@dataclass
class Arrival:
    rid: str
    step: int
    prompt: list[int]
    max_tokens: Optional[int]
    n: int
    priority: int
    abort_step: Optional[int]


def _vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _expected_refusal(a: Arrival, max_model_len: int, block_size: int, num_blocks: int,
                      watermark: int, max_num_seqs: int) -> Optional[str]:
    """The test's own capacity rule: which limit (if any) makes this request unschedulable."""
    p = len(a.prompt)
    if p >= max_model_len or (a.max_tokens is not None and p + a.max_tokens > max_model_len):
        return "max_model_len"
    if a.n > max_num_seqs:
        return "max_num_seqs"
    longest = p + a.max_tokens if a.max_tokens is not None else max_model_len
    kv_tokens = longest - 1  # the final token is sampled, never written to the cache
    if (kv_tokens + block_size - 1) // block_size > num_blocks - watermark:
        return "watermark"
    return None


def _run_scenario(model_dir: Path, data: st.DataObject, max_len_cap: int) -> None:
    draw = data.draw
    vocab = _vocab(model_dir)
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]), label="block_size")
    num_blocks = draw(st.integers(2, max(2, 160 // block_size)), label="num_blocks")
    kv_tokens = num_blocks * block_size
    max_model_len = draw(st.integers(2, min(max_len_cap, kv_tokens)), label="max_model_len")
    max_num_seqs = draw(st.integers(1, 5), label="max_num_seqs")
    budget = draw(st.integers(4, 48), label="max_num_batched_tokens")
    caching = draw(st.booleans(), label="enable_prefix_caching")
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), block_size=block_size, kv_cache_tokens=kv_tokens, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_prefix_caching=caching, seed=3,
    ))
    watermark = engine.scheduler.watermark

    # Prompts share prefixes sometimes, so prefix hits, forks and copy-on-write all occur.
    rng = random.Random(draw(st.integers(0, 2**16), label="token_seed"))
    stem = [rng.randrange(4, vocab) for _ in range(max_len_cap)]
    arrivals: list[Arrival] = []
    for i in range(draw(st.integers(1, 6), label="num_requests")):
        plen = draw(st.integers(1, max_model_len + 2))
        shared = draw(st.integers(0, plen))
        prompt = stem[:shared] + [rng.randrange(4, vocab) for _ in range(plen - shared)]
        max_tokens = draw(st.one_of(st.none(), st.integers(1, max(1, max_model_len))))
        arrivals.append(Arrival(
            rid=f"r{i}", step=draw(st.integers(0, 6)), prompt=prompt, max_tokens=max_tokens,
            n=draw(st.integers(1, 3)), priority=draw(st.integers(0, 2)),
            abort_step=draw(st.one_of(st.none(), st.integers(0, 40))),
        ))
    arrivals.sort(key=lambda a: a.step)

    scheduled_tokens: list[int] = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        out = schedule()
        scheduled_tokens.append(out.num_batched_tokens)
        return out

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]

    accepted: dict[str, Arrival] = {}
    finished: dict[str, list[Optional[str]]] = {}
    outputs: dict[str, int] = {}
    longest_total = 0
    step = 0
    bound: Optional[int] = None
    pending = list(arrivals)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            expected = _expected_refusal(a, max_model_len, block_size, num_blocks, watermark, max_num_seqs)
            params = SamplingParams(n=a.n, max_tokens=a.max_tokens, temperature=1.0, seed=a.step, ignore_eos=True)
            try:
                engine.add_request(a.rid, a.prompt, params, priority=a.priority)
            except (RequestTooLongError, KVCapacityError, ValueError) as e:
                assert expected is not None, f"{a.rid} refused but schedulable: {e}"
                assert expected in str(e), f"{a.rid}: expected the {expected} limit to be named: {e}"
                continue
            assert expected is None, f"{a.rid} accepted although its {expected} limit says it can never run"
            accepted[a.rid] = a
            longest = len(a.prompt) + a.max_tokens if a.max_tokens is not None else max_model_len
            longest_total += a.n * longest
        if not pending and bound is None:
            num_samples = sum(a.n for a in accepted.values())
            bound = step + num_samples * 2 * longest_total + 1  # sum(L) + O <= 2 * sum(L)
        for a in accepted.values():
            if a.abort_step == step and a.rid not in finished:
                engine.abort_request(a.rid)
        if not engine.has_unfinished_requests():
            step += 1
            continue
        had_work = bool(engine.requests)
        before = len(scheduled_tokens)
        for d in engine.step():
            outputs[d.request_id] = outputs.get(d.request_id, 0) + sum(len(s.token_ids) for s in d.samples)
            if d.finished:
                assert d.request_id not in finished, "a request finished twice"
                finished[d.request_id] = [s.finish_reason for s in d.samples]
        assert len(scheduled_tokens) == before + 1
        if had_work:
            assert scheduled_tokens[-1] > 0, f"step {step}: requests pending but nothing was scheduled"
            assert engine.last_step_progressed
        step += 1
        assert bound is None or step <= bound, f"still unfinished after {step} steps (bound {bound})"

    assert set(finished) == set(accepted), "every accepted request ends with a finished delta"
    for rid, a in accepted.items():
        if a.abort_step is None and a.max_tokens is not None:
            assert outputs.get(rid, 0) == a.n * a.max_tokens, rid  # ignore_eos: each sample runs to max_tokens
    stats = engine.kv_cache.stats()
    assert stats.used_blocks == 0 and stats.free_blocks + stats.cached_blocks == stats.num_blocks
    engine.kv_cache.check_invariants()


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=20, **_SETTINGS)  # type: ignore[arg-type]
@given(data=st.data())
def test_accepted_requests_progress_every_step_and_finish_within_the_bound(tiny_model, data) -> None:
    _run_scenario(tiny_model("llama"), data, max_len_cap=48)


@pytest.mark.slow
@settings(max_examples=50, **_SETTINGS)  # type: ignore[arg-type]
@given(data=st.data())
def test_liveness_over_many_longer_scenarios(tiny_model, data) -> None:
    _run_scenario(tiny_model("llama"), data, max_len_cap=128)


def test_request_that_could_never_be_admitted_is_refused_naming_the_watermark(tiny_model) -> None:
    """The issue's example: a 250-token prompt in a 256-token pool no longer spins forever."""
    model_dir = tiny_model("llama")
    llm = LLM(str(model_dir), kv_cache_tokens=256, max_model_len=256)  # 16 blocks, watermark 1
    prompt = [5 + i % 200 for i in range(250)]
    with pytest.raises(KVCapacityError, match=r"16 KV blocks.*at most 15.*16 blocks.*watermark of 1") as e:
        llm.generate([prompt], SamplingParams(max_tokens=6))
    assert e.value.field == "prompt" and e.value.blocks_needed == 16 and e.value.limit_blocks == 15
    # max_tokens=None runs to max_model_len: refused too, naming max_tokens since the prompt fits.
    with pytest.raises(KVCapacityError, match="max_tokens: .*max_model_len"):
        llm.generate([prompt[:20]], SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match=r"n: 70 samples exceed max_num_seqs \(64\)"):
        llm.generate([prompt[:20]], SamplingParams(n=70, max_tokens=2))
    # The largest request that fits is accepted and finishes: 15 blocks hold 240 KV tokens.
    out = llm.generate([prompt[:200]], SamplingParams(max_tokens=41, ignore_eos=True, temperature=0.0))[0]
    assert len(out.outputs[0].token_ids) == 41 and out.finished
    assert llm.engine.kv_cache.stats().used_blocks == 0


def test_default_max_model_len_fits_the_admissible_pool(tiny_model) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model("llama")), kv_cache_tokens=256))
    # 16 blocks of 16 minus the 1-block watermark: anything within max_model_len is admissible.
    assert engine.max_model_len == 240
    engine.add_request("a", [5] * 10, SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        assert engine.last_step_progressed
    assert steps <= 240
