"""Speculative decoding with a draft model: outputs identical to speculation off.

Two drafts: the target itself (every proposal must be accepted) and an unrelated random model of
the same vocabulary (almost nothing is accepted; the output must not change either). Each runs
under chunked prefill, prefix hits, preemption under KV pressure, aborts in flight, stop strings
and n = 4, with both allocators' invariants checked after every step (the draft's KV is rolled
back after every verification) and both pools empty at the end. Start-up refuses a draft whose
vocabulary differs, naming the field.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from server import LLM, SamplingParams
from server.engine.config import ConfigError
from server.engine.engine import LLMEngine
from server.engine.kv_budget import kv_bytes_per_token
from tests.engine.test_spec_decode import _check_kv, _engine, _prompts, _reference, _spec_stats, _vocab


def _spec(draft: Path, k: int = 4, **kw: Any) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
            "disable_by_batch_size": 0, "min_acceptance_rate": 0.0, **kw}


@pytest.fixture(scope="module")
def other_draft(tiny_model) -> Path:
    """A different random model with the target's tokenizer: its proposals are nearly always wrong."""
    return tiny_model("llama", seed=7, num_hidden_layers=1)


def _check_draft_kv(engine: LLMEngine) -> None:
    """The draft's allocator keeps its invariants, and holds blocks only for running sequences:
    for the tokens the target had verified when the draft last proposed, plus at most k - 1
    proposals (rolled back at verification, or at the next proposal when the scheduler dropped
    them); only verified tokens are registered in the draft's prefix cache."""
    draft = engine.draft
    assert draft is not None
    draft.kv.check_invariants()
    k = engine.spec.config.num_speculative_tokens if engine.spec is not None else 0
    running = {s.seq_id: s for s in engine.scheduler.running}
    for sid, d in draft._drafts.items():
        assert sid in running, "a finished or preempted sequence kept its draft KV"
        seq, sh = running[sid], d.shadow
        assert d.verified <= seq.num_tokens and sh.token_ids[: d.verified] == seq.token_ids[: d.verified]
        assert sh.num_computed_tokens <= d.verified + k - 1
        assert draft.kv.registered_tokens(sh) <= min(d.verified, sh.num_computed_tokens)


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            for s in d.samples:
                out.setdefault(f"{d.request_id}#{s.index}", []).extend(s.token_ids)
        _check_kv(engine)
        _check_draft_kv(engine)
    return out


def _assert_pools_empty(engine: LLMEngine) -> None:
    assert engine.kv_cache.stats().used_blocks == 0
    assert engine.draft is not None and engine.draft.kv.stats().used_blocks == 0 and not engine.draft._drafts


def _greedy(max_tokens: int = 40, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("which", ["self", "other"])
def test_greedy_identical_with_chunked_prefill(tiny_model, other_draft: Path, which: str) -> None:
    model_dir = tiny_model("llama")
    draft = model_dir if which == "self" else other_draft
    prompts = _prompts(5, _vocab(model_dir), 20, 70, seed=11)
    params = _greedy()
    # A 32-token budget: prompts prefill in chunks, in the target and in the draft.
    engine = _engine(model_dir, _spec(draft), max_num_batched_tokens=32)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    assert _run(engine) == _reference(model_dir, prompts, params, max_num_batched_tokens=32)
    s = _spec_stats(engine)
    assert s.num_proposed > 100
    if which == "self":
        assert s.num_accepted == s.num_proposed  # the target proposing for itself is always right
        assert s.mean_accepted_length == pytest.approx(5.0, abs=0.5)
    else:
        assert s.acceptance_rate < 0.1, s
    _assert_pools_empty(engine)


def test_kv_budget_is_shared_with_the_draft(tiny_model) -> None:
    model_dir = tiny_model("llama")
    plain = _engine(model_dir, None, kv_cache_tokens=2048)
    spec = _engine(model_dir, _spec(model_dir), kv_cache_tokens=2048)
    assert spec.kv_layout.draft_bytes_per_token == plain.kv_layout.bytes_per_token
    # The target as its own draft: the same budget, half the blocks each.
    assert spec.kv_layout.num_blocks == plain.kv_layout.num_blocks // 2
    assert spec.draft is not None and spec.draft.kv.num_blocks == spec.kv_layout.num_blocks
    assert "draft model" in spec.kv_layout.log_line()
    mc = spec.model_config
    assert spec.kv_layout.draft_bytes_per_token == kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, 4)


