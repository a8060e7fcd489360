"""server.kernels.autotune: the start-up table of linear paths, and ops.linear following it.

Which path ran is read from the profiler's op names (pagewire::linear / linear_q8_0 for the
kernels, aten::linear for torch's GEMM), so the kernels themselves are never replaced.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from server.engine.config import ConfigError, EngineConfig
from server.kernels import autotune, batch_invariant, linear_plan, linear_route, ops
from server.kernels.autotune import BUCKETS, LARGE, LARGE_M, LinearTable, Site, bucket, tune
from server.kernels.quant import QuantizedWeight
from server.models.decoder import BF16_X8_MAX_K
from server.models.loader import load_model
from tests.kernels.test_quant4 import random_q4

ROWS = [1, 2, 3, 4, 7, 8, 12, 16, 17, 32, 40]  # every bucket, edges and insides
# Tests of the float kernel path need a CPU that has it (x86 with AVX2); the portable family is
# covered by test_portable_cpu_tunes_nothing_and_gets_f_linear.
needs_kernels = pytest.mark.skipif(ops.cpu_isa() == "portable", reason="no AVX2 / AVX512-BF16 kernels")


def gemm_ran(fn: Callable[[], object]) -> bool:
    """Whether torch's GEMM (aten::linear) ran inside fn; the kernel paths never call it."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return "aten::linear" in {e.key for e in prof.key_averages()}


def fake_timer(slow: str) -> autotune.Timer:
    """Runs the call for real and reports a fixed time per call, 10x more for the `slow` path."""
    def timer(path: str, fn: Callable[[], object], reps: int) -> float:
        fn()
        return 1e-3 * (10.0 if path == slow else 1.0)

    return timer


def test_bucket_edges() -> None:
    assert [bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 4096)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5, LARGE, LARGE]
    assert all(bucket(m) == i for i, m in enumerate(BUCKETS))


@needs_kernels
def test_table_covers_every_distinct_linear_shape_of_a_model(tiny_model: Callable[..., Path]) -> None:
    model, _ = load_model(tiny_model("llama", dtype="bfloat16"), "bfloat16")
    sites = [Site(name, w, torch.bfloat16) for name, w in model.linear_weights()]
    table = tune(sites, budget_s=120.0, max_rows=256)
    assert table.large_m == LARGE_M
    shapes = {(torch.bfloat16, tuple(w.shape)) for _, w in model.linear_weights()}
    assert set(table.plans) == shapes and len(shapes) < len(sites)  # deduplicated
    for key, plan in table.plans.items():
        assert len(plan) == LARGE + 1
        choices = table.choices[key]
        assert all(c.how in ("timed", "clear") and c.kernel_s and c.torch_s for c in choices)
        # c.plan, not c.kernel: on AMX CPUs a kernel choice from 4 rows is AMX on or off (KERNEL_NO_AMX).
        assert plan == tuple(c.plan for c in choices)
    assert sum(len(v) for v in table.names.values()) == len(sites)
    assert len(table.lines()) == len(shapes) and all("kernel" in line for line in table.lines())


@pytest.mark.parametrize("slow", ["kernel", "torch"])
def test_timing_picks_the_faster_path(slow: str) -> None:
    gen = torch.Generator().manual_seed(0)
    w32 = torch.randn(48, 64, generator=gen)
    weights = [Site("bf16", w32.bfloat16(), torch.bfloat16), Site("fp32", w32, torch.float32),
               Site("q8", QuantizedWeight.quantize(w32), torch.bfloat16)]
    table = tune(weights, timer=fake_timer(slow), budget_s=120.0)
    for key, choices in table.choices.items():
        timed = [c for c in choices if c.how != "fixed"]
        assert timed, key
        assert all(c.kernel == (slow == "torch") for c in timed), (key, choices)
        assert all(c.how in ("timed", "clear") for c in choices), (key, choices)  # every bucket timed


