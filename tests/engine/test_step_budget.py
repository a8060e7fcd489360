"""The ITL target's chunk-size policy (server.engine.step_budget): fed step costs, no timing.

The cost function used here has the shape measured on the default Q4_1 model on a 2-core Zen 3:
steps of at most 16 rows (the fused small-batch kernels) cost a fixed part plus a little per row,
and larger steps jump to a much larger fixed part plus a steeper per-token cost."""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from server.engine.step_budget import DECAY, MAX_STRETCH, OUTLIER_FACTOR, OWN_REFRESH_STEPS, StepBudget, _lift_rounding


def cliff_cost(decode_rows: int, prefill_tokens: int) -> float:
    rows = decode_rows + prefill_tokens
    if rows <= 16:
        return 0.010 + 0.0004 * rows
    return 0.030 + 0.0006 * prefill_tokens + 0.0008 * decode_rows


def best_chunk(decode_rows: int, target: float, max_tokens: int, min_chunk: int = 8) -> int:
    """The analytic answer: the largest P with cliff_cost(D, P) <= target in each regime (P up to
    16 - D, and beyond), the one of the two that prefills more tokens per second."""
    room = max_tokens - decode_rows
    small = max((p for p in range(1, min(room, 16 - decode_rows) + 1) if cliff_cost(decode_rows, p) <= target),
                default=0)
    large = max((p for p in range(max(1, 17 - decode_rows), room + 1) if cliff_cost(decode_rows, p) <= target),
                default=0)
    if small and large and small / cliff_cost(decode_rows, small) >= large / cliff_cost(decode_rows, large):
        large = 0
    return max(large or small, min(min_chunk, room))


def trained(target: float, max_tokens: int = 256) -> StepBudget:
    """A StepBudget that has seen a serving-like mix: decode-only steps of 1..12 rows, prefill
    steps alone, and mixed steps in both regimes."""
    b = StepBudget(target, max_tokens)
    for rnd in range(6):
        for d in (1, 4, 8, 12):
            b.observe(d, 0, cliff_cost(d, 0))
        for d, p in ((0, 64), (0, 200), (2, 6), (8, 8), (3, 120), (6, 40), (1, 250), (12, 3)):
            b.observe(d, p + rnd, cliff_cost(d, p + rnd))
    return b


def test_no_limit_without_decodes_or_before_the_batched_regime_is_measured() -> None:
    b = StepBudget(0.05, 256)
    assert b.prefill_tokens(4) is None  # nothing measured yet: the old behaviour (whole budget)
    b.observe(0, 100, cliff_cost(0, 100))
    assert b.prefill_tokens(0) is None  # nothing decodes: no cadence to keep, fastest TTFT
    assert b.prefill_tokens(4) is not None


@pytest.mark.parametrize("target_ms", [12, 14, 20, 45, 60, 100, 200])
@pytest.mark.parametrize("decode_rows", [1, 4, 8, 12])
def test_chunk_is_the_fastest_of_the_largest_that_fit_the_target(decode_rows: int, target_ms: float) -> None:
    target = target_ms / 1e3
    b = trained(target)
    got = b.prefill_tokens(decode_rows)
    want = best_chunk(decode_rows, target, 256)
    assert got is not None
    assert abs(got - want) <= 1, (got, want)
    # The step it allows is predicted within the target, unless the floor forced it.
    if got > b.min_chunk:
        assert cliff_cost(decode_rows, got) <= target * 1.01


def test_floor_keeps_prefill_moving_when_decodes_alone_exceed_the_target() -> None:
    b = trained(0.005)  # below even a one-row decode step
    for d in (1, 4, 8):
        assert b.prefill_tokens(d) == 8
    assert b.prefill_tokens(250) == 6  # never past the step's token budget
    assert b.prefill_tokens(256) == 0