@pytest.mark.parametrize("which", ["self", "other"])
def test_prefix_hits(tiny_model, other_draft: Path, which: str) -> None:
    model_dir = tiny_model("llama")
    draft = model_dir if which == "self" else other_draft
    prompts = _prompts(3, _vocab(model_dir), 40, 60, seed=12)
    params = _greedy(32)
    ref = _reference(model_dir, prompts, params)
    engine = _engine(model_dir, _spec(draft), block_size=4)
    for round_ in range(2):  # round 2 hits both prefix caches (the target's and the draft's)
        for i, p in enumerate(prompts):
            engine.add_request(f"{round_}-{i}", p, params)
        assert _run(engine) == {f"{round_}-{k}": v for k, v in ref.items()}
    assert engine.kv_cache.stats().prefix_hit_tokens > 0
    assert engine.draft is not None and engine.draft.kv.stats().prefix_hit_tokens > 0
    s = _spec_stats(engine)
    assert s.num_proposed > 0 and (s.num_accepted == s.num_proposed if which == "self" else True)
    _assert_pools_empty(engine)


@pytest.mark.parametrize("which", ["self", "other"])
def test_preemption_under_kv_pressure(tiny_model, other_draft: Path, which: str) -> None:
    model_dir = tiny_model("llama")
    draft = model_dir if which == "self" else other_draft
    prompts = _prompts(6, _vocab(model_dir), 50, 70, seed=13)
    params = _greedy()
    # 512 tokens of target KV split with the draft: about 256 tokens each, for 6 x ~110 tokens.
    engine = _engine(model_dir, _spec(draft), kv_cache_tokens=512, max_model_len=128)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got = _run(engine)
    assert engine.scheduler.num_preemptions > 0
    assert got == _reference(model_dir, prompts, params)
    s = _spec_stats(engine)
    assert s.num_proposed > 0 and (s.num_accepted == s.num_proposed if which == "self" else True)
    _assert_pools_empty(engine)


def test_abort_in_flight(tiny_model) -> None:
    model_dir = tiny_model("llama")
    prompts = _prompts(4, _vocab(model_dir), 30, 40, seed=14)
    params = _greedy(60)
    engine = _engine(model_dir, _spec(model_dir))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {}
    aborted = False
    while engine.has_unfinished_requests():
        for d in engine.step():
            for s in d.samples:
                out.setdefault(f"{d.request_id}#{s.index}", []).extend(s.token_ids)
        _check_kv(engine)
        _check_draft_kv(engine)
        if not aborted and _spec_stats(engine).num_accepted > 0 and "1" in engine.requests:
            assert engine.draft is not None
            assert any(s.request.request_id == "1" for s in engine.scheduler.running)
            assert engine.abort_request("1")  # between steps, with draft KV in flight
            aborted = True
    assert aborted
    ref = _reference(model_dir, prompts, params)
    for i in (0, 2, 3):
        assert out[f"{i}#0"] == ref[f"{i}#0"]
    assert ref["1#0"][: len(out["1#0"])] == out["1#0"] and len(out["1#0"]) < 60
    _assert_pools_empty(engine)


