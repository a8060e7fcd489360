"""A decode step's host work: the runner's one-call decode plan (persistent buffers read through
cached views) and the engine's argmax-only sampling of plain greedy rows must give exactly what
the general plan and the sampler give."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import server.engine.engine as engine_module
from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.engine.runner import ModelRunner
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import SchedulerOutput


def _engine(path: Path, **kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(str(path), kv_cache_tokens=kw.pop("kv", 4096), block_size=kw.pop("block_size", 16),
                                  max_num_seqs=8, max_num_batched_tokens=kw.pop("tokens", 64), **kw))


def _plan_fields(planned: tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor]) -> dict[str, Any]:
    ids, positions, meta, rows = planned
    return {
        "input_ids": ids.clone(), "positions": positions.clone(), "sample_rows": rows.clone(),
        "slot_mapping": meta.slot_mapping.clone(), "block_tables": meta.block_tables.clone(),
        "seq_lens": meta.seq_lens.clone(), "query_start_loc": meta.query_start_loc.clone(),
        "prompt_lens": meta.prompt_lens.clone(), "max_query_len": meta.max_query_len,
        "max_seq_len": meta.max_seq_len, "per_layer": meta.per_layer, "state": meta.state,
    }


def _check_every_decode_plan(runner: ModelRunner, counts: dict[str, int]) -> None:
    """Wrap the runner's _plan: for every step the decode plan takes, also run the general plan on
    the same step and require the same tensors."""
    general_plan = runner._plan

    def checked(out: SchedulerOutput) -> Any:
        fast = runner._plan_decode(out)
        if fast is None:
            counts["general"] += 1
            return general_plan(out)
        got = _plan_fields(fast)  # copies: the general plan below rewrites the shared block tables
        runner._decode_plannable = False
        try:
            want = _plan_fields(general_plan(out))
        finally:
            runner._decode_plannable = True
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert got[key].dtype == value.dtype, key
                assert torch.equal(got[key], value), (key, got[key], value)
            else:
                assert got[key] == value, (key, got[key], value)
        counts["decode"] += 1
        return runner._plan_decode(out)

    runner._plan = checked  # type: ignore[method-assign]


def test_decode_plan_is_the_general_plan(tiny_model: Callable[..., Path]) -> None:
    """Sequences of different lengths crossing block boundaries, a batch that shrinks as they finish
    and grows as new ones join, and tables that outgrow the persistent buffers."""
    eng = _engine(tiny_model("llama"), block_size=4)
    counts = {"decode": 0, "general": 0}
    _check_every_decode_plan(eng.runner, counts)
    fill = eng.kv_cache.fill_decode_inputs
    narrow: list[int] = []

    def counting(*args: Any) -> tuple[int, int]:
        longest, max_len = fill(*args)
        if max_len < 0:
            narrow.append(longest)
        return longest, max_len

    eng.kv_cache.fill_decode_inputs = counting  # type: ignore[method-assign]
    # Prompts 3..40 tokens, outputs 5..90: contexts up to 93 tokens, 24 blocks of 4, past the
    # tables the prefill steps sized.
    for i, (prompt, out) in enumerate([(3, 90), (17, 5), (40, 33), (9, 21), (25, 12)]):
        eng.add_request(f"r{i}", [(7 * i + j) % 200 + 10 for j in range(prompt)],
                        SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        if steps == 8:  # one joins mid-stream: the decode batch grows by one row
            eng.add_request("late", list(range(30, 52)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert counts["decode"] > 80 and counts["general"] > 0
    assert narrow, "no decode step outgrew the persistent tables"


def test_decode_plan_keeps_the_greedy_text(tiny_model: Callable[..., Path]) -> None:
    """The same requests with the decode plan and the argmax-only sampling both switched off give
    the same tokens."""
    path = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[(5 * i + j) % 300 + 20 for j in range(5 + 7 * i)] for i in range(4)]

    def run(fast: bool) -> dict[str, list[int]]:
        eng = _engine(path)
        eng.runner._decode_plannable = fast
        out: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        while eng.has_unfinished_requests():
            for d in eng.step():
                out.setdefault(d.request_id, []).extend(d.samples[0].token_ids if d.samples else [])
        return out

    fast = run(True)
    plain = engine_module.plain_greedy
    engine_module.plain_greedy = lambda seq: False  # type: ignore[assignment]
    try:
        slow = run(False)
    finally:
        engine_module.plain_greedy = plain
    assert fast == slow and all(len(v) == 24 for v in fast.values())


@pytest.mark.parametrize("change", ["temperature", "logprobs", "min_tokens", "penalty"])
def test_rows_that_need_the_sampler_are_not_plain_greedy(tiny_model: Callable[..., Path], change: str) -> None:
    """A batch with one row that needs more than an argmax (sampling, logprobs, EOS blocked until
    min_tokens, penalties) goes through the sampler, and that row gets what it asked for."""
    eng = _engine(tiny_model("llama"))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    other = {"temperature": SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
             "logprobs": SamplingParams(temperature=0, logprobs=2, max_tokens=6, ignore_eos=True),
             "min_tokens": SamplingParams(temperature=0, min_tokens=6, max_tokens=6),
             "penalty": SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=6, ignore_eos=True)}[change]
    eng.add_request("greedy", list(range(10, 20)), greedy)
    eng.add_request("other", list(range(40, 50)), other)
    seqs = [eng.requests[r].sequences[0] for r in ("greedy", "other")]
    assert engine_module.plain_greedy(seqs[0])
    assert not engine_module.plain_greedy(seqs[1])
    logprobs: list[Any] = []
    tokens = 0
    while eng.has_unfinished_requests():
        for d in eng.step():
            if d.request_id == "other" and d.samples:
                tokens += len(d.samples[0].token_ids)
                logprobs += d.samples[0].logprobs or []
    assert tokens == 6
    if change == "logprobs":
        assert len(logprobs) == 6 and all(len(lp.top) == 2 for lp in logprobs)


def test_decode_inputs_refuse_what_they_cannot_fill(tiny_model: Callable[..., Path]) -> None:
    eng = _engine(tiny_model("llama"))
    eng.add_request("r", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()
    seq = eng.requests["r"].sequences[0]
    kv = eng.kv_cache
    i64, i32 = np.zeros((3, 4), np.int64), np.zeros((3, 5), np.int32)
    tables = np.zeros((1, 4, 8), np.int32)
    # The prompt's 20 tokens hold two blocks of 16: position 19 has a block, position 40 none.
    assert kv.fill_decode_inputs([seq.seq_id], [5], [19], [20], i64, i32, tables) == (2, 20)
    assert i64[:, 0].tolist() == [5, 19, kv.block_table(seq)[1] * 16 + 3]
    assert i32[:, 0].tolist() == [20, 20, 0] and i32[2, 1] == 1
    assert tables[0, 0, :2].tolist() == kv.block_table(seq)
    with pytest.raises(ValueError, match="no block for position 40"):
        kv.fill_decode_inputs([seq.seq_id], [5], [40], [20], i64, i32, tables)
    with pytest.raises(ValueError, match="unknown seq_id|fill_decode_inputs"):
        kv.fill_decode_inputs([10**6], [5], [0], [1], i64, i32, tables)
    with pytest.raises(ValueError, match="i64 must be"):
        kv.fill_decode_inputs([seq.seq_id], [5], [19], [20], i64.astype(np.int32), i32, tables)
    with pytest.raises(ValueError, match="i32 must be"):
        kv.fill_decode_inputs([seq.seq_id], [5], [19], [20], i64, np.zeros((3, 1), np.int32), tables)
    with pytest.raises(ValueError, match="tables must be"):
        kv.fill_decode_inputs([seq.seq_id], [5], [19], [20], i64, i32, np.zeros((4, 8), np.int32))
    with pytest.raises(ValueError, match="differ in length"):
        kv.fill_decode_inputs([seq.seq_id], [5, 6], [19], [20], i64, i32, tables)
    # A table wider than `tables`: nothing written, max seq_len -1.
    i64[:] = 7
    assert kv.fill_decode_inputs([seq.seq_id], [5], [19], [20], i64, i32, np.zeros((1, 4, 1), np.int32)) == (2, -1)
    assert (i64 == 7).all()


def test_decode_views_move_to_another_device() -> None:
    """Off the CPU the views are copied to the device each step (the host buffers stay the
    runner's); the sample rows index the logits on the host."""
    from server.engine.runner import _DecodeViews

    i64, i32, tables = torch.arange(24).view(3, 8), torch.arange(27, dtype=torch.int32).view(3, 9), \
        torch.zeros((1, 8, 6), dtype=torch.int32)
    v = _DecodeViews.of(i64, i32, tables, 5, 4)
    assert v.input_ids.tolist() == [0, 1, 2, 3, 4] and v.slot_mapping.tolist() == [16, 17, 18, 19, 20]
    assert v.query_start_loc.tolist() == [18, 19, 20, 21, 22, 23] and tuple(v.block_tables.shape) == (5, 4)
    moved = v.to(torch.device("meta"))
    assert all(getattr(moved, f).is_meta and getattr(moved, f).shape == getattr(v, f).shape
               for f in ("input_ids", "positions", "slot_mapping", "seq_lens", "prompt_lens", "query_start_loc",
                         "block_tables"))
    assert moved.sample_rows is v.sample_rows