def test_prefers_the_small_batch_regime_when_the_jump_does_not_fit() -> None:
    # 8 decode rows: up to 8 more tokens stay in the fused regime (13.2 ms); the 17th row costs the
    # jump (36.4 ms + 0.6 ms per token), so a 30 ms target gets exactly the 8 fused-regime tokens.
    b = trained(0.030)
    assert b.prefill_tokens(8) == 8
    b.target_s = 0.060  # now the batched regime fits: (60 - 30 - 6.4) / 0.6 = 39 tokens
    assert b.prefill_tokens(8) in (38, 39)


def test_one_stall_does_not_collapse_the_chunk() -> None:
    b = trained(0.060)
    before = b.prefill_tokens(8)
    assert before == best_chunk(8, 0.060, 256) > 16  # the batched regime's chunk
    b.observe(8, before or 0, 10.0)  # another process took the core for 10 s
    # The stall counts as OUTLIER_FACTOR times the prediction, not 10 s: the chunks after it may
    # fall back to the fused regime's, never below it, and once the stall's weight has decayed
    # (a few times 1 / (1 - DECAY) steps) the batched chunk is tried again and kept.
    assert OUTLIER_FACTOR < 10.0 / cliff_cost(8, before or 0)
    for _ in range(4 * round(1 / (1 - DECAY))):
        p = b.prefill_tokens(8) or 0
        assert p >= 16 - 8
        b.observe(8, p, cliff_cost(8, p))
    assert abs((b.prefill_tokens(8) or 0) - (before or 0)) <= 2


def test_follows_a_slower_machine() -> None:
    b = trained(0.060)
    before = b.prefill_tokens(8)
    for _ in range(40):  # the host got twice as slow (say, another tenant)
        for d, p in ((8, 0), (8, 30), (4, 60), (8, 4)):
            b.observe(d, p, 2 * cliff_cost(d, p))
    after = b.prefill_tokens(8)
    assert before is not None and after is not None
    # Twice the cost: the fused regime's 8 tokens (26.4 ms) fit, the batched regime does not.
    assert after == 8 < before


def test_records_the_last_step_with_its_limit() -> None:
    b = trained(0.060)
    limit = b.prefill_tokens(8)
    b.observe(8, 20, 0.04)
    assert (b.last.decode_rows, b.last.prefill_tokens, b.last.limit, b.last.seconds) == (8, 20, limit, 0.04)
    b.observe(0, 50, 0.05)
    assert b.last.limit is None  # no limit was asked for that step


def test_target_must_be_positive() -> None:
    with pytest.raises(ValueError, match="itl_target_ms"):
        StepBudget(0.0, 256)


def serving_like(cost: Callable[[int, int], float], target: float) -> StepBudget:
    """What a serving run shows the policy before its first mixed step: decode-only steps of 1..8
    rows, small mixed steps, and the batched regime at ONE row count only (same-length prompts
    prefilled while nothing decodes take the whole 256-token budget every time)."""
    b = StepBudget(target, 256)
    for _ in range(5):
        b.observe(0, 256, cost(0, 256))
        for d in range(1, 9):
            b.observe(d, 0, cost(d, 0))
        for d, p in ((1, 8), (4, 8), (7, 9), (2, 14)):
            b.observe(d, p, cost(d, p))
    return b


def linear_cost(decode_rows: int, prefill_tokens: int) -> float:
    """No jump between the regimes: a step costs its rows (the kernels at any M cost the same per row)."""
    return 0.005 + 0.0011 * (decode_rows + prefill_tokens) + 0.0002 * decode_rows


def test_the_batched_regime_seen_at_one_row_count_still_gets_mid_sized_chunks() -> None:
    # With a separate fit per regime, the ridge read the one 256-row step (287 ms) as ~280 ms of
    # fixed cost: no chunk past 16 rows ever seemed to fit beside decodes, and waiting prompts
    # crawled at the floor of 8-9 tokens a step.
    b = serving_like(linear_cost, 0.050)
    got = b.prefill_tokens(7)
    fits = max(p for p in range(1, 250) if linear_cost(7, p) <= 0.050)  # 31
    assert got is not None and abs(got - fits) <= 2, (got, fits)


