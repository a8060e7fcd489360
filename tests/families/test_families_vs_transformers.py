"""Every family of issue 26, from its HF folder and from its GGUF copy, gives transformers'
greedy tokens: on a batch of mixed-length prompts submitted together, after a prefix-cache hit,
and in deterministic mode with n-gram speculative decoding.

The tiny configs (tests.tiny_models) switch each family's special case on: sliding windows
shorter than the prompts with interleaved global layers (Gemma 2/3, OLMo 3), soft-capping
(Gemma 2), separate local/global RoPE with linear scaling and q/k norm (Gemma 3), longrope with
partial rotary whose prompts cross original_max_position_embeddings (Phi-3), post-norms and q/k
norm over the projection (OLMo 2), NoPE layers (SmolLM3), multipliers (Granite).
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from server import LLM, SamplingParams
from tests.families.conftest import FAMILIES

pytestmark = pytest.mark.slow  # transformers references for 7 families x 2 sources: minutes on 2 cores

MAX_NEW = 16
SOURCES = ("hf", "gguf")
_REF: dict[tuple[str, tuple[int, ...]], list[int]] = {}
_HF: dict[str, Any] = {}


def hf_greedy(hf_dir: Path, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    """transformers' greedy decode with its own KV cache, one token per forward as generate runs
    it, never stopping at EOS (the engine runs with ignore_eos)."""
    key = (str(hf_dir), tuple(prompt))
    if key not in _REF:
        from transformers import AutoModelForCausalLM

        if str(hf_dir) not in _HF:
            _HF[str(hf_dir)] = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        model = _HF[str(hf_dir)]
        out: list[int] = []
        with torch.no_grad():
            step = model(input_ids=torch.tensor([prompt]), use_cache=True)
            for _ in range(max_new):
                out.append(int(step.logits[0, -1].argmax()))
                if len(out) == max_new:
                    break
                step = model(input_ids=torch.tensor([[out[-1]]]), cache=step.past_key_values,
                             use_cache=True)
        _REF[key] = out
    return _REF[key]


def _vocab(hf_dir: Path) -> int:
    return int(json.loads((hf_dir / "config.json").read_text())["vocab_size"])


def _prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("arch", FAMILIES)
def test_mixed_length_batch_matches_transformers(family_model: Callable[[str, str], Path], arch: str,
                                                 source: str) -> None:
    hf_dir = family_model(arch, "hf")
    # 30..90 tokens: past every window (24) and on both sides of Phi-3's longrope threshold (64).
    prompts = _prompts(4, _vocab(hf_dir), 30, 90, seed=1)
    llm = LLM(str(family_model(arch, source)), max_model_len=256, kv_cache_tokens=4096)
    assert _tokens(llm.generate(prompts, _greedy())) == [hf_greedy(hf_dir, p) for p in prompts]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("arch", FAMILIES)
def test_prefix_cache_hit_matches_transformers(family_model: Callable[[str, str], Path], arch: str,
                                               source: str) -> None:
    hf_dir = family_model(arch, "hf")
    vocab = _vocab(hf_dir)
    # 64 shared tokens (4 blocks, past the windows) so every prompt is beyond Phi-3's threshold:
    # a cached block's keys were rotated with the factors the hitting request would use.
    shared = _prompts(1, vocab, 64, 64, seed=3)[0]
    prompts = [shared + t for t in _prompts(3, vocab, 5, 20, seed=4)]
    llm = LLM(str(family_model(arch, source)), max_model_len=256, kv_cache_tokens=4096)
    first = llm.generate(prompts[:1], _greedy())
    rest = llm.generate(prompts[1:], _greedy())
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [64, 64]
    assert _tokens(first + rest) == [hf_greedy(hf_dir, p) for p in prompts]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("arch", FAMILIES)
def test_deterministic_ngram_speculation_matches_transformers(family_model: Callable[[str, str], Path], arch: str,
                                                              source: str) -> None:
    hf_dir = family_model(arch, "hf")
    rng = random.Random(5)
    vocab = _vocab(hf_dir)
    # Prompts built from repeated phrases, so prompt lookup finds n-grams to propose.
    phrases = [[rng.randrange(4, vocab) for _ in range(6)] for _ in range(4)]
    prompts = [sum((rng.choice(phrases) for _ in range(n)), []) for n in (6, 9, 12)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(str(family_model(arch, source)), max_model_len=256, kv_cache_tokens=4096, deterministic=True,
              speculative_config=spec)
    assert _tokens(llm.generate(prompts, _greedy())) == [hf_greedy(hf_dir, p) for p in prompts]
    stats = llm.engine.stats().spec
    assert stats is not None and stats.num_proposed > 0
