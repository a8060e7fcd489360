"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet + gated full attention, server/models/qwen3_next.py)
from tiny random HF folders give transformers' greedy tokens, token for token: a batch of mixed-length
prompts submitted together; chunked prefill whose chunk boundaries fall inside the conv window; a
prefix-cache hit resumed from a saved state; preemption and recompute; n > 1."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from server import LLM, SamplingParams
from tests.families.test_families_vs_transformers import _greedy, _prompts, _tokens, _vocab, hf_greedy

HYBRIDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


@pytest.mark.parametrize("arch", HYBRIDS)
def test_mixed_length_batch_matches_transformers(family_model: Callable[[str, str], Path], arch: str) -> None:
    hf_dir = family_model(arch, "hf")
    prompts = _prompts(4, _vocab(hf_dir), 30, 90, seed=1)
    llm = LLM(str(hf_dir), max_model_len=256, kv_cache_tokens=4096)
    assert _tokens(llm.generate(prompts, _greedy())) == [hf_greedy(hf_dir, p) for p in prompts]


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("budget", [7, 17])
def test_chunked_prefill_matches_transformers(family_model: Callable[[str, str], Path], arch: str,
                                              budget: int) -> None:
    """A step budget of 7 or 17 tokens cuts 40..70-token prompts into chunks that end 1-3 tokens
    past a multiple of the budget, so conv windows straddle most chunk boundaries, and mixes
    decodes of the other sequences into the same steps."""
    hf_dir = family_model(arch, "hf")
    prompts = _prompts(3, _vocab(hf_dir), 40, 70, seed=2)
    llm = LLM(str(hf_dir), max_model_len=256, kv_cache_tokens=4096, max_num_batched_tokens=budget)
    assert _tokens(llm.generate(prompts, _greedy())) == [hf_greedy(hf_dir, p) for p in prompts]


@pytest.mark.parametrize("arch", HYBRIDS)
def test_prefix_hit_on_a_saved_state_matches_transformers(family_model: Callable[[str, str], Path],
                                                          arch: str) -> None:
    """A second turn resumes from the state saved at the end of the first prompt's blocks."""
    hf_dir = family_model(arch, "hf")
    vocab = _vocab(hf_dir)
    shared = _prompts(1, vocab, 64, 64, seed=3)[0]
    prompts = [shared + t for t in _prompts(2, vocab, 5, 20, seed=4)]
    llm = LLM(str(hf_dir), max_model_len=256, kv_cache_tokens=4096)
    first = llm.generate([shared], _greedy())
    rest = llm.generate(prompts, _greedy())
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens > 0 for o in rest), [o.num_cached_tokens for o in rest]
    assert _tokens(first + rest) == [hf_greedy(hf_dir, p) for p in [shared] + prompts]


@pytest.mark.parametrize("arch", HYBRIDS)
def test_preemption_and_recompute_matches_transformers(family_model: Callable[[str, str], Path], arch: str) -> None:
    """Four sequences admitted at 2 blocks each, growing to 3 blocks each, in a KV pool of 9 blocks (the state
    slots come on top of it) cannot all stay: some are preempted (their state slot dropped) and
    recomputed from token 0."""
    hf_dir = family_model(arch, "hf")
    prompts = _prompts(4, _vocab(hf_dir), 18, 28, seed=11)
    llm = LLM(str(hf_dir), max_model_len=64, kv_cache_tokens=144, max_num_seqs=4, enable_prefix_caching=False)
    outs = llm.generate(prompts, _greedy())
    assert llm.engine.stats().num_preemptions > 0
    assert _tokens(outs) == [hf_greedy(hf_dir, p) for p in prompts]


@pytest.mark.parametrize("arch", HYBRIDS)
def test_n_greater_than_one_forks_the_state(family_model: Callable[[str, str], Path], arch: str) -> None:
    hf_dir = family_model(arch, "hf")
    prompt = _prompts(1, _vocab(hf_dir), 33, 33, seed=6)[0]
    llm = LLM(str(hf_dir), max_model_len=256, kv_cache_tokens=4096)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=3))[0]
    want = hf_greedy(hf_dir, prompt)
    assert [o.token_ids for o in out.outputs] == [want] * 3