def test_a_jump_is_learnt_from_the_first_mid_sized_chunk() -> None:
    # With a real jump (cliff_cost), the ridge predicts the first batched chunk optimistically;
    # once that step is measured the fit sees two row counts and gives the analytic chunk.
    b = serving_like(cliff_cost, 0.060)
    first = b.prefill_tokens(8)
    assert first is not None and first > best_chunk(8, 0.060, 256)  # optimistic, then measured
    b.observe(8, first, cliff_cost(8, first))
    for _ in range(3):  # the next steps run what it now allows, and are measured too
        p = b.prefill_tokens(8) or 0
        b.observe(8, p, cliff_cost(8, p))
    assert abs((b.prefill_tokens(8) or 0) - best_chunk(8, 0.060, 256)) <= 2


def test_a_chunk_stays_within_twice_the_largest_batched_step_measured() -> None:
    # A loaded host: the decode-only steps were slowed (a tiny model's step is mostly fixed cost)
    # and three batched steps at nearby row counts cost about the same. The fit's batched line is
    # then almost flat -- "a prefill token is all but free" -- and read literally it put a whole
    # 240-token prompt into one step beside three streams (tests/engine/test_itl_budget.py under
    # the suite's load). Its data reach 62 rows: the chunk stays within twice that.
    b = StepBudget(1.0, 512)
    for d, p, t in ((0, 40, 0.00400), (1, 50, 0.00401), (2, 60, 0.00402)):
        b.observe(d, p, t)
    for _ in range(10):
        b.observe(3, 0, 0.0045)
    b.target_s = b.predict(3, 0) or 0.0
    base, per_token = b.fit.line(3, True)
    assert base < b.target_s and (b.target_s - base) / per_token > 500  # the line: everything fits
    first = b.prefill_tokens(3)
    assert first is not None and 62 < first + 3 <= 2 * 62
    # Each measured chunk widens the region, and once the real per-token cost shows, it decides.
    cost = lambda p: 0.0038 + 0.00002 * (3 + p)  # noqa: E731 -- fits the target up to ~32 tokens
    for _ in range(6):
        p = b.prefill_tokens(3) or 0
        b.observe(3, p, cost(p))
    got = b.prefill_tokens(3) or 0
    assert abs(got - 32) <= 3, got


def test_noise_between_two_decode_row_counts_never_makes_a_row_cost_negative() -> None:
    # Serving, issue 31's workload at a 100 ms target: the first wave's mixed steps (64-76 prefill
    # tokens beside 1-7 decodes) measured the batched regime; then ~40 decode-only steps at 8 rows
    # (35 ms) and a few at 7 (42 ms, a noisy moment). The small-batch regime's data then sat at two
    # row counts with the larger one cheaper: the unconstrained fit read -11.7 ms per row and a
    # 123 ms fixed part, predicted a 16-row step at less than nothing, and took that regime's 9
    # tokens a step (~200 tok/s of prefill) over the 60-odd (~600 tok/s) the target allowed, for
    # the whole second wave.
    b = StepBudget(0.100, 128)
    for d in range(1, 8):
        for p in (66, 70, 72, 74):
            b.observe(d, p, 0.0145 + 0.00125 * (d + p))
    for _ in range(40):
        b.observe(8, 0, 0.035)
    for _ in range(3):
        b.observe(7, 0, 0.042)
    a, j, s_b, s_s, e, f = b.fit.theta
    assert min(s_b, s_b + s_s, s_b + e, s_b + s_s + e + f) >= 0, b.fit.theta
    got = b.prefill_tokens(7) or 0
    fits = max(p for p in range(10, 121) if 0.0145 + 0.00125 * (7 + p) <= 0.100)  # 61
    assert abs(got - fits) <= 6, (got, fits)


