"""LFM2 (a hybrid: short-convolution layers with a state slot per sequence, and attention layers)
from its tiny HF folder and its GGUF copy gives transformers' greedy tokens, token for token:
in a mixed-length batch submitted together, across chunked prefill with chunk boundaries inside
the convolution window, after a prefix-cache hit on a saved state, after preemption and
recompute, and with n > 1. Speculative decoding is switched off for hybrids (start-up warning).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import pytest

from server import LLM, SamplingParams
from tests.families.test_families_vs_transformers import _prompts, _tokens, _vocab, hf_greedy

SOURCES = ("hf", "gguf")
MAX_NEW = 16


def _greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=n)


def _check_pools(llm: LLM) -> None:
    """After the work: no state slot held, every running slot free again, the allocator sound."""
    eng = llm.engine
    assert eng.states is not None
    eng.kv_cache.check_invariants()
    eng.states.cache.check_invariants(live_seq_ids=set())


@pytest.mark.parametrize("source", SOURCES)
def test_mixed_length_batch_matches_transformers(family_model: Callable[[str, str], Path], source: str) -> None:
    hf_dir = family_model("lfm2", "hf")
    prompts = _prompts(5, _vocab(hf_dir), 3, 90, seed=11)  # one shorter than the kernel's window of 3
    prompts[0] = prompts[0][:2]
    llm = LLM(str(family_model("lfm2", source)), max_model_len=256, kv_cache_tokens=4096)
    assert _tokens(llm.generate(prompts, _greedy())) == [hf_greedy(hf_dir, p, MAX_NEW) for p in prompts]
    _check_pools(llm)


@pytest.mark.parametrize("chunk", [5, 7])
def test_chunked_prefill_inside_the_conv_window_matches_transformers(
        family_model: Callable[[str, str], Path], chunk: int) -> None:
    hf_dir = family_model("lfm2", "hf")
    prompts = _prompts(3, _vocab(hf_dir), 20, 60, seed=12)
    # A step of `chunk` tokens over three prompts cuts each prompt every few tokens, so chunks end
    # one and two tokens into the 3-token window as well as on it; decodes share the steps.
    llm = LLM(str(family_model("lfm2", "hf")), max_model_len=256, kv_cache_tokens=4096,
              max_num_batched_tokens=chunk, enable_prefix_caching=False)
    assert _tokens(llm.generate(prompts, _greedy())) == [hf_greedy(hf_dir, p, MAX_NEW) for p in prompts]
    _check_pools(llm)


@pytest.mark.parametrize("source", SOURCES)
def test_prefix_cache_hit_restores_the_saved_state(family_model: Callable[[str, str], Path], source: str) -> None:
    hf_dir = family_model("lfm2", "hf")
    vocab = _vocab(hf_dir)
    shared = _prompts(1, vocab, 70, 70, seed=13)[0]
    prompts = [shared + t for t in _prompts(3, vocab, 5, 20, seed=14)]
    llm = LLM(str(family_model("lfm2", source)), max_model_len=256, kv_cache_tokens=4096)
    first = llm.generate(prompts[:1], _greedy())
    rest = llm.generate(prompts[1:], _greedy())
    assert first[0].num_cached_tokens == 0
    # The first prompt saved its state at its last block boundary before its last token (64 of
    # its ~80 tokens); the others share 70 tokens, so they resume from that snapshot.
    assert [o.num_cached_tokens for o in rest] == [64, 64]
    assert llm.engine.states is not None and llm.engine.states.cache.snapshot_hits == 2
    assert _tokens(first + rest) == [hf_greedy(hf_dir, p, MAX_NEW) for p in prompts]
    _check_pools(llm)


def test_a_hit_without_a_saved_state_recomputes(family_model: Callable[[str, str], Path]) -> None:
    """A KV prefix whose state was never saved (the snapshot pool is empty) is never used."""
    hf_dir = family_model("lfm2", "hf")
    vocab = _vocab(hf_dir)
    shared = _prompts(1, vocab, 70, 70, seed=15)[0]
    prompts = [shared + t for t in _prompts(2, vocab, 5, 20, seed=16)]
    llm = LLM(str(hf_dir), max_model_len=256, kv_cache_tokens=4096)
    assert llm.engine.states is not None
    cache = llm.engine.states.cache
    first = llm.generate(prompts[:1], _greedy())
    cache.drop_invalid(lambda key: False)  # forget every snapshot; the KV blocks stay cached
    rest = llm.generate(prompts[1:], _greedy())
    assert rest[0].num_cached_tokens == 0 and llm.engine.stats().prefix_hit_tokens > 0
    assert _tokens(first + rest) == [hf_greedy(hf_dir, p, MAX_NEW) for p in prompts]


def test_preemption_and_recompute_match_transformers(family_model: Callable[[str, str], Path]) -> None:
    hf_dir = family_model("lfm2", "hf")
    prompts = _prompts(4, _vocab(hf_dir), 30, 40, seed=17)
    # 9 blocks of 16 tokens: four sequences growing to ~56 tokens (4 blocks each) cannot all stay.
    llm = LLM(str(hf_dir), max_model_len=64, kv_cache_tokens=144, enable_prefix_caching=False, max_num_seqs=4)
    outs = llm.generate(prompts, _greedy())
    assert llm.engine.stats().num_preemptions > 0
    assert _tokens(outs) == [hf_greedy(hf_dir, p, MAX_NEW) for p in prompts]
    _check_pools(llm)


@pytest.mark.parametrize("source", SOURCES)
def test_n_greater_than_one_forks_copy_the_state(family_model: Callable[[str, str], Path], source: str) -> None:
    hf_dir = family_model("lfm2", "hf")
    prompts = _prompts(2, _vocab(hf_dir), 20, 50, seed=18)
    llm = LLM(str(family_model("lfm2", source)), max_model_len=256, kv_cache_tokens=4096)
    outs = llm.generate(prompts, _greedy(n=3))
    for out, p in zip(outs, prompts):
        ref = hf_greedy(hf_dir, p, MAX_NEW)
        assert [c.token_ids for c in out.outputs] == [ref] * 3  # greedy samples: every fork as sample 0
    _check_pools(llm)


def test_speculation_is_switched_off_with_a_message(family_model: Callable[[str, str], Path],
                                                    caplog: Any) -> None:
    hf_dir = family_model("lfm2", "hf")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with caplog.at_level(logging.WARNING, logger="pagewire.engine"):
        llm = LLM(str(hf_dir), max_model_len=256, kv_cache_tokens=4096, speculative_config=spec)
    assert llm.engine.spec is None
    assert any("speculative decoding: off" in r.getMessage() and "hybrid" in r.getMessage() for r in caplog.records)
    prompts = _prompts(2, _vocab(hf_dir), 10, 30, seed=19)
    assert _tokens(llm.generate(prompts, _greedy())) == [hf_greedy(hf_dir, p, MAX_NEW) for p in prompts]
