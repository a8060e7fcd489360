"""A step whose every sampled row is plain greedy takes its logits unwidened (runner.execute_greedy:
the lm_head's bf16 row, which the argmax reads as it is) and gets the tokens the float32 logits
give; any other step (a sampled row, logprobs, lookahead to verify) still gets float32 logits."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.engine.sampling_params import SamplingParams
from server.engine.spec_config import SpeculativeConfig

PROMPTS = [[5, 9, 2, 7, 11, 3], [4, 4, 8, 1], [13, 2, 6, 6, 6, 9, 1, 10, 12]]


def _engine(path: Path, **kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(str(path), dtype="bfloat16", kv_cache_tokens=4096, block_size=16, max_num_seqs=8,
                                  max_num_batched_tokens=64, **kw))


def _spy(eng: LLMEngine) -> list[tuple[str, torch.dtype]]:
    """Records, per forward, which execute ran and the dtype of the logits it returned."""
    seen: list[tuple[str, torch.dtype]] = []
    runner = eng.runner
    real = runner.execute

    def execute(out: Any, widen: bool = True) -> torch.Tensor:
        logits = real(out, widen)
        seen.append(("greedy" if not widen else "float32", logits.dtype))
        return logits

    runner.execute = execute  # type: ignore[method-assign]
    return seen


def _run(eng: LLMEngine, params: list[SamplingParams]) -> dict[str, list[int]]:
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        eng.add_request(f"r{i}", prompt, p)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(params))}
    with eng.step_modes():
        while eng.has_unfinished_requests():
            for d in eng.step():
                tokens[d.request_id].extend(d.samples[0].token_ids)
    return tokens


def test_greedy_steps_take_unwidened_logits_and_the_float32_tokens(tiny_model: Callable[..., Path]) -> None:
    path = tiny_model("llama", "bfloat16")
    greedy = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True) for _ in PROMPTS]
    eng = _engine(path)
    seen = _spy(eng)
    got = _run(eng, greedy)
    assert seen and all(s == ("greedy", torch.bfloat16) for s in seen), seen
    # The same requests with every step's logits widened (the float32 path the sampler takes).
    ref = _engine(path)
    seen_ref = _spy(ref)
    ref.runner.execute_greedy = ref.runner.execute  # type: ignore[method-assign]
    assert _run(ref, greedy) == got
    assert all(s == ("float32", torch.float32) for s in seen_ref)


@pytest.mark.parametrize("other", [
    SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, logprobs=2, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, min_tokens=4, max_tokens=10),
])
def test_a_step_with_a_row_that_is_not_plain_greedy_gets_float32_logits(tiny_model: Callable[..., Path],
                                                                         other: SamplingParams) -> None:
    eng = _engine(tiny_model("llama", "bfloat16"))
    seen = _spy(eng)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    _run(eng, [greedy, other])
    # While the other request runs, every step is widened; once it is done (or past min_tokens)
    # the greedy steps may take the unwidened path. Each forward's logits match what it chose.
    assert seen[0] == ("float32", torch.float32)
    assert all(dtype == (torch.bfloat16 if kind == "greedy" else torch.float32) for kind, dtype in seen)


def test_speculative_steps_keep_float32_logits(tiny_model: Callable[..., Path]) -> None:
    eng = _engine(tiny_model("llama", "bfloat16"),
                  speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    seen = _spy(eng)
    _run(eng, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)])
    assert seen and all(s == ("float32", torch.float32) for s in seen)