def test_factor_lets_a_step_take_a_multiple_of_the_decodes_own_step() -> None:
    # A slow CPU: eight streams' decode-only step takes 34 ms, so a 50 ms target leaves ~12 tokens
    # of prefill a step. With factor 2, the step may take 68 ms (twice the streams' own cadence);
    # with one stream (a 7 ms step) the fixed 50 ms still governs.
    def cost(d: int, p: int) -> float:
        return 0.004 + 0.0014 * p + 0.0039 * d if d + p > 16 else 0.0031 + 0.0039 * d + 0.0014 * p

    def budget(factor: float) -> StepBudget:
        b = StepBudget(0.050, 256, factor=factor)
        for rnd in range(4):
            for d in (1, 2, 4, 8):
                b.observe(d, 0, cost(d, 0))
            for d, p in ((0, 128), (1, 60), (4, 30), (8, 12), (8, 30), (2, 5)):
                b.observe(d, p + rnd, cost(d, p + rnd))
        return b

    plain, scaled = budget(0.0), budget(2.0)
    own8 = cost(8, 0)
    assert plain.target(8) == 0.050 and abs(scaled.target(8) - 2 * own8) < 1e-9
    assert abs(scaled.target(10) - 2 * own8) < 1e-9  # 10 rows never ran alone: 8 rows' step, a lower bound
    own6 = (cost(4, 0) + cost(8, 0)) / 2  # between 4 and 8 rows measured: the line between them
    assert abs((scaled.own_step(6) or 0) - own6) < 1e-9 and abs(scaled.target(6) - max(0.050, 2 * own6)) < 1e-9
    assert scaled.own_step(0) is None and plain.own_step(8) is None  # nothing below 1 row; no factor, no record
    assert scaled.target(1) == 0.050  # 2 x 7.0 ms is below the fixed target
    fits = lambda target: max(p for p in range(9, 249) if cost(8, p) <= target)  # noqa: E731
    assert abs((plain.prefill_tokens(8) or 0) - fits(0.050)) <= 2
    assert abs((scaled.prefill_tokens(8) or 0) - fits(2 * own8)) <= 2
    assert scaled.prefill_tokens(1) == plain.prefill_tokens(1)
    with pytest.raises(ValueError, match="itl_target_factor"):
        StepBudget(0.050, 256, factor=-1.0)


def test_factor_counts_only_measured_decode_only_steps() -> None:
    # A first wave: one stream decodes alone (7 ms), then every step mixes prefill with 1..6 decode
    # rows, so no decode-only step of more than one row has run. The fit's decode-only line there
    # is an extrapolation (in serving it read 95-137 ms for a 26 ms step and let 250 ms steps
    # through); the factor's base is the one-row step measured, so the fixed target governs.
    b = StepBudget(0.050, 128, factor=3.0)
    for _ in range(20):
        b.observe(1, 0, 0.007)
    for d in range(1, 7):
        for p in (57, 66, 80):
            b.observe(d, p, 0.030 + 0.0011 * p + 0.012 * d)  # decode rows steep: a poor extrapolation
    assert (b.predict(6, 0) or 0) * 3 > 0.050  # what the fit alone would have allowed
    assert b.target(6) == 0.050
    for _ in range(5):
        b.observe(6, 0, 0.024)
    assert abs(b.target(6) - 0.072) < 1e-9
    b.observe(6, 0, 0.500)  # a stall: counted as OUTLIER_FACTOR times the estimate
    assert b.target(6) <= 3 * (DECAY * 0.024 + (1 - DECAY) * OUTLIER_FACTOR * 0.024) + 1e-12