@needs_kernels
@pytest.mark.parametrize("default_ms,switches", [(1.25, True), (1.15, False)])
def test_a_kept_choice_is_never_over_tolerance_of_the_best(default_ms: float, switches: bool) -> None:
    """One stalled sample of the faster path (a loaded machine) cannot keep a fixed-rule path
    measured more than TOLERANCE (1.2x) slower than the other's best; within it, the fixed rule
    stays unless every sample of the other beats it."""
    torch_calls = [0]

    def timer(path: str, fn: Callable[[], object], reps: int) -> float:
        fn()
        if path == "kernel":  # bf16's fixed rule at one row on AVX2 / AVX-512 CPUs
            return default_ms * 1e-3
        torch_calls[0] += 1
        return 2e-3 if torch_calls[0] % 4 == 0 else 1e-3  # every fourth sample stalled

    w = torch.randn(16, 64).bfloat16()
    table = tune([Site("w", w, torch.bfloat16)], timer=timer, budget_s=120.0, max_rows=1)
    choice = table.choices[(torch.bfloat16, (16, 64))][0]
    assert choice.how == "timed" and choice.kernel == (not switches), choice
    assert autotune.TOLERANCE == 1.2


@needs_kernels
def test_one_row_keeps_the_kernel_unless_torch_is_beyond_tolerance() -> None:
    """At one row (decode; speculative verify rows take the kernel's batch-invariant path, so
    plain decode must too) a torch path 5 % faster in every sample does not replace the kernel;
    at two rows it does (the MARGIN rule); beyond TOLERANCE it does at one row as well."""
    def timer_for(torch_ms: float) -> Callable[[str, Callable[[], object], int], float]:
        def timer(path: str, fn: Callable[[], object], reps: int) -> float:
            fn()
            return (1.0 if path == "kernel" else torch_ms) * 1e-3
        return timer

    w = torch.randn(16, 64).bfloat16()
    key = (torch.bfloat16, (16, 64))
    close = tune([Site("w", w, torch.bfloat16)], timer=timer_for(0.95), budget_s=120.0, max_rows=2).choices[key]
    assert close[0].how == "timed" and close[0].kernel, close[0]
    assert close[1].how == "timed" and not close[1].kernel, close[1]
    far = tune([Site("w", w, torch.bfloat16)], timer=timer_for(0.75), budget_s=120.0, max_rows=1).choices[key]
    assert far[0].how == "timed" and not far[0].kernel, far[0]


@needs_kernels
def test_no_large_bucket_when_steps_cannot_reach_it() -> None:
    w = torch.randn(16, 32).bfloat16()
    table = tune([Site("w", w, torch.bfloat16)], timer=fake_timer("torch"), max_rows=16)
    assert [c.how for c in table.choices[(torch.bfloat16, (16, 32))][-2:]] == ["fixed", "fixed"]
    # 24 rows at most: the 17-32 bucket is timed (at 24 rows), the large one is not.

    def rows_timer(path: str, fn: Callable[[], object], reps: int) -> float:
        return 1e-3

    table = tune([Site("w", w, torch.bfloat16)], timer=rows_timer, max_rows=24)
    assert table.large_m == 24
    assert [c.how for c in table.choices[(torch.bfloat16, (16, 32))][-2:]] == ["timed", "fixed"]


def _mixed_table(key: autotune.Key) -> LinearTable:
    # kernel at 1, 4, 16, 17-32 rows; torch at 2, 8 and large: both paths inside and around the decode range.
    return LinearTable(plans={key: (True, False, True, False, True, True, False)})


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_follows_the_table(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(40, 96, generator=gen) / 96**0.5).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype)
    table = _mixed_table((dtype, (40, 96)))
    for m in ROWS:
        x = torch.randn(m, 96, generator=gen).to(dtype)
        with autotune.active(table):
            want_kernel = table.plans[(dtype, (40, 96))][bucket(m)]
            assert gemm_ran(lambda: ops.linear(x, w, b)) == (not want_kernel), m
            y = ops.linear(x, w, b)
        ref = x.double() @ w.double().T + b.double()
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() <= tol
    # Another shape is not in the table: the fixed rule (bf16: the kernel on this AVX2+ CPU, fp32: torch).
    other = torch.randn(8, 96, generator=gen).to(dtype)
    with autotune.active(table):
        assert gemm_ran(lambda: ops.linear(other[:1], other)) == (dtype == torch.float32)


