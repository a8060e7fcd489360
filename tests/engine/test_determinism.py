"""Deterministic inference (EngineConfig.deterministic, docs/determinism.md): one request's tokens
and logprobs are identical alone, inside batches of 2, 7, 16 and 64 random requests at random
positions, after a prefix-cache hit, under step budgets of 16, 64 and 512, after a preemption, and
(greedy) with n-gram speculation on; for bf16 and fp32 tiny models, greedy and seeded sampling.
A deliberately batch-dependent linear (a test double) must make the same checks fail.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from server.engine.config import ConfigError, EngineConfig
from server.engine.sampling_params import SamplingParams
from server.kernels import batch_invariant, ops
from server.kernels.quant import QuantizedWeight
from tests.engine.determinism_check import DeterminismChecker, default_situations


def _vocab(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def _target(checker: DeterminismChecker) -> list[int]:
    # Periodic, so the n-gram proposer finds matches and speculation really drafts tokens.
    motif = checker.random_prompt(7, 7)
    return (motif * 7)[:45]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_one_request_is_invariant_to_everything_around_it(tiny_model, dtype: str, params: SamplingParams) -> None:
    model_dir = tiny_model("llama", dtype=dtype)
    checker = DeterminismChecker(model_dir, {"dtype": dtype, "deterministic": True}, _vocab(model_dir), seed=7)
    greedy = params.temperature == 0.0
    report = checker.check(_target(checker), params, default_situations(greedy))
    assert len(report.reference[0]) == 12 and len(report.reference[1]) == 12
    assert report.mismatches == {}
    # The situations really happened: a prefix hit, a preemption, verified speculative drafts.
    assert report.evidence["prefix_hit_tokens"] >= 32
    assert report.evidence["preemptions"] == 1
    if greedy:
        assert report.evidence["spec_proposed"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_thread_count_does_not_change_results(tiny_model, dtype: str) -> None:
    from tests.engine.determinism_check import Situation

    model_dir = tiny_model("llama", dtype=dtype)
    threads = torch.get_num_threads()
    try:
        checker = DeterminismChecker(model_dir, {"dtype": dtype, "deterministic": True, "num_threads": 2},
                                     _vocab(model_dir), seed=5)
        report = checker.check(_target(checker), SEEDED, [Situation("threads-1", {"num_threads": 1}, others=7),
                                                           Situation("threads-3", {"num_threads": 3}, others=7)])
    finally:
        torch.set_num_threads(threads)
    assert report.mismatches == {}


def test_sliding_window_rows_do_not_depend_on_chunking(tiny_model) -> None:
    # Mistral's tiny window (24) is shorter than the prompt, so chunks start inside the window at
    # different offsets; the attention's spans stay aligned to 64 positions whatever the chunk.
    model_dir = tiny_model("mistral")
    checker = DeterminismChecker(model_dir, {"deterministic": True}, _vocab(model_dir), seed=11)
    prompt = checker.random_prompt(90, 90)
    params = GREEDY.clone(max_tokens=8)
    situations = default_situations(True, batch_sizes=(7,), budgets=(16, 64))
    report = checker.check(prompt, params, [s for s in situations if s.name != "ngram-spec"])
    assert report.mismatches == {}


def test_fixed_block_rms_norm_rows_do_not_depend_on_the_batch() -> None:
    from server.models.layers import rms_norm, rms_norm_fixed_blocks

    torch.manual_seed(3)
    x = torch.randn(37, 3, 24, dtype=torch.bfloat16)
    w = torch.randn(3, 24, dtype=torch.bfloat16)
    alone = rms_norm_fixed_blocks(x[20:21], w, 1e-6)
    assert torch.equal(rms_norm_fixed_blocks(x, w, 1e-6)[20:21], alone)
    assert torch.equal(rms_norm_fixed_blocks(x[5:30], w, 1e-6)[15:16], alone)
    assert torch.allclose(rms_norm_fixed_blocks(x, w, 1e-6).float(), rms_norm(x, w, 1e-6).float())


def _split_k_linear(x: torch.Tensor, weight, bias=None) -> torch.Tensor:
    """A batch-dependent reduction on purpose: K is summed in 1 + (rows % 3) chunks, each rounded to
    x's dtype, so a row's rounding depends on how many rows share the call."""
    chunks = 1 + x.shape[0] % 3
    k = x.shape[-1]
    if isinstance(weight, QuantizedWeight):  # a bf16 matrix in the x8 layout (AVX2 CPUs)
        weight = weight.dequantize(x.dtype)
    bounds = [k * i // chunks for i in range(chunks + 1)]
    out = sum(F.linear(x[..., a:b], weight[:, a:b]) for a, b in zip(bounds, bounds[1:]))
    assert isinstance(out, torch.Tensor)
    return out if bias is None else out + bias


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checker_catches_a_batch_dependent_reduction(tiny_model, monkeypatch, dtype: str) -> None:
    model_dir = tiny_model("llama", dtype=dtype)
    import server.models.decoder as llama
    import server.models.decoder_layer as llama_layer

    # Both modules' `linear`: the layers' projections and the model's lm_head.
    monkeypatch.setattr(llama, "linear", _split_k_linear)
    monkeypatch.setattr(llama_layer, "linear", _split_k_linear)
    checker = DeterminismChecker(model_dir, {"dtype": dtype, "deterministic": True}, _vocab(model_dir), seed=7)
    report = checker.check(_target(checker), GREEDY, default_situations(True, batch_sizes=(2, 7), budgets=(16,)))
    # The alone run differs from the batched ones at least in logprobs.
    assert report.mismatches, "the checker did not detect a batch-dependent reduction"
    assert any(name.startswith("batch-") for name in report.mismatches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    # K not a multiple of 16 or 32 and N not of 4 or 8: the kernels' tails are covered too.
    w = torch.randn(203, 77, dtype=dtype)
    b = torch.randn(203, dtype=dtype)
    x = torch.randn(300, 77, dtype=dtype)
    with batch_invariant.mode(True):
        alone = [ops.linear(x[i : i + 1], w, b) for i in (0, 5, 150)]
        for m in (2, 7, 16, 17, 64, 300):
            y = ops.linear(x[:m], w, b)
            assert torch.equal(y[:1], alone[0]), m
            if m > 5:
                assert torch.equal(y[5:6], alone[1]), m
        assert torch.equal(ops.linear(x, w, b)[150:151], alone[2])
        # Within float rounding of the float64 reference.
        ref = (x.double() @ w.double().T + b.double()).to(dtype)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert torch.allclose(ops.linear(x, w, b).float(), ref.float(), rtol=tol, atol=tol * 10)


def test_quantized_linear_rows_do_not_depend_on_the_batch() -> None:
    from server.kernels.quant import QuantizedWeight

    torch.manual_seed(1)
    w = QuantizedWeight.quantize(torch.randn(96, 64))
    x = torch.randn(70, 64)
    with batch_invariant.mode(True):
        alone = ops.linear(x[3:4], w)
        for m in (4, 16, 17, 70):
            assert torch.equal(ops.linear(x[:m], w)[3:4], alone), m


def test_sampler_rows_do_not_depend_on_the_batch() -> None:
    from server.engine.sampler import Sampler, SamplingBatch

    torch.manual_seed(2)
    v = 300
    logits = torch.randn(64, v) * 3
    logits[:, 10:20] = 5.0  # ties at the top, where an unstable sort could reorder them
    target = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=99, logprobs=3)
    others = [SamplingParams(temperature=t, top_p=p, logprobs=1) for t, p in [(0.0, 1.0), (1.2, 0.5), (0.7, 0.95)]]

    def run(rows: list[int], at: int) -> tuple[int, float, list[float]]:
        params = [others[i % 3] for i in range(len(rows))]
        params[at] = target
        gens: list = [None] * len(rows)
        g = torch.Generator()
        g.manual_seed(99)
        gens[at] = g
        batch = SamplingBatch.build(params, gens, [[]] * len(rows), [[]] * len(rows), None, v, "cpu")
        with batch_invariant.mode(True):
            out = Sampler(seed=5)(logits[rows], batch)
        assert out.logprobs is not None and out.top_logprobs is not None
        return int(out.token_ids[at]), float(out.logprobs[at]), out.top_logprobs[at].tolist()

    alone = run([0], 0)
    for n, at in [(2, 1), (7, 3), (64, 40)]:
        rows = list(range(1, n))
        rows.insert(at, 0)
        assert run(rows, at) == alone, (n, at)


def test_deterministic_config_field(tiny_model) -> None:
    from server import LLM

    assert EngineConfig(model="m").deterministic is None  # auto
    assert EngineConfig(model="m", deterministic=True).deterministic is True
    with pytest.raises(ConfigError, match="^deterministic:"):
        EngineConfig(model="m", deterministic="yes")  # type: ignore[arg-type]
    llm = LLM(str(tiny_model("llama")), deterministic=True, max_model_len=64, kv_cache_tokens=256)
    assert llm.engine.config.deterministic is True and llm.engine.deterministic is True
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert not batch_invariant.enabled()  # the mode is scoped to each engine step


def test_auto_turns_the_mode_on_only_where_it_is_cheap(tiny_model) -> None:
    from server import LLM

    # The rule (measured in bench/RESULTS.md): CPU, bf16 weights kept in bf16, an AVX2 or AVX512-BF16 CPU.
    assert batch_invariant.cheap_here("cpu", "bfloat16", "none", "avx2")
    assert batch_invariant.cheap_here("cpu", "float32", "none", "avx2")
    assert not batch_invariant.cheap_here("cpu", "float16", "none", "avx2")
    assert not batch_invariant.cheap_here("cpu", "bfloat16", "int8", "avx2")
    assert batch_invariant.cheap_here("cpu", "bfloat16", "none", "avx512bf16")
    assert not batch_invariant.cheap_here("cpu", "float32", "none", "avx512bf16")
    assert not batch_invariant.cheap_here("cpu", "bfloat16", "none", "amx")
    assert not batch_invariant.cheap_here("cpu", "bfloat16", "gguf", "avx512bf16")
    assert not batch_invariant.cheap_here("cpu", "bfloat16", "none", "portable")
    assert not batch_invariant.cheap_here("cuda", "bfloat16", "none", "avx2")
    # The engine resolves auto with its own dtype and this CPU; an explicit value always wins.
    path = str(tiny_model("llama"))
    for dtype in ("bfloat16", "float32"):
        auto = LLM(path, dtype=dtype, max_model_len=64, kv_cache_tokens=256).engine
        assert auto.deterministic is batch_invariant.cheap_here("cpu", dtype, "none", ops.cpu_isa())
        off = LLM(path, dtype=dtype, deterministic=False, max_model_len=64, kv_cache_tokens=256).engine
        assert off.deterministic is False


def test_serve_flag_takes_on_off_or_auto() -> None:
    import argparse

    from server.serving.settings import add_serve_arguments, settings_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert settings_from_args(p.parse_args(["--deterministic", "on"]), {}).engine_config("m").deterministic is True
    assert settings_from_args(p.parse_args(["--deterministic", "off"]), {}).deterministic is False
    assert settings_from_args(p.parse_args(["--deterministic", "auto"]), {}).deterministic is None
    assert settings_from_args(p.parse_args([]), {}).engine_config("m").deterministic is None
    assert settings_from_args(p.parse_args([]), {"PAGEWIRE_DETERMINISTIC": "on"}).deterministic is True
    with pytest.raises(SystemExit):
        p.parse_args(["--deterministic", "maybe"])
    with pytest.raises(ValueError, match="PAGEWIRE_DETERMINISTIC"):
        settings_from_args(p.parse_args([]), {"PAGEWIRE_DETERMINISTIC": "maybe"})


def test_the_mode_is_per_thread_and_restored() -> None:
    """Both copies of the flag: Python's, and the C++ ops' (which keeps AMX out of the mode)."""
    import threading

    import server._C

    seen: list[tuple[bool, bool]] = []
    with batch_invariant.mode(True):
        t = threading.Thread(target=lambda: seen.append((batch_invariant.enabled(), server._C.batch_invariant())))
        t.start()
        t.join()
        assert batch_invariant.enabled() and server._C.batch_invariant()
        with batch_invariant.mode(False):
            assert not server._C.batch_invariant()
        assert server._C.batch_invariant()
    assert not batch_invariant.enabled() and not server._C.batch_invariant()
    assert seen == [(False, False)]


@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_real_model_is_invariant(params: SamplingParams) -> None:
    from server.models.default_model import find_default_model, missing_default_model_message

    found = find_default_model()
    if found is None:
        pytest.skip(missing_default_model_message())
    checker = DeterminismChecker(found.path, {"dtype": "bfloat16", "deterministic": True, "num_threads": 1},
                                 49152, seed=3)
    situations = default_situations(params.temperature == 0.0, batch_sizes=(7, 16), budgets=(16, 512))
    short = params.clone(max_tokens=6)
    report = checker.check(_target(checker), short, situations)
    assert len(report.reference[0]) == 6 and len(report.reference[1]) == 6
    assert report.mismatches == {}
