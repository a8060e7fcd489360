"""The engine under an ITL target: a long prompt that arrives while streams decode is split into
chunks no larger than the step budget allows, every stream gets a token in every step meanwhile,
and the tokens are those of a run without the target (greedy, deterministic mode)."""
from __future__ import annotations

import random
from pathlib import Path

from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.engine.sampling_params import SamplingParams

STREAMS, LONG = 3, 240


def _run(model_dir: Path, itl_target_ms: float | None) -> tuple[dict[str, list[int]], LLMEngine, list[tuple]]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=512, kv_cache_tokens=4096,
                                    max_num_batched_tokens=512, itl_target_ms=itl_target_ms, deterministic=True))
    rng = random.Random(5)
    vocab = engine.vocab_size
    out: dict[str, list[int]] = {}

    def step() -> list[str]:
        got = []
        for d in engine.step():
            for s in d.samples:
                out.setdefault(d.request_id, []).extend(s.token_ids)
                if s.token_ids:
                    got.append(d.request_id)
        return got

    # Streams arrive one by one (each prefill measures the batched regime), then all decode.
    for i in range(STREAMS):
        engine.add_request(f"s{i}", [rng.randrange(4, vocab) for _ in range(40 + 10 * i)],
                           SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True))
        step()
    while len(out) < STREAMS or min(len(v) for v in out.values()) < 3:  # (streams' prefills are chunked too)
        step()
    budget = engine.step_budget
    if budget is not None:
        # A target right at a decode-only step's cost: the prompt gets only what the fused regime
        # or the floor allows, so it is split into many chunks whatever this machine's speed.
        cost = budget.predict(STREAMS, 0)
        assert cost is not None
        budget.target_s = cost
    engine.add_request("long", [rng.randrange(4, vocab) for _ in range(LONG)],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    steps: list[tuple] = []
    while engine.has_unfinished_requests():
        long_seq = engine.requests["long"].sequences[0] if "long" in engine.requests else None
        prefilling = long_seq is not None and long_seq.num_computed_tokens < LONG
        got = step()
        if prefilling and budget is not None:
            steps.append((budget.last, got))
    return out, engine, steps


def test_long_prompt_is_split_within_the_step_budget_while_streams_decode(tiny_model) -> None:
    model_dir = tiny_model("llama")
    tokens, engine, steps = _run(model_dir, itl_target_ms=50.0)
    assert engine.step_budget is not None
    assert len(steps) >= 2, "the long prompt was not split"
    chunks = 0
    for rec, got in steps:
        assert rec.decode_rows == STREAMS
        assert rec.limit is not None and rec.prefill_tokens <= rec.limit, rec
        assert rec.limit >= engine.step_budget.min_chunk
        chunks += rec.prefill_tokens
        # Every stream emitted a token in every step of the prefill: their cadence held.
        assert sorted(g for g in got if g.startswith("s")) == [f"s{i}" for i in range(STREAMS)]
    assert chunks == LONG
    # Chunking changes no token (deterministic mode makes every row independent of its step).
    plain, _, _ = _run(model_dir, itl_target_ms=None)
    assert tokens == plain