def test_quantized_linear_follows_the_table() -> None:
    gen = torch.Generator().manual_seed(2)
    qw = QuantizedWeight.quantize(torch.randn(40, 64, generator=gen) / 8)
    key: autotune.Key = ("q8_0", torch.bfloat16, (40, 64))
    table = _mixed_table(key)
    ref_w = qw.dequantize(torch.float64)
    for m in ROWS:
        x = torch.randn(m, 64, generator=gen).bfloat16()
        with autotune.active(table):
            assert gemm_ran(lambda: ops.linear(x, qw)) == (not table.plans[key][bucket(m)]), m
            y = ops.linear(x, qw)
        ref = x.double() @ ref_w.T
        # x quantised to 8 bits on the kernel path (test_quant.py's bound), bf16 output rounding.
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() <= 1e-2 + 2.0**-8


@needs_kernels
def test_without_a_table_the_fixed_rules_hold() -> None:
    """No active table (autotune off): bf16 takes the kernel at every M on AVX2 (up to 16 rows on
    AVX512-BF16), fp32 takes torch, quantised weights their kernel up to 16 rows."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 64, generator=gen)
    qw = QuantizedWeight.quantize(w)
    assert autotune.active_table() is None
    for m in ROWS:
        x = torch.randn(m, 64, generator=gen)
        assert gemm_ran(lambda: ops.linear(x.bfloat16(), w.bfloat16())) == (
            not linear_route.BF16_KERNEL_EVERY_M and m > linear_route.LINEAR_KERNEL_MAX_M)
        assert gemm_ran(lambda: ops.linear(x, w))
        assert gemm_ran(lambda: ops.linear(x, qw)) == (m > linear_route.Q8_KERNEL_MAX_ROWS)


@needs_kernels
def test_deterministic_mode_path_does_not_depend_on_m() -> None:
    """Batch-invariant mode ignores the table: the kernel at every M, whatever the table says."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(24, 64, generator=gen).bfloat16()
    qw = QuantizedWeight.quantize(w.float())
    torch_only = (False,) * (LARGE + 1)
    table = LinearTable(plans={(torch.bfloat16, (24, 64)): torch_only, ("q8_0", torch.bfloat16, (24, 64)): torch_only})
    with autotune.active(table), batch_invariant.mode(True):
        assert {gemm_ran(lambda: ops.linear(torch.randn(m, 64).bfloat16(), w)) for m in ROWS} == {False}
        assert {gemm_ran(lambda: ops.linear(torch.randn(m, 64).bfloat16(), qw)) for m in ROWS} == {False}
        x = torch.randn(40, 64, generator=gen).bfloat16()
        full = ops.linear(x, w)
        assert all(torch.equal(ops.linear(x[:m], w), full[:m]) for m in ROWS)


def test_portable_cpu_tunes_nothing_and_gets_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without the float kernels (the portable family: ARM, pre-AVX2 x86) keeps torch's linear."""
    monkeypatch.setenv("PAGEWIRE_CPU_ISA", "portable")
    gen = torch.Generator().manual_seed(5)
    sites = [Site("bf16", torch.randn(32, 64, generator=gen).bfloat16(), torch.bfloat16),
             Site("fp32", torch.randn(32, 64, generator=gen), torch.float32)]
    table = tune(sites, timer=fake_timer("torch"))
    assert table.plans == {}
    with autotune.active(table):
        for site in sites:
            assert isinstance(site.weight, torch.Tensor)
            for m in ROWS:
                x = torch.randn(m, 64, generator=gen).to(site.x_dtype)
                assert torch.equal(ops.linear(x, site.weight), F.linear(x, site.weight))


