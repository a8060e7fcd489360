"""Speculative decoding (n-gram proposer) in the engine: outputs identical to speculation off.

Greedy outputs must be token-for-token those of the same engine without speculation, on every
architecture, under chunked prefill, prefix hits, preemption, aborts, stops and n = 4; the KV
allocator's invariants must hold after every rollback and no unverified token may be registered
in the prefix cache. Each test also checks that speculation really ran (tokens proposed and
accepted), so none passes by never speculating.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Optional

import pytest

from server import LLM, SamplingParams
from server.engine.config import ConfigError, EngineConfig
from server.engine.engine import LLMEngine
from server.engine.spec_decode import SpecStats

# Always on (no batch or acceptance switch) unless a test says otherwise.
SPEC: dict[str, Any] = {
    "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
    "disable_by_batch_size": 0, "min_acceptance_rate": 0.0,
}


def _vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """Prompts made of a few repeated phrases, so the n-gram proposer finds matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrases = [[rng.randrange(4, vocab) for _ in range(rng.randint(2, 5))] for _ in range(3)]
        p: list[int] = []
        target = rng.randint(lo, hi)
        while len(p) < target:
            p += rng.choice(phrases)
        out.append(p[:target])
    return out


def _engine(model_dir: Path, spec: Optional[dict[str, Any]] = None, **kw: Any) -> LLMEngine:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("kv_cache_tokens", 4096)
    return LLMEngine(EngineConfig(model=str(model_dir), speculative_config=spec, **kw))


def _run(engine: LLMEngine, check_each_step: bool = True) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            for s in d.samples:
                out.setdefault(f"{d.request_id}#{s.index}", []).extend(s.token_ids)
        if check_each_step:
            _check_kv(engine)
    return out


def _check_kv(engine: LLMEngine) -> None:
    """After a step (and its rollbacks): allocator invariants, and no sequence has a token
    registered in the prefix cache beyond its verified, computed ones."""
    kv = engine.kv_cache
    kv.check_invariants()
    for seq in engine.scheduler.running:
        assert not seq.spec_token_ids, "a proposal outlived its step"
        if kv.has_blocks(seq):
            assert kv.registered_tokens(seq) <= seq.num_computed_tokens < seq.num_tokens
            assert len(kv.block_table(seq)) * kv.block_size < seq.num_computed_tokens + 2 * kv.block_size


def _spec_stats(engine: LLMEngine) -> SpecStats:
    s = engine.stats().spec
    assert s is not None
    return s


def _assert_speculated(engine: LLMEngine) -> None:
    s = _spec_stats(engine)
    assert s.num_proposed > 0 and s.num_accepted > 0, s
    assert sum(s.proposed_by_position) == s.num_proposed and sum(s.accepted_by_position) == s.num_accepted
    assert s.num_accepted < s.num_proposed or s.num_emitted > s.num_verified