@pytest.mark.parametrize("which", ["self", "other"])
def test_stop_strings_and_stop_ids(tiny_model, other_draft: Path, which: str) -> None:
    model_dir = tiny_model("llama")
    draft = model_dir if which == "self" else other_draft
    prompts = _prompts(2, _vocab(model_dir), 30, 40, seed=15)
    kw = dict(max_model_len=256, kv_cache_tokens=4096)
    llm_off = LLM(str(model_dir), **kw)
    llm_on = LLM(str(model_dir), speculative_config=_spec(draft), **kw)
    base = _greedy()
    ref = [o.outputs[0] for o in llm_off.generate(prompts, base)]
    cases = [base, base.clone(max_tokens=13), base.clone(logprobs=2)]
    for r in ref:
        cases.append(base.clone(stop_token_ids=[r.token_ids[9]]))
        if len(r.text) >= 12:
            cases.append(base.clone(stop=[r.text[len(r.text) // 2: len(r.text) // 2 + 3]]))
    for sp in cases:
        off = [o.outputs[0] for o in llm_off.generate(prompts, sp)]
        on = [o.outputs[0] for o in llm_on.generate(prompts, sp)]
        for a, b in zip(off, on):
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
                a.token_ids, a.text, a.finish_reason, a.stop_reason), sp
    s = _spec_stats(llm_on.engine)
    assert s.num_proposed > 0 and (s.num_accepted == s.num_proposed if which == "self" else True)
    _assert_pools_empty(llm_on.engine)


@pytest.mark.parametrize("which", ["self", "other"])
def test_n4_greedy_and_seeded_sampling(tiny_model, other_draft: Path, which: str) -> None:
    model_dir = tiny_model("llama")
    draft = model_dir if which == "self" else other_draft
    prompts = _prompts(2, _vocab(model_dir), 25, 35, seed=16)
    greedy = SamplingParams(n=4, temperature=0.0, max_tokens=30, ignore_eos=True)
    ref = _reference(model_dir, prompts, greedy)
    engine = _engine(model_dir, _spec(draft))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy)
    assert _run(engine) == ref
    s = _spec_stats(engine)
    assert s.num_verified > 8  # the forked samples speculate too (from sample 0's forked draft KV)
    _assert_pools_empty(engine)
    # Sampled requests use the draft's q in rejection sampling; seeded ones reproduce exactly.
    sampled = SamplingParams(n=4, temperature=0.8, top_k=50, seed=99, max_tokens=30, ignore_eos=True)
    llm = LLM(str(model_dir), max_model_len=256, kv_cache_tokens=4096, speculative_config=_spec(draft))
    alone = llm.generate([prompts[0]], sampled)[0]
    again = llm.generate([prompts[0]], sampled)[0]
    for a, b in zip(alone.outputs, again.outputs):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 30
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1  # the samples really differ
    s = _spec_stats(llm.engine)
    assert s.num_proposed > 0 and (s.num_accepted > 0 if which == "self" else True)
    _assert_pools_empty(llm.engine)


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_vocabulary_mismatch_is_refused_at_start_up(tiny_model, tmp_path: Path) -> None:
    model_dir = tiny_model("llama")
    # A different tokenizer size (and so a different vocab_size).
    bigger = tiny_model("llama", tokenizer_vocab_size=600)
    # The same size, but two token strings swapped.
    swapped = _copy_model(model_dir, tmp_path / "swapped")
    tj = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tj))
    # The same vocabulary, another EOS.
    eos = _copy_model(model_dir, tmp_path / "eos")
    (eos / "generation_config.json").write_text(json.dumps({"eos_token_id": [7]}))
    cfg = json.loads((eos / "config.json").read_text())
    cfg["eos_token_id"] = 7
    (eos / "config.json").write_text(json.dumps(cfg))
    cases = [(bigger, "vocab_size"), (swapped, "token id"), (eos, "EOS"),
             (tmp_path / "missing", "cannot load the draft model")]
    for draft, words in cases:
        with pytest.raises(ConfigError) as e:
            LLM(str(model_dir), speculative_config=_spec(draft))
        assert e.value.field == "speculative_config.model" and words in str(e.value), str(e.value)


def test_invalid_draft_config_fields(tiny_model) -> None:
    model_dir = str(tiny_model("llama"))
    cases = [
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"method": "draft_model", "model": ""}, "speculative_config.model"),
        ({"method": "draft_model", "model": 3}, "speculative_config.model"),
        ({"method": "draft_model", "model": model_dir, "num_speculative_tokens": 0},
         "speculative_config.num_speculative_tokens"),
        ({"method": "draft_model", "model": model_dir, "num_speculative_tokens": 17},
         "speculative_config.num_speculative_tokens"),
        ({"method": "draft_model", "model": model_dir, "draft_dtype": "float16"}, "speculative_config.draft_dtype"),
        ({"method": "ngram", "model": model_dir}, "speculative_config.model"),
    ]
    for value, field in cases:
        with pytest.raises(ConfigError) as e:
            LLM(model_dir, speculative_config=value)
        assert e.value.field == field and str(e.value).startswith(field + ":"), (value, str(e.value))


