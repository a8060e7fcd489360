"""The engine's greedy outputs equal Hugging Face transformers' `generate`, token for token."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from server import LLM, SamplingParams
from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine

# End-to-end against transformers on several architectures: minutes on 2 cores.
pytestmark = pytest.mark.slow

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
MAX_NEW = 20


def _prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Avoid the special tokens at the top/bottom of the demo vocab (ids 0..3 are specials).
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


_HF_CACHE: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def hf_greedy(model_dir: Path, prompt: list[int], max_new: int) -> list[int]:
    """transformers' own greedy generate for one prompt (no padding), new tokens only."""
    key = (str(model_dir), tuple(prompt), max_new)
    if key not in _HF_CACHE:

        model = _hf_model(model_dir)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
        _HF_CACHE[key] = out[0, len(prompt):].tolist()
    return _HF_CACHE[key]


_HF_MODELS: dict[str, object] = {}


def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    if str(model_dir) not in _HF_MODELS:
        _HF_MODELS[str(model_dir)] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
    return _HF_MODELS[str(model_dir)]


def _greedy(max_new: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_new)


def _vocab(model_dir: Path) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("arch", ARCHS)
def test_long_prompts_match_transformers(tiny_model, arch: str) -> None:
    model_dir = tiny_model(arch)
    prompts = _prompts(4, _vocab(model_dir), 40, 90, seed=1)  # several 16-token blocks each
    llm = LLM(str(model_dir), max_model_len=256, kv_cache_tokens=4096)
    outs = llm.generate(prompts, _greedy())
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(model_dir, p, MAX_NEW)
        assert o.outputs[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_chunked_prefill_with_small_budget_matches(tiny_model, arch: str) -> None:
    model_dir = tiny_model(arch)
    prompts = _prompts(3, _vocab(model_dir), 50, 80, seed=2)
    # 16 tokens per step: every prompt is split across 4-6 steps, interleaved with decodes.
    llm = LLM(str(model_dir), max_model_len=256, kv_cache_tokens=4096, max_num_batched_tokens=16)
    outs = llm.generate(prompts, _greedy())
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(model_dir, p, MAX_NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_cache_hits_match(tiny_model, arch: str) -> None:
    model_dir = tiny_model(arch)
    vocab = _vocab(model_dir)
    shared = _prompts(1, vocab, 48, 48, seed=3)[0]  # 3 full blocks
    tails = _prompts(3, vocab, 5, 20, seed=4)
    prompts = [shared + t for t in tails]
    llm = LLM(str(model_dir), max_model_len=256, kv_cache_tokens=4096)
    first = llm.generate(prompts[:1], _greedy())
    rest = llm.generate(prompts[1:], _greedy())
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 48 for o in rest), [o.num_cached_tokens for o in rest]
    stats = llm.engine.kv_cache.stats()
    assert stats.prefix_hit_tokens >= 96
    for p, o in zip(prompts, first + rest):
        assert o.outputs[0].token_ids == hf_greedy(model_dir, p, MAX_NEW)
    # The same prompt again: everything but the last token comes from the cache.
    again = llm.generate([prompts[0]], _greedy())
    assert again[0].num_cached_tokens == (len(prompts[0]) - 1) // 16 * 16
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def test_sixteen_staggered_requests_are_batch_invariant(tiny_model) -> None:
    model_dir = tiny_model("llama")
    prompts = _prompts(16, _vocab(model_dir), 10, 70, seed=5)
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), max_model_len=256, kv_cache_tokens=4096, max_num_batched_tokens=64)
    )
    results: dict[str, list[int]] = {str(i): [] for i in range(16)}
    finished: set[str] = set()
    step = 0
    pending = list(range(16))
    while pending or engine.has_unfinished_requests():
        # A new request every other step, so batches mix prefills, chunks and decodes.
        if pending and step % 2 == 0:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], _greedy())
        for d in engine.step():
            for s in d.samples:
                results[d.request_id].extend(s.token_ids)
            if d.finished:
                finished.add(d.request_id)
        step += 1
    assert finished == set(results)
    for i, p in enumerate(prompts):
        assert results[str(i)] == hf_greedy(model_dir, p, MAX_NEW), f"request {i}"