def _reference(model_dir: Path, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
               **kw: Any) -> dict[str, list[int]]:
    engine = _engine(model_dir, None, **kw)
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        engine.add_request(str(i), p, sp)
    return _run(engine, check_each_step=False)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_identical_with_chunked_prefill(tiny_model, arch: str) -> None:
    model_dir = tiny_model(arch)
    prompts = _prompts(6, _vocab(model_dir), 20, 70, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # A 32-token step budget: prompts prefill in chunks while earlier requests decode with lookahead.
    engine = _engine(model_dir, SPEC, max_num_batched_tokens=32)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got = _run(engine)
    assert got == _reference(model_dir, prompts, params, max_num_batched_tokens=32)
    _assert_speculated(engine)
    assert engine.kv_cache.stats().used_blocks == 0


def test_prefix_hits_and_no_unverified_token_is_cached(tiny_model) -> None:
    model_dir = tiny_model("llama")
    prompts = _prompts(3, _vocab(model_dir), 40, 60, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    ref = _reference(model_dir, prompts, params)
    engine = _engine(model_dir, SPEC, block_size=4)
    for round_ in range(2):
        for i, p in enumerate(prompts):
            engine.add_request(f"{round_}-{i}", p, params)
        got = _run(engine)
        assert got == {f"{round_}-{k}": v for k, v in ref.items()}
    # Round 2 also re-sends prompt + its generated tokens: prefix hits over blocks that speculation
    # filled must serve exactly the verified tokens' KV.
    for i, p in enumerate(prompts):
        engine.add_request(f"ext-{i}", p + ref[f"{i}#0"][:40], params)
    got = _run(engine)
    ext_ref = _reference(model_dir, [p + ref[f"{i}#0"][:40] for i, p in enumerate(prompts)], params)
    assert got == {f"ext-{k}": v for k, v in ext_ref.items()}
    assert engine.kv_cache.stats().prefix_hit_tokens > 0
    _assert_speculated(engine)


def test_preemption_under_kv_pressure(tiny_model) -> None:
    model_dir = tiny_model("llama")
    prompts = _prompts(8, _vocab(model_dir), 50, 70, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = _engine(model_dir, SPEC, kv_cache_tokens=256, max_model_len=128)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got = _run(engine)
    assert engine.scheduler.num_preemptions > 0
    assert got == _reference(model_dir, prompts, params)
    _assert_speculated(engine)
    assert engine.kv_cache.stats().used_blocks == 0


def test_abort_in_flight(tiny_model) -> None:
    model_dir = tiny_model("qwen2")
    prompts = _prompts(4, _vocab(model_dir), 30, 40, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine = _engine(model_dir, SPEC)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {}
    aborted = False
    while engine.has_unfinished_requests():
        for d in engine.step():
            for s in d.samples:
                out.setdefault(f"{d.request_id}#{s.index}", []).extend(s.token_ids)
        _check_kv(engine)
        if not aborted and _spec_stats(engine).num_accepted > 0 and "1" in engine.requests:
            assert engine.abort_request("1")  # between steps, after it has speculated
            aborted = True
    assert aborted
    ref = _reference(model_dir, prompts, params)
    for i in (0, 2, 3):
        assert out[f"{i}#0"] == ref[f"{i}#0"]
    assert ref["1#0"][: len(out["1#0"])] == out["1#0"] and len(out["1#0"]) < 60
    assert engine.kv_cache.stats().used_blocks == 0


def test_stops_penalties_min_tokens_logprobs_per_accepted_position(tiny_model) -> None:
    model_dir = tiny_model("llama")
    vocab = _vocab(model_dir)
    prompts = _prompts(2, vocab, 30, 40, seed=5)
    llm_off = LLM(str(model_dir), max_model_len=256, kv_cache_tokens=4096)
    llm_on = LLM(str(model_dir), max_model_len=256, kv_cache_tokens=4096, speculative_config=SPEC)
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = [o.outputs[0] for o in llm_off.generate(prompts, base)]
    cases = [base, base.clone(max_tokens=13), base.clone(logprobs=3), base.clone(repetition_penalty=1.3),
             base.clone(frequency_penalty=0.5, presence_penalty=0.3)]
    for r in ref:
        tok = r.token_ids[9]
        cases.append(base.clone(stop_token_ids=[tok]))
        cases.append(base.clone(stop_token_ids=[tok], min_tokens=r.token_ids.index(tok) + 2))
        if len(r.text) >= 12:
            cases.append(base.clone(stop=[r.text[len(r.text) // 2: len(r.text) // 2 + 3]]))
            cases.append(base.clone(stop=[r.text[len(r.text) // 2: len(r.text) // 2 + 3]],
                                    include_stop_str_in_output=True))
    for sp in cases:
        off = [o.outputs[0] for o in llm_off.generate(prompts, sp)]
        on = [o.outputs[0] for o in llm_on.generate(prompts, sp)]
        for a, b in zip(off, on):
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
                a.token_ids, a.text, a.finish_reason, a.stop_reason), sp
            if sp.logprobs is not None:
                assert a.logprobs is not None and b.logprobs is not None and len(a.logprobs) == len(b.logprobs)
                for la, lb in zip(a.logprobs, b.logprobs):
                    assert la.token_id == lb.token_id and abs(la.logprob - lb.logprob) < 1e-4
                    assert [t for t, _ in la.top] == [t for t, _ in lb.top]
    _assert_speculated(llm_on.engine)


def test_n4_greedy_and_seeded_sampling(tiny_model) -> None:
    model_dir = tiny_model("llama")
    vocab = _vocab(model_dir)
    prompts = _prompts(2, vocab, 25, 35, seed=6)
    greedy = SamplingParams(n=4, temperature=0.0, max_tokens=30, ignore_eos=True)
    ref = _reference(model_dir, prompts, greedy)
    engine = _engine(model_dir, SPEC)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy)
    assert _run(engine) == ref
    assert all(ref[f"{i}#{j}"] == ref[f"{i}#0"] for i in range(2) for j in range(4))
    _assert_speculated(engine)
    # Seeded sampling with speculation: reproducible, and independent of the batch around it.
    sampled = SamplingParams(n=4, temperature=0.8, top_k=50, seed=99, max_tokens=30, ignore_eos=True)
    llm = LLM(str(model_dir), max_model_len=256, kv_cache_tokens=4096, speculative_config=SPEC)
    alone = llm.generate([prompts[0]], sampled)[0]
    again = llm.generate([prompts[0]], sampled)[0]
    mixed = llm.generate([prompts[1], prompts[0]], [SamplingParams(temperature=1.0, max_tokens=20), sampled])[1]
    for a, b, c in zip(alone.outputs, again.outputs, mixed.outputs):
        assert a.token_ids == b.token_ids == c.token_ids and len(a.token_ids) == 30
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1  # the samples really differ
    assert _spec_stats(llm.engine).num_proposed > 0


def test_switches_turn_speculation_off_and_count_it(tiny_model) -> None:
    model_dir = tiny_model("llama")
    prompts = _prompts(3, _vocab(model_dir), 20, 30, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ref = _reference(model_dir, prompts, params)
    # Per step: 3 running sequences >= threshold 2, so no step proposes while all three run.
    engine = _engine(model_dir, {**SPEC, "disable_by_batch_size": 2})
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    assert _run(engine) == ref
    s = _spec_stats(engine)
    assert s.steps_off_batch > 0
    # Per sequence: demanding 100% acceptance over a 1-token window stops at the first miss.
    engine = _engine(model_dir, {**SPEC, "acceptance_window": 1, "min_acceptance_rate": 1.0})
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    assert _run(engine) == ref
    s = _spec_stats(engine)
    assert s.seqs_off_acceptance > 0 and s.num_accepted < s.num_proposed


def test_speculative_config_errors_name_the_field(tiny_model) -> None:
    model_dir = str(tiny_model("llama"))
    cases = [
        ({"method": "medusa"}, "speculative_config.method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_min"),
        ({"method": "ngram", "lookahead": 3}, "speculative_config.lookahead"),
        ({"num_speculative_tokens": 3}, "speculative_config.method"),
        ({"method": "ngram", "model": "x"}, "speculative_config.model"),
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"method": "ngram", "min_acceptance_rate": 2}, "speculative_config.min_acceptance_rate"),
        ("{not json", "speculative_config"),
    ]
    for value, field in cases:
        with pytest.raises(ConfigError) as e:
            LLM(model_dir, speculative_config=value)
        assert e.value.field == field and str(e.value).startswith(field + ":"), (value, str(e.value))


def test_priority_preemption_with_speculation(tiny_model) -> None:
    model_dir = tiny_model("llama")
    vocab = _vocab(model_dir)
    low = _prompts(2, vocab, 20, 24, seed=8)
    urgent = _prompts(1, vocab, 20, 24, seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = _engine(model_dir, SPEC, max_num_seqs=2)
    for i, p in enumerate(low):
        engine.add_request(f"low{i}", p, params, priority=5)
    out: dict[str, list[int]] = {}

    def step() -> None:
        for d in engine.step():
            for s in d.samples:
                out.setdefault(d.request_id, []).extend(s.token_ids)
        _check_kv(engine)

    while _spec_stats(engine).num_verified == 0:  # the low-priority pair is speculating
        step()
    engine.add_request("urgent", urgent, params, priority=0)
    step()
    assert "urgent" in {s.request.request_id for s in engine.scheduler.running}
    assert engine.scheduler.num_preemptions == 1
    while engine.has_unfinished_requests():
        step()
    ref = _reference(model_dir, low + [urgent], params)
    assert [out["low0"], out["low1"], out["urgent"]] == [ref["0#0"], ref["1#0"], ref["2#0"]]
    assert engine.kv_cache.stats().used_blocks == 0