def test_serve_refuses_a_mismatched_draft_before_starting(tiny_model) -> None:
    model_dir = tiny_model("llama")
    bigger = tiny_model("llama", tokenizer_vocab_size=600)
    for draft, words in ((bigger, "vocab_size"), (Path("/nonexistent/draft"), "cannot load the draft model")):
        spec = json.dumps(_spec(draft))
        p = subprocess.run([sys.executable, "-m", "server.cli", "serve", str(model_dir), "--port", "0",
                            "--speculative-config", spec], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        assert "--speculative-config: speculative_config.model:" in p.stderr and words in p.stderr, p.stderr
        assert "Traceback" not in p.stderr


def test_priority_preemption_frees_and_recomputes_the_draft(tiny_model) -> None:
    model_dir = tiny_model("llama")
    vocab = _vocab(model_dir)
    low = _prompts(2, vocab, 20, 24, seed=17)
    urgent = _prompts(1, vocab, 20, 24, seed=18)[0]
    params = _greedy()
    engine = _engine(model_dir, _spec(model_dir), max_num_seqs=2)
    for i, p in enumerate(low):
        engine.add_request(f"low{i}", p, params, priority=5)
    out: dict[str, list[int]] = {}

    def step() -> None:
        for d in engine.step():
            for s in d.samples:
                out.setdefault(d.request_id, []).extend(s.token_ids)
        _check_kv(engine)
        _check_draft_kv(engine)

    while _spec_stats(engine).num_verified == 0:  # the low-priority pair is speculating
        step()
    assert engine.draft is not None and len(engine.draft._drafts) == 2
    engine.add_request("urgent", urgent, params, priority=0)
    step()
    assert engine.scheduler.num_preemptions == 1
    running = {s.seq_id for s in engine.scheduler.running}
    assert set(engine.draft._drafts) <= running  # the victim's draft K/V went with its target K/V
    while engine.has_unfinished_requests():
        step()
    ref = _reference(model_dir, low + [urgent], params)
    assert [out["low0"], out["low1"], out["urgent"]] == [ref["0#0"], ref["1#0"], ref["2#0"]]
    s = _spec_stats(engine)
    assert s.num_accepted == s.num_proposed
    _assert_pools_empty(engine)


def test_gguf_draft(tiny_model, tmp_path: Path) -> None:
    """A GGUF file as the draft (here the target's own weights, written as GGUF): it loads, passes
    the vocabulary check against a GGUF target and accepts every proposal."""
    from tests.gguf_files import write_gguf

    hf_dir = tiny_model("llama")
    target = write_gguf(tmp_path / "target.gguf", hf_dir, "F32")
    draft = write_gguf(tmp_path / "draft.gguf", hf_dir, "F32")
    prompts = _prompts(2, _vocab(hf_dir), 20, 30, seed=19)
    params = _greedy(24)
    engine = _engine(target, _spec(draft))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    assert _run(engine) == _reference(target, prompts, params)
    s = _spec_stats(engine)
    assert s.num_proposed > 0 and s.num_accepted == s.num_proposed
    _assert_pools_empty(engine)
    with pytest.raises(ConfigError) as e:  # an HF folder's vocabulary is not this GGUF's
        LLM(str(target), speculative_config=_spec(tiny_model("llama", tokenizer_vocab_size=600)))
    assert e.value.field == "speculative_config.model"


@pytest.mark.parametrize("target_arch", ["gemma4", "llama"])
def test_gemma4_draft(tiny_model, target_arch: str) -> None:
    """A Gemma 4 draft (global layers' K/V twice a local one's, two layers reading earlier layers'
    KV): its pool is packed by the KV-groups machinery, every layer full, and speculation gives the
    target's greedy tokens: proposing for itself (every proposal accepted) and for a Llama target
    of the same vocabulary. Its pool's blocks cost what its groups' slots hold."""
    from server.engine.draft_proposer import draft_kv_groups

    draft = tiny_model("gemma4")
    model_dir = draft if target_arch == "gemma4" else tiny_model("llama")
    prompts = _prompts(3, _vocab(model_dir), 20, 50, seed=23)
    params = _greedy(30)
    engine = _engine(model_dir, _spec(draft), max_num_batched_tokens=32)
    assert engine.draft is not None
    groups = engine.draft.runner.groups
    assert groups == draft_kv_groups(engine.draft.model.config)
    assert all(w == 0 for w in groups.windows) and groups.slot_elems and len(set(groups.layer_ratio)) == 2
    assert engine.kv_layout.draft_bytes_per_token == 2 * groups.group_size * groups.slot_elems * 4
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    assert _run(engine) == _reference(model_dir, prompts, params, max_num_batched_tokens=32)
    s = _spec_stats(engine)
    assert s.num_proposed > 0
    if target_arch == "gemma4":
        assert s.num_accepted == s.num_proposed
    _assert_pools_empty(engine)
