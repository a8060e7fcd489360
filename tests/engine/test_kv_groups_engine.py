"""KV groups end to end: a model whose sliding-window layers hold only their window (their blocks
go back to the pool as the window slides) still matches transformers' greedy output token for
token: one batch of prompts of mixed lengths, all longer than the window, then the same prompts
again as prefix-cache hits taken after the window slid."""
from __future__ import annotations

from pathlib import Path

import pytest

from server import SamplingParams
from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from tests.engine.test_greedy_vs_transformers import _prompts, _vocab, hf_greedy

pytestmark = pytest.mark.slow  # transformers' generate on several prompts

WINDOW = 16
MAX_NEW = 20
# 4 layers: sliding, full, sliding, full -> one sliding group and one full group of 2 layers each.
QWEN2_INTERLEAVED = dict(use_sliding_window=True, sliding_window=WINDOW, num_hidden_layers=4,
                         layer_types=["sliding_attention", "full_attention"] * 2)


def _generate(engine: LLMEngine, prompts: list[list[int]], tag: str) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Run the prompts together; returns each one's tokens and cached prompt tokens, and checks
    after every decode step that each sequence's sliding group holds no block wholly before the
    window of the token that step computed (the full group keeps every block)."""
    kv = engine.kv_cache
    sliding = [g for g, w in enumerate(kv.group_windows) if w > 0]
    full = [g for g, w in enumerate(kv.group_windows) if w == 0]
    reqs = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
        reqs[f"{tag}{i}"] = engine.requests[f"{tag}{i}"]
    released = 0
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            for smp in d.samples:
                out.setdefault(d.request_id, []).extend(smp.token_ids)
        for req in engine.requests.values():
            for seq in req.sequences:
                if not kv.has_blocks(seq) or seq.num_output_tokens < 2:
                    continue  # the last step was a decode from num_computed - 1
                for g in sliding:
                    table = kv.block_table(seq, g)
                    below = max(0, seq.num_computed_tokens - 1 - WINDOW + 1) // kv.block_size
                    assert table[:below] == [-1] * below, (g, seq.num_computed_tokens, table)
                    released += below
                for g in full:
                    assert -1 not in kv.block_table(seq, g)
    assert released > 0, "no sliding-window block was ever given back"
    kv.check_invariants()
    return out, {rid: r.num_cached_tokens for rid, r in reqs.items()}


def test_window_shorter_than_the_prompt_frees_blocks_and_matches_transformers(tiny_model) -> None:
    model_dir: Path = tiny_model("qwen2", **QWEN2_INTERLEAVED)
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=256, kv_cache_tokens=4096,
                                    max_num_batched_tokens=48))
    assert engine.kv_cache.group_windows == (WINDOW, 0)
    prompts = _prompts(4, _vocab(model_dir), 30, 90, seed=3)  # mixed lengths, all > WINDOW
    first, _ = _generate(engine, prompts, "a")
    for i, p in enumerate(prompts):
        assert first[f"a{i}"] == hf_greedy(model_dir, p, MAX_NEW), i
    # The same prompts again: prefix hits over blocks the window had slid past and released.
    second, cached = _generate(engine, prompts, "b")
    assert all(cached[f"b{i}"] >= 16 for i in range(len(prompts))), cached
    for i in range(len(prompts)):
        assert second[f"b{i}"] == first[f"a{i}"], i
    assert engine.kv_cache.stats().used_blocks == 0


def test_every_layer_sliding_holds_only_the_window(tiny_model) -> None:
    """Mistral (one window on every layer): a long generation holds a bounded number of blocks."""
    model_dir: Path = tiny_model("mistral", sliding_window=WINDOW)
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=256, kv_cache_tokens=4096,
                                    max_num_batched_tokens=32))
    assert engine.kv_cache.group_windows == (WINDOW,)
    prompt = _prompts(1, _vocab(model_dir), 100, 100, seed=5)[0]
    engine.add_request("m", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    peak = 0
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for d in engine.step():
            for smp in d.samples:
                tokens.extend(smp.token_ids)
        peak = max(peak, engine.kv_cache.stats().used_blocks)
    # A 32-token chunk plus the window before it, at most: never the whole sequence.
    assert peak <= -(-(WINDOW - 1 + 32) // 16) + 1 < -(-(100 + MAX_NEW) // 16)
    assert tokens == hf_greedy(model_dir, prompt, MAX_NEW)