def test_tuned_paths_match_a_float64_reference_on_a_model(tiny_model: Callable[..., Path]) -> None:
    """Every (shape, bucket) of the tiny model, on the path the tune chose and on the other one."""
    model, _ = load_model(tiny_model("llama", dtype="bfloat16"), "bfloat16")
    sites = [Site(name, w, torch.bfloat16) for name, w in model.linear_weights()]
    table = tune(sites, budget_s=120.0)
    flipped = LinearTable(plans={k: tuple(not c for c in p) for k, p in table.plans.items()})
    gen = torch.Generator().manual_seed(6)
    for _, w in model.linear_weights():
        assert isinstance(w, torch.Tensor)
        for m in (*BUCKETS, LARGE_M):
            x = torch.randn(m, w.shape[1], generator=gen).bfloat16()
            ref = x.double() @ w.double().T
            for t in (table, flipped):
                with autotune.active(t):
                    y = ops.linear(x, w)
                assert ((y.double() - ref).abs().max() / ref.abs().max()).item() <= 1e-2


def _vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


@needs_kernels
def test_engine_tunes_on_cpu_unless_off_or_deterministic(tiny_model: Callable[..., Path]) -> None:
    from server.engine.engine import LLMEngine
    from server.engine.sampling_params import SamplingParams

    model_dir = str(tiny_model("llama", dtype="bfloat16"))
    common = dict(model=model_dir, dtype="bfloat16", kv_cache_tokens=512, max_num_batched_tokens=64)
    on = LLMEngine(EngineConfig(**common, deterministic=False))  # type: ignore[arg-type]
    assert on.linear_table is not None
    # (keyed by each weight as the engine keeps it: on AVX2 and AVX512-BF16 CPUs the bf16 matrices
    # are in the x8 layout)
    assert set(on.linear_table.plans) == {linear_plan.table_key(w, torch.bfloat16) for _, w in on.model.linear_weights()}
    moved = ops.cpu_isa() in BF16_X8_MAX_K
    assert all(isinstance(w, QuantizedWeight) == moved for _, w in on.model.linear_weights())
    assert LLMEngine(EngineConfig(**common, deterministic=False, autotune=False)).linear_table is None  # type: ignore[arg-type]
    assert LLMEngine(EngineConfig(**common, deterministic=True, autotune=True)).linear_table is None  # type: ignore[arg-type]

    # The engine's steps follow its table: a greedy request's first token and logprobs agree with
    # the fixed rules' within bf16 tolerance (both paths compute the same linear).
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    prompt = list(range(3, 40))
    results = []
    for engine in (on, LLMEngine(EngineConfig(**common, deterministic=False, autotune=False))):  # type: ignore[arg-type]
        engine.add_request("r", prompt, params)
        deltas = []
        while engine.has_unfinished_requests():
            deltas += engine.step()
        lp = [s.logprobs for d in deltas for s in d.samples if s.logprobs][0][0]
        results.append(dict(lp.top))
    shared = set(results[0]) & set(results[1])  # (a near tie may swap the third token)
    assert len(shared) >= 2
    assert all(abs(results[0][t] - results[1][t]) <= 0.05 for t in shared)


def test_bad_autotune_values_name_the_field() -> None:
    from server.serving.settings import add_serve_arguments, settings_from_args

    with pytest.raises(ConfigError, match="autotune") as e:
        EngineConfig(model="m", autotune="yes")  # type: ignore[arg-type]
    assert e.value.field == "autotune"
    import argparse

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    with pytest.raises(ValueError, match="PAGEWIRE_AUTOTUNE"):
        settings_from_args(p.parse_args([]), {"PAGEWIRE_AUTOTUNE": "sometimes"})
    assert settings_from_args(p.parse_args(["--autotune", "off"]), {}).autotune is False
    assert settings_from_args(p.parse_args([]), {}).engine_config("m").autotune is None


