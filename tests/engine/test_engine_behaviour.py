"""Engine behaviour: KV exhaustion, abort, n > 1 forking, seeds, priorities, stops, bad input."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from server import LLM, SamplingParams
from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.engine.errors import RequestTooLongError
from server.engine.sampling_params import SamplingParamsError


def _vocab(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def _prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _engine(model_dir: Path, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("kv_cache_tokens", 4096)
    return LLMEngine(EngineConfig(model=str(model_dir), **kw))


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            for s in d.samples:
                out.setdefault(f"{d.request_id}#{s.index}", []).extend(s.token_ids)
    return out


def test_kv_exhaustion_preempts_and_every_request_finishes_exactly(tiny_model) -> None:
    model_dir = tiny_model("llama")
    prompts = _prompts(8, _vocab(model_dir), 50, 70, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # 8 requests x ~110 tokens of KV = ~880 tokens against a pool of 256 (16 blocks).
    engine = _engine(model_dir, kv_cache_tokens=256, max_model_len=128)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    together = _run(engine)
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.stats().used_blocks == 0
    engine.kv_cache.check_invariants()
    alone = LLM(str(model_dir), max_model_len=256, kv_cache_tokens=4096)
    for i, p in enumerate(prompts):
        solo = alone.generate([p], params)[0].outputs[0].token_ids
        assert together[f"{i}#0"] == solo, f"request {i}"
        assert len(solo) == 40


def test_abort_mid_prefill_returns_every_block(tiny_model) -> None:
    model_dir = tiny_model("llama")
    engine = _engine(model_dir, max_num_batched_tokens=16)
    prompt = _prompts(1, _vocab(model_dir), 120, 120, seed=12)[0]
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=5))
    engine.step()
    engine.step()
    seq = engine.requests["a"].sequences[0]
    assert 0 < seq.num_computed_tokens < len(prompt)  # really in the middle of the prefill
    assert engine.kv_cache.stats().used_blocks > 0
    assert engine.abort_request("a")
    deltas = engine.step()
    assert [d.samples[0].finish_reason for d in deltas] == ["abort"] and deltas[0].finished
    stats = engine.kv_cache.stats()
    assert stats.used_blocks == 0
    assert stats.free_blocks + stats.cached_blocks == stats.num_blocks
    engine.kv_cache.check_invariants()
    assert not engine.has_unfinished_requests()


def test_n4_forks_the_prompt_blocks_once(tiny_model) -> None:
    model_dir = tiny_model("llama")
    engine = _engine(model_dir)
    prompt = _prompts(1, _vocab(model_dir), 64, 64, seed=13)[0]  # exactly 4 full blocks
    engine.add_request("r", prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True))
    engine.step()  # prefill + fork + 4 first tokens
    req = engine.requests["r"]
    assert len(req.sequences) == 4
    tables = [engine.kv_cache.block_table(s) for s in req.sequences]
    assert all(t == tables[0] for t in tables)  # shared, not copied
    assert engine.kv_cache.stats().used_blocks == 4
    assert all(engine.kv_cache.refcount(b) == 4 for b in tables[0])
    engine.step()  # each sample writes position 64: one new block each, prompt blocks still shared
    tables = [engine.kv_cache.block_table(s) for s in req.sequences]
    assert all(t[:4] == tables[0][:4] for t in tables)
    assert len({t[4] for t in tables}) == 4
    assert engine.kv_cache.stats().used_blocks == 4 + 4
    out = _run(engine)
    assert sorted(out) == ["r#0", "r#1", "r#2", "r#3"]
    assert all(len(engine_tokens) >= 4 for engine_tokens in out.values())
    assert engine.kv_cache.stats().used_blocks == 0


def test_n_greater_than_one_copies_on_write_partial_block(tiny_model) -> None:
    model_dir = tiny_model("llama")
    llm = LLM(str(model_dir), max_model_len=256, kv_cache_tokens=4096)
    prompt = _prompts(1, _vocab(model_dir), 40, 40, seed=14)[0]  # last block partly filled
    greedy_n = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=12))[0]
    single = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0]
    # Greedy samples must all equal the single greedy run: CoW kept each sample's KV private.
    for c in greedy_n.outputs:
        assert c.token_ids == single.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_across_batches(tiny_model) -> None:
    model_dir = tiny_model("llama")
    llm = LLM(str(model_dir), max_model_len=256, kv_cache_tokens=4096)
    vocab = _vocab(model_dir)
    p = _prompts(1, vocab, 20, 20, seed=15)[0]
    others = _prompts(5, vocab, 5, 40, seed=16)
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([p], sp)[0].outputs[0].token_ids
    params = ([SamplingParams(temperature=1.0, max_tokens=16)] * 2 + [sp]
              + [SamplingParams(temperature=0.7, max_tokens=9)] * 3)
    mixed = llm.generate(others[:2] + [p] + others[2:], params)
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = llm.generate([p], sp.clone(seed=4321))[0].outputs[0].token_ids
    assert other_seed != alone


def test_high_priority_arrival_preempts_low_priority_work(tiny_model) -> None:
    model_dir = tiny_model("llama")
    engine = _engine(model_dir, max_num_seqs=2)
    vocab = _vocab(model_dir)
    low = _prompts(2, vocab, 20, 20, seed=17)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(low):
        engine.add_request(f"low{i}", p, params, priority=5)
    engine.step()
    engine.step()
    assert len(engine.scheduler.running) == 2
    urgent = _prompts(1, vocab, 20, 20, seed=18)[0]
    engine.add_request("urgent", urgent, params, priority=0)
    engine.step()
    running = {s.request.request_id for s in engine.scheduler.running}
    assert "urgent" in running
    assert engine.scheduler.num_preemptions == 1
    out = _run(engine)
    solo = LLM(str(model_dir), max_model_len=256, kv_cache_tokens=4096)
    for rid, p in [("low0", low[0]), ("low1", low[1])]:
        # The preempted one recomputed and still produced exactly its own greedy output.
        full = solo.generate([p], params)[0].outputs[0].token_ids
        assert full[-len(out[f"{rid}#0"]):] == out[f"{rid}#0"]


def test_stop_conditions(tiny_model) -> None:
    model_dir = tiny_model("llama")
    llm = LLM(str(model_dir), max_model_len=256, kv_cache_tokens=4096)
    p = _prompts(1, _vocab(model_dir), 12, 12, seed=19)[0]
    base = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    # stop_token_ids: stop at the 5th generated token.
    tok5 = base.token_ids[4]
    first = base.token_ids.index(tok5)
    o = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[tok5]))[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == tok5 and o.token_ids == base.token_ids[: first + 1]
    # min_tokens blocks the stop token until reached.
    sp = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[tok5], min_tokens=first + 3)
    o = llm.generate([p], sp)[0].outputs[0]
    assert len(o.token_ids) >= first + 3 and tok5 not in o.token_ids[: first + 3]
    # A stop string taken from the middle of the greedy text: output ends right before it.
    text = base.text
    if len(text) >= 8:
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        o = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0].outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason == stop
        assert o.text == text[: text.index(stop)]


def test_bad_input_gets_clear_errors(tiny_model, tmp_path: Path) -> None:
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=math.nan)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(SamplingParamsError, match="top_p"):
            SamplingParams(top_p=bad)
    model_dir = tiny_model("llama")
    llm = LLM(str(model_dir), max_model_len=64, kv_cache_tokens=1024)
    long_prompt = _prompts(1, _vocab(model_dir), 80, 80, seed=20)[0]
    with pytest.raises(RequestTooLongError, match="80 tokens.*64"):
        llm.generate([long_prompt], SamplingParams(max_tokens=4))
    with pytest.raises(RequestTooLongError, match="max_tokens"):
        llm.generate([long_prompt[:40]], SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10**7]], SamplingParams(max_tokens=4))
    # The engine keeps working after refusing input.
    assert len(llm.generate([long_prompt[:20]], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids) >= 1
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        LLM(str(missing))
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(broken))


def test_reset_prefix_cache_while_sequences_run_keeps_them_exact(tiny_model) -> None:
    """A failed forward resets the prefix cache under running sequences (engine/isolation.py):
    their chains start again from block 0, the next steps re-register their full blocks, and
    their outputs equal a run without the reset; a later request hits those blocks again."""
    model_dir = tiny_model("llama")
    prompts = _prompts(3, _vocab(model_dir), 40, 60, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = _engine(model_dir, block_size=16, enable_prefix_caching=True, max_num_batched_tokens=32)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {}
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        if step in (2, 9):  # once mid-prefill (chunked), once mid-decode
            engine.kv_cache.reset_prefix_cache()
            engine.kv_cache.check_invariants()
        for d in engine.step():
            for s in d.samples:
                out.setdefault(f"{d.request_id}#{s.index}", []).extend(s.token_ids)
    engine.kv_cache.check_invariants()
    alone = LLM(str(model_dir), max_model_len=256, kv_cache_tokens=4096)
    for i, p in enumerate(prompts):
        assert out[f"{i}#0"] == alone.generate([p], params)[0].outputs[0].token_ids, f"request {i}"
    # The survivors' blocks were registered again: the same prompt now hits the cache.
    hits = engine.kv_cache.stats().prefix_hit_tokens
    engine.add_request("again", prompts[0], SamplingParams(temperature=0.0, max_tokens=1))
    _run(engine)
    assert engine.kv_cache.stats().prefix_hit_tokens - hits >= len(prompts[0]) // 16 * 16 - 16
