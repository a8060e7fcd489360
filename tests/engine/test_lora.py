"""LoRA adapters in the engine: greedy tokens equal transformers + PEFT's, token for token, for
base and adapter requests mixed in one batch and several adapters at once; the prefix cache never
hands one adapter's (or the base model's) blocks to another; steps with adapter rows keep the
fused decode_layer path with the same floats as the Python layers (deterministic mode's
per-adapter terms take the Python layers)."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from server import LLM, SamplingParams
from tests.lora_adapters import make_lora_adapter, peft_greedy

MAX_NEW = 12


@pytest.fixture(scope="module")
def lora_setup(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny llama and three adapters: every projection at r=4; attention only at r=8 with
    rsLoRA; the MLP only at r=2 with a regex target."""
    model = tiny_model("llama")
    root = tmp_path_factory.mktemp("lora")
    return {
        "model": model,
        "all": make_lora_adapter(model, root / "all", r=4, alpha=8, seed=1),
        "attn": make_lora_adapter(model, root / "attn", targets=["q_proj", "k_proj", "v_proj", "o_proj"], r=8,
                                  alpha=16, seed=2, use_rslora=True),
        "mlp": make_lora_adapter(model, root / "mlp", targets=["gate_proj", "up_proj", "down_proj"], r=2, alpha=4,
                                 seed=3),
    }


def _prompts(n: int, vocab: int, seed: int, lo: int = 5, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _llm(s: dict[str, Path], **kw: object) -> LLM:
    return LLM(str(s["model"]), max_model_len=256, kv_cache_tokens=4096,
               lora_modules={n: str(s[n]) for n in ("all", "attn", "mlp")}, **kw)  # type: ignore[arg-type]


def test_adapters_change_the_output(lora_setup: dict[str, Path]) -> None:
    """The reference itself: each adapter's greedy tokens differ from the base model's (else the
    exactness tests below would prove nothing about the low-rank term)."""
    s = lora_setup
    prompt = _prompts(1, _vocab(s["model"]), seed=5)[0]
    base = peft_greedy(s["model"], None, prompt, MAX_NEW)
    for name in ("all", "attn", "mlp"):
        assert peft_greedy(s["model"], s[name], prompt, MAX_NEW) != base, name


@pytest.mark.parametrize("deterministic", [False, True])
def test_mixed_batch_matches_peft(lora_setup: dict[str, Path], deterministic: bool) -> None:
    """Base and three adapters' requests in the same steps (prefill chunks and decodes mixed), each
    token for token equal to transformers + PEFT alone: the stacked terms (default) and the
    per-adapter ones of deterministic mode."""
    s = lora_setup
    names: list[Optional[str]] = [None, "all", "attn", "mlp", "all", None, "mlp", "attn"]
    prompts = _prompts(len(names), _vocab(s["model"]), seed=7)
    llm = _llm(s, max_num_batched_tokens=64, deterministic=deterministic)
    assert llm.engine.deterministic is deterministic
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), lora=names)
    for name, p, o in zip(names, prompts, outs):
        want = peft_greedy(s["model"], s[name] if name else None, p, MAX_NEW)
        assert o.outputs[0].token_ids == want, name