def test_factor_measures_a_decode_row_count_alone_once_and_again_when_stale() -> None:
    # Sustained load: every step mixes prefill with 5 decode rows, so 5 rows never run alone. The
    # first such step runs without prefill (limit 0) to measure them; then chunks follow 3x that
    # step; OWN_REFRESH_STEPS steps later they are measured again. Without a factor, never.
    cost = lambda d, p: 0.010 + 0.002 * d + 0.0011 * p  # noqa: E731
    for factor in (0.0, 3.0):
        b = StepBudget(0.050, 256, factor=factor)
        for p in (64, 128, 100):
            b.observe(0, p, cost(0, p))
        b.observe(1, 0, cost(1, 0))
        first = b.prefill_tokens(5)
        if not factor:
            assert first and first > 0
            continue
        assert first == 0 and b.prefill_tokens(1) != 0  # 1 row was measured alone
        b.observe(5, 0, cost(5, 0))  # the probe: 20 ms
        assert abs(b.target(5) - 0.060) < 1e-9
        for _ in range(OWN_REFRESH_STEPS):
            p = b.prefill_tokens(5)
            assert p and abs(cost(5, p) - 0.060) < 0.006, p
            b.observe(5, p, cost(5, p))
        assert b.prefill_tokens(5) == 0
        for _ in range(40):  # a slow phase: 3 x 48 ms would be 144 ms; the stretch stops at 2 x 50
            b.observe(5, 0, 0.048)
        assert abs(b.target(5) - MAX_STRETCH * 0.050) < 1e-12


def test_serve_passes_the_factor_and_bad_values_name_the_option() -> None:
    import argparse

    from server.engine.config import ConfigError, EngineConfig
    from server.serving.settings import add_serve_arguments, settings_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    default = settings_from_args(p.parse_args([]), {}).engine_config("/m")
    assert (default.itl_target_ms, default.itl_target_factor) == (50.0, 3.0)
    s = settings_from_args(p.parse_args(["--itl-target-factor", "0"]), {"PAGEWIRE_ITL_TARGET_FACTOR": "5"})
    assert s.engine_config("/m").itl_target_factor == 0.0  # the flag wins over the environment
    assert settings_from_args(p.parse_args([]), {"PAGEWIRE_ITL_TARGET_FACTOR": "2.5"}).itl_target_factor == 2.5
    with pytest.raises(ValueError, match="PAGEWIRE_ITL_TARGET_FACTOR"):
        settings_from_args(p.parse_args([]), {"PAGEWIRE_ITL_TARGET_FACTOR": "-1"})
    with pytest.raises(ConfigError, match="^itl_target_factor:"):
        EngineConfig(model="/m", itl_target_factor=-0.5)


def test_a_probe_is_made_once_even_when_its_step_holds_other_rows() -> None:
    # The scheduler asks for D decode rows; should the step the engine runs count its decode rows
    # differently, the probe must still count as made: prefill is withheld for one step, not for
    # every step while D is never measured alone.
    b = StepBudget(0.050, 256, factor=3.0)
    for p in (64, 128, 100):
        b.observe(0, p, 0.010 + 0.0011 * p)
    assert b.prefill_tokens(5) == 0
    b.observe(6, 0, 0.022)  # the step ran 6 decode rows, not 5
    for _ in range(OWN_REFRESH_STEPS - 1):
        p = b.prefill_tokens(5)
        assert p is not None and p > 0
        b.observe(5, p, 0.010 + 0.002 * 5 + 0.0011 * p)


def test_a_cost_pinned_to_zero_is_never_left_negative_by_rounding() -> None:
    # The KKT solve pins an active cost to 0 only up to rounding: on a Zen 4 the serving test above
    # came back with b = 0.0 and e = -1.7e-21, a decode row's cost b + e just below 0. The lift
    # raises b by that deficit and nothing more.
    theta = np.array([0.0369, -0.0036, 0.0, 0.0010, -1.7004003054116512e-21, 1.1252e-05])
    a, j, b, s, e, f = _lift_rounding(theta)
    assert min(b, b + s, b + e, b + s + e + f, (b + s) + (e + f)) >= 0
    assert (a, j, s, e, f) == tuple(theta[[0, 1, 3, 4, 5]])
    assert 0 <= b <= 2e-21
    # A theta already within the bounds comes back unchanged.
    ok = np.array([0.01, 0.0, 0.002, 0.001, 0.0005, 0.0])
    assert tuple(_lift_rounding(ok)) == tuple(ok)