def amx_timer(slow: str) -> autotune.Timer:
    """Torch always slow (so the kernel path is chosen); of the kernel with and without AMX, `slow` is."""
    times = {"torch": 10.0, "kernel": 1.0, "kernel-noamx": 1.0}
    times[slow] = 2.0

    def timer(path: str, fn: Callable[[], object], reps: int) -> float:
        fn()
        return 1e-3 * times[path]

    return timer


@pytest.mark.parametrize("slow", ["kernel", "kernel-noamx"])
def test_amx_cpu_also_times_the_kernel_without_amx(monkeypatch: pytest.MonkeyPatch, slow: str) -> None:
    """On an AMX CPU, from 4 rows the kernel path is timed with AMX allowed and off; the plan holds
    KERNEL_NO_AMX only where AMX was slower, and the timing really ran with the switch off."""
    import server._C

    monkeypatch.setattr(ops, "cpu_isa", lambda: "amx")
    flags: list[tuple[str, bool]] = []
    float_path, quant_path = linear_route._float_kernel_path, linear_route._quant_kernel_path

    def spy(real: Callable[..., torch.Tensor], kind: str) -> Callable[..., torch.Tensor]:
        def run(x: torch.Tensor, w: object, b: torch.Tensor | None) -> torch.Tensor:
            flags.append((kind, server._C.amx_allowed()))
            return real(x, w, b)
        return run

    monkeypatch.setattr(linear_route, "_float_kernel_path", spy(float_path, "float"))
    monkeypatch.setattr(linear_route, "_quant_kernel_path", spy(quant_path, "quant"))
    gen = torch.Generator().manual_seed(5)
    w32 = torch.randn(48, 64, generator=gen)
    sites = [Site("bf16", w32.bfloat16(), torch.bfloat16), Site("q8", QuantizedWeight.quantize(w32), torch.bfloat16),
             Site("q4", QuantizedWeight.quantize(w32, "q4_0"), torch.bfloat16),
             Site("q4k", random_q4("q4_k", 48, 256, seed=5), torch.bfloat16)]
    table = tune(sites, timer=amx_timer(slow), budget_s=120.0, log=False)
    assert server._C.amx_allowed()  # restored after every timed call
    assert (False in {on for _, on in flags}) and (True in {on for _, on in flags})
    for key, plan in table.plans.items():
        amx_body = key[0] != "q4_k"  # the K-quants have no AMX kernel: nothing to compare
        for b, choice in enumerate(plan):
            # Q8_0 at 4 and 8 rows keeps the kernel by rule (dequantise + GEMM is not plausible
            # there), but AMX against AVX-512 is still timed.
            if b >= autotune.AMX_FIRST_BUCKET and amx_body and slow == "kernel":
                assert choice == autotune.KERNEL_NO_AMX, (key, b)
            else:
                assert choice == autotune.KERNEL, (key, b)
    if slow == "kernel":
        assert any("kernel(no AMX)" in line for line in table.lines())


@needs_kernels
def test_linear_turns_amx_off_where_the_table_says(monkeypatch: pytest.MonkeyPatch) -> None:
    import server._C

    seen: list[tuple[int, bool]] = []
    real = linear_route._float_kernel_path

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        seen.append((x.shape[0], server._C.amx_allowed()))
        return real(x, w, b)

    monkeypatch.setattr(linear_route, "_float_kernel_path", spy)
    gen = torch.Generator().manual_seed(6)
    w = (torch.randn(40, 96, generator=gen) / 96**0.5).bfloat16()
    K, NO = autotune.KERNEL, autotune.KERNEL_NO_AMX
    table = LinearTable(plans={(torch.bfloat16, (40, 96)): (K, K, NO, NO, K, NO, NO)})
    for m in ROWS:
        x = torch.randn(m, 96, generator=gen).bfloat16()
        with autotune.active(table):
            y = ops.linear(x, w)
        assert server._C.amx_allowed()
        ref = x.double() @ w.double().T
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() <= 1e-2
    assert seen == [(m, table.plans[(torch.bfloat16, (40, 96))][bucket(m)] != NO) for m in ROWS]