def test_all_rows_one_adapter_and_fused_path(lora_setup: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch where every row uses an adapter (no row gather) matches PEFT; its steps (up to 16
    rows) run decode_layer with the stacked terms, as base steps do, in deterministic mode too
    (the kernel's terms are row-independent, so that mode needs no per-adapter path on CPU)."""
    s = lora_setup
    prompts = _prompts(3, _vocab(s["model"]), seed=11)
    llm = _llm(s, deterministic=False)
    model = llm.engine.model
    calls: list[bool] = []
    real = type(model)._fused_kinds

    def spy(self, hidden, batches):  # type: ignore[no-untyped-def]
        kinds = real(self, hidden, batches)
        calls.append(kinds is not None)
        return kinds

    monkeypatch.setattr(type(model), "_fused_kinds", spy)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), lora="attn")
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == peft_greedy(s["model"], s["attn"], p, MAX_NEW)
    # The first step prefills the three prompts (more than 16 rows: the Python layers); every decode fused.
    assert len(calls) >= MAX_NEW - 1 and not calls[0] and all(calls[1:])
    calls.clear()
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=3))
    assert calls and calls[-1]  # the base model's decodes: decode_layer
    calls.clear()
    exact = _llm(s, deterministic=True)
    out = exact.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=MAX_NEW), lora="attn")[0]
    assert out.outputs[0].token_ids == peft_greedy(s["model"], s["attn"], prompts[0], MAX_NEW)
    assert exact.engine.deterministic and calls[1:] and all(calls[1:])  # its decodes: decode_layer


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_terms_give_the_python_layers_floats(lora_setup: dict[str, Path], dtype: str) -> None:
    """decode_layer adds the stacked terms op for op as the Python layers do: logits and every KV
    byte equal, for base and adapter rows mixed (the row gather) and all rows on adapters (none),
    prefill chunks and decodes."""
    from tests.models.paged_harness import PagedRun

    s = lora_setup
    llm = _llm(s, dtype=dtype, deterministic=False)
    model, lora = llm.engine.model, llm.engine.lora
    assert lora is not None
    vocab = _vocab(s["model"])
    toks = _prompts(3, vocab, seed=19, lo=20, hi=20)
    for slots in ([0, lora.slot("all"), lora.slot("mlp")], [lora.slot("attn"), lora.slot("all"), lora.slot("attn")]):
        steps = [{0: toks[0][:9], 1: toks[1][:5]}, {1: toks[1][5:9], 2: toks[2][:9]}]
        steps += [{q: [toks[q][t]] for q in range(3)} for t in range(9, 16)]
        runs = []
        for fused in (True, False):
            model.fused_decode = fused
            run = PagedRun(model, seed=3)
            logits = []
            for st in steps:
                row_slots = [slots[q] for q, ids in st.items() for _ in ids]
                step = lora.step(row_slots)
                assert step is not None and step.fusable
                logits.append(run.step(st, step))
            runs.append((logits, run))
        (lf, rf), (lp, rp) = runs
        for a, b in zip(lf, lp):
            for q in a:
                assert torch.equal(a[q], b[q]), (slots, q)
        for (kf, vf), (kp, vp) in zip(rf.kv_caches, rp.kv_caches):
            assert torch.equal(kf, kp) and torch.equal(vf, vp)
    model.fused_decode = True


def test_prefix_cache_is_keyed_by_adapter(lora_setup: dict[str, Path]) -> None:
    """The same 49-token prompt (three full blocks before its last token) under the base model,
    adapter `all`, again `all`, `attn`, and the base model again: only the repeats hit the cache
    (each its own earlier blocks), and every answer is still PEFT's."""
    s = lora_setup
    prompt = _prompts(1, _vocab(s["model"]), seed=13, lo=49, hi=49)[0]
    llm = _llm(s)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    hits = []
    for name in (None, "all", "all", "attn", None):
        before = llm.engine.kv_cache.stats().prefix_hit_tokens
        out = llm.generate([prompt], params, lora=name)[0]
        hits.append(llm.engine.kv_cache.stats().prefix_hit_tokens - before)
        assert out.outputs[0].token_ids == peft_greedy(s["model"], s[name] if name else None, prompt, MAX_NEW), name
    assert hits == [0, 0, 48, 0, 48]


def test_deterministic_mode_keeps_an_adapter_row_independent_of_its_batch(lora_setup: dict[str, Path]) -> None:
    """Deterministic mode: an adapter request's tokens and logprobs are bit for bit the same alone
    and among other adapters' and base requests."""
    s = lora_setup
    prompts = _prompts(5, _vocab(s["model"]), seed=17)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0)
    llm = _llm(s, deterministic=True, enable_prefix_caching=False)
    alone = llm.generate(prompts[:1], params, lora="all")[0].outputs[0]
    mixed = llm.generate(prompts, params, lora=["all", "attn", None, "mlp", "all"])[0].outputs[0]
    assert mixed.token_ids == alone.token_ids
    assert [lp.logprob for lp in mixed.logprobs] == [lp.logprob for lp in alone.logprobs]


def test_unknown_adapter_is_refused(lora_setup: dict[str, Path]) -> None:
    llm = _llm(lora_setup)
    with pytest.raises(ValueError, match="model: no LoRA adapter named 'nope'; the adapters are all, attn, mlp"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora="nope")
