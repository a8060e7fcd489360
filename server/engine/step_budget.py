"""StepBudget: sizes each step's prefill chunk from a measured step-time budget (ITL under load).

While sequences decode, every engine step is one inter-token gap for each of them, and a prefill
chunk that joins the step stretches that gap. This module owns the trade-off between the running
streams' cadence and the new requests' time to first token:

- It keeps an online estimate of what a step costs, from the wall time of every step the engine
  runs (`observe`):

      t(step) ~ fixed + per_row * M + per_decode_row * D        (M = D + P <= fused_rows)
      t(step) ~ fixed + jump + (per_row + slope_change) * M + (per_decode_row + its_change) * D
                                                                               (M > fused_rows)

  (D: decode rows, a decode's speculative lookahead included; P: prefill tokens). On a CPU, steps
  of at most `fused_rows` (16) rows run pagewire's fused decode layer and integer kernels, and
  larger ones the batched paths (GEMM, chunked dequantise, the Python layers), whose cost may jump;
  `jump` and the two changes say by how much.
- It is one exponentially weighted least-squares fit over every step (the last ~`1 / (1 - DECAY)`
  steps count most, so it follows load changes on a shared host), with a ridge that decides what
  the data leaves open. Serving shows few row counts: steps with nothing decoding take the whole
  token budget (same-length prompts make each of them the same size), and steps beside decodes
  are filled to the same total. Two separate fits per regime, each seeing one row count, read
  every step as fixed cost ("300 ms fixed" for a 256-row step, "23 ms fixed, rows free" for a
  16-row one): no chunk past 16 rows ever seemed to fit beside decodes, none was tried, and new
  prompts prefilled at 8-9 tokens a step for good. One fit sees both row counts, and the ridge
  leans the jump and the slope change towards 0 (the batched regime costs what the small one
  does per row): that predicts a mid-sized chunk optimistically when the batched regime really
  has a jump, and the first such chunk is measured, after which the data outweighs the lean (by
  orders of magnitude). A decode row's extra cost leans towards 0 too (decode rows are rows of the
  same GEMMs; they differ by their attention over the whole context). One step measured more than
  OUTLIER_FACTOR times its prediction (another process took the core) counts as OUTLIER_FACTOR
  times the prediction, so a single stall does not halve the chunks that follow.
- No row may cost less than nothing: the fit is constrained so that a prefill token and a decode
  row each cost >= 0 in both regimes (an active-set solve). Between waves a regime's data can sit
  at two neighbouring row counts (decode-only steps of 7 and 8 rows), where a host's noise reads
  as a steep negative slope; read literally, a 16-row step was predicted to cost less than nothing
  and beat the batched chunks the target allowed, at a third of their prefill rate.
- `prefill_tokens(D)`: with D > 0 decode rows this step, the most prefill tokens whose predicted
  step time stays within the ITL target, trying both regimes: the largest chunk that keeps the step
  within `fused_rows` rows, and the largest beyond it, of which it takes the one predicted to
  prefill more tokens per second (past a jump, a chunk a few tokens larger can take twice the
  step: it would slow the prompts it was meant to speed up, and every stream's cadence). It is at least `min_chunk` (8: a new
  request always progresses, so the TTFT lead stays, and beside up to 8 decode rows that floor
  still fits the small-batch regime) and None (no limit: the step's whole token budget,
  the fastest TTFT) when nothing decodes, since then there is no cadence to keep, or before the
  batched regime has been measured at all.
- A chunk beside decodes is never more than TRUST_FACTOR times the largest step measured in the
  batched regime. The fit's line is extrapolated past its data otherwise, and a few steps measured
  at nearby row counts on a loaded host (the first batched step has no prediction to clamp its
  stall against) can fit a per-token cost of zero or below: read literally, "a prefill token is
  free", and the whole prompt joined one step beside the streams (seen under the test suite's
  load). Doubling per step still reaches any chunk the target allows within a few steps.

Pure Python and deterministic: the policy is a function of the observations fed to it, so
tests drive it with step costs of their choosing (tests/engine/test_step_budget.py).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

import numpy as np

# Weight of the previous estimate per new observation (about the last 10 steps count most).
DECAY = 0.9
# An observed step longer than this times its prediction is counted as this times the prediction:
# a lasting slowdown is still followed (the prediction grows by up to this factor per step).
OUTLIER_FACTOR = 1.5
# A chunk beside decodes is at most this times the largest batched step measured (module docstring).
# With a factor, a decode-row count whose decode-only step was last measured this many steps ago
# (or never) is measured again: one step without prefill (`StepBudget.target`).
OWN_REFRESH_STEPS = 256
# ... and it never stretches the fixed target past this many times it: in a slow phase of a shared
# host, 3x a 48 ms decode-only step let 145 ms steps through (ITL p99 183 ms against llama-server's
# ~100, session 39).
MAX_STRETCH = 2.0
TRUST_FACTOR = 2
# Ridge weights, towards 0, of the parameters (fixed, jump, per row, slope change, a decode row's
# extra, its change past the split): the fixed cost and the per-row slope are all but free; the
# batched regime's jump and slope change lean towards 0 with a weight that only decides what the
# data leaves open (the batched regime seen at one row count: then the slope change takes up the
# difference, see above); a decode row's extra cost, in either regime, leans towards 0 firmly.
_RIDGE = (1e-9, 1e-3, 1e-6, 1e-3, 4.0, 4.0)
_RIDGE_DIAG = np.diag(_RIDGE)


class _StepFit:
    """t ~ a + j * L + (b + s * L) * M + (e + f * L) * D over every step, exponentially weighted,
    with a ridge (L: the step is past `split` rows).

    b is the cost of one prefill token in the small-batch regime and b + e that of one decode row."""

    def __init__(self, split: int) -> None:
        self.split = split
        n = len(_RIDGE)
        # Weighted normal equations: XtX (n x n, symmetric) and Xt t over the features. numpy: the
        # engine feeds every step, and the 6 x 6 update and solve in Python lists cost ~50 us a step.
        self._xtx = np.zeros((n, n))
        self._xtt = np.zeros(n)
        self.count = 0
        self.large_count = 0  # steps seen past the split
        self.theta = (0.0,) * n

    def _features(self, decode_rows: int, prefill_tokens: int) -> tuple[float, ...]:
        m = float(decode_rows + prefill_tokens)
        large = 1.0 if m > self.split else 0.0
        return (1.0, large, m, large * m, float(decode_rows), large * decode_rows)

    def predict(self, decode_rows: int, prefill_tokens: int) -> float:
        return sum(t * x for t, x in zip(self.theta, self._features(decode_rows, prefill_tokens)))

    def line(self, decode_rows: int, large: bool) -> tuple[float, float]:
        """(cost of the step's decode rows and fixed parts, cost per prefill token) in one regime."""
        a, j, b, s, e, f = self.theta
        if large:
            a, b, e = a + j, b + s, e + f
        return a + (b + e) * decode_rows, b

    def add(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        x = np.array(self._features(decode_rows, prefill_tokens))
        self._xtt = DECAY * self._xtt + x * seconds
        self._xtx = DECAY * self._xtx + np.outer(x, x)
        self.count += 1
        self.large_count += int(x[1])
        self.theta = _solve_nonnegative_rows(self._xtx + _RIDGE_DIAG, self._xtt)


# A row's cost in each regime, as combinations of theta (a, j, b, s, e, f): a prefill token's
# (b, b + s) and a decode row's (b + e, b + s + e + f). None may be negative (module docstring).
_ROW_COSTS = np.array([
    (0.0, 0.0, 1.0, 0.0, 0.0, 0.0),
    (0.0, 0.0, 1.0, 1.0, 0.0, 0.0),
    (0.0, 0.0, 1.0, 0.0, 1.0, 0.0),
    (0.0, 0.0, 1.0, 1.0, 1.0, 1.0),
])


def _solve_nonnegative_rows(a: np.ndarray, g: np.ndarray) -> tuple[float, ...]:
    """argmin of the ridge-regularised least squares (normal equations a theta = g) subject to
    every per-row cost in _ROW_COSTS being >= 0: an active set, each violated cost pinned to 0 (an
    equality constraint, solved with its Lagrange multiplier) until none is violated (at most four
    rounds: one per cost)."""
    theta = np.linalg.solve(a, g)
    active: list[int] = []
    while True:
        costs = _ROW_COSTS @ theta
        violated = [i for i in range(len(costs)) if costs[i] < 0 and i not in active]
        if not violated:
            return tuple(float(v) for v in _lift_rounding(theta))
        active.append(min(violated, key=lambda i: costs[i]))
        c = _ROW_COSTS[active]
        n, k = a.shape[0], len(active)
        kkt = np.zeros((n + k, n + k))
        kkt[:n, :n], kkt[:n, n:], kkt[n:, :n] = a, c.T, c
        theta = np.linalg.solve(kkt, np.concatenate([g, np.zeros(k)]))[:n]


def _lift_rounding(theta: np.ndarray) -> np.ndarray:
    """theta with its per-row costs made >= 0 exactly. A cost the active set pinned to 0 comes back
    from the KKT solve as 0 only up to rounding (b + e = -1.7e-21 on a Zen 4, where a Zen 3 had
    passed the same test). Every cost has b (theta[2]) with coefficient 1, so raising b by the
    deficit lifts them all: the fit moves by a rounding error. The costs are summed here as Python
    floats in both orders a reader of theta adds them (_StepFit.line's and left to right)."""
    theta = theta.copy()
    for _ in range(4):
        _, _, b, s, e, f = (float(v) for v in theta)
        low = min(b, b + s, b + e, b + s + e + f, (b + s) + (e + f))
        if low >= 0:
            break
        theta[2] -= low
    return theta


@dataclass
class StepRecord:
    """The latest step StepBudget saw: its rows, the prefill limit it was given (None: no limit)
    and its measured wall time."""

    decode_rows: int = 0
    prefill_tokens: int = 0
    limit: Optional[int] = None
    seconds: float = 0.0


class StepBudget:
    """The chunk-size policy (see the module docstring).

    Args:
        target_s: the ITL target, seconds: the most a step with decodes in it should take.
        factor: a step with decodes may also take up to this many times the decodes' own step (the
            decode-only step of as many rows as measured, interpolated between the row counts
            measured around it, or the most rows below it that were): the larger of the two bounds
            applies. 0: the fixed target alone.
        max_tokens: the step's token budget (max_num_batched_tokens); no limit exceeds it.
        fused_rows: the row count up to which steps take the small-batch kernels (the regimes' split).
        min_chunk: the fewest prefill tokens a step with decodes is allowed.
    """

    def __init__(self, target_s: float, max_tokens: int, fused_rows: int = 16, min_chunk: int = 8,
                 factor: float = 0.0) -> None:
        if not target_s > 0:
            raise ValueError(f"itl_target_ms: must be positive, got {target_s * 1e3}")
        if not factor >= 0:
            raise ValueError(f"itl_target_factor: must be >= 0, got {factor}")
        self.target_s = target_s
        self.factor = factor
        # Decode-only steps' seconds by decode rows (an exponentially weighted mean each), and
        # their row counts sorted: the factor's base. Measured, not the fit's prediction: a row
        # count no decode-only step has had is extrapolated by the fit from whatever the regime saw
        # (a first wave's mixed steps), which read 95-137 ms for a 26 ms step and let 250 ms
        # steps through (session 39).
        self._own: dict[int, float] = {}
        self._own_rows: list[int] = []
        self._own_at: dict[int, int] = {}  # the step count at each one's latest measurement
        self._steps = 0  # steps observed
        self._probe: Optional[int] = None  # the decode rows prefill_tokens last answered a probe for
        self.max_tokens = max_tokens
        self.fused_rows = fused_rows
        self.min_chunk = max(1, min(min_chunk, max_tokens))
        self.fit = _StepFit(fused_rows)
        self.last = StepRecord()
        self._limit: Optional[int] = None  # what prefill_tokens last returned (for `last`)
        self._largest_batched = 0  # the most rows of any step measured past fused_rows

    def _measured(self, large: bool) -> bool:
        return (self.fit.large_count if large else self.fit.count - self.fit.large_count) > 0

    def predict(self, decode_rows: int, prefill_tokens: int) -> Optional[float]:
        """Predicted seconds of a step with these rows; None while its regime is unmeasured."""
        if not self._measured(decode_rows + prefill_tokens > self.fused_rows):
            return None
        return self.fit.predict(decode_rows, prefill_tokens)

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """Feed one step's measured wall time (the engine calls this after every step that ran)."""
        self.last = StepRecord(decode_rows, prefill_tokens, self._limit, seconds)
        self._limit = None
        if decode_rows + prefill_tokens <= 0:
            return
        self._steps += 1
        if self._probe is not None:
            # The probe counts as made whatever the step turned out to hold, so that a step whose
            # rows differ from what the scheduler asked about (the engine counts decode rows itself)
            # can never withhold prefill step after step.
            self._own_at[self._probe] = self._steps
            self._probe = None
        if prefill_tokens == 0 and self.factor > 0 and decode_rows > 0:
            self._observe_own(decode_rows, seconds)
        if decode_rows + prefill_tokens > self.fused_rows:
            self._largest_batched = max(self._largest_batched, decode_rows + prefill_tokens)
        predicted = self.predict(decode_rows, prefill_tokens)
        if predicted is not None:
            seconds = min(seconds, OUTLIER_FACTOR * max(predicted, 1e-6))
        self.fit.add(decode_rows, prefill_tokens, seconds)

    def _observe_own(self, decode_rows: int, seconds: float) -> None:
        self._own_at[decode_rows] = self._steps
        old = self._own.get(decode_rows)
        if old is None:
            bisect.insort(self._own_rows, decode_rows)
            self._own[decode_rows] = seconds
        else:  # (a stall counts as OUTLIER_FACTOR times the estimate, as in observe)
            self._own[decode_rows] = DECAY * old + (1 - DECAY) * min(seconds, OUTLIER_FACTOR * old)

    def own_step(self, decode_rows: int) -> Optional[float]:
        """The decode-only step of `decode_rows` rows as measured: its own mean, else the line
        between the nearest row counts measured below and above it, else (above every one
        measured) the largest's, which costs no more; None below every one measured."""
        rows = self._own_rows
        i = bisect.bisect_right(rows, decode_rows)
        if i == 0:
            return None
        lo = rows[i - 1]
        if lo == decode_rows or i == len(rows):
            return self._own[lo]
        hi = rows[i]
        w = (decode_rows - lo) / (hi - lo)
        return (1 - w) * self._own[lo] + w * self._own[hi]

    def target(self, decode_rows: int) -> float:
        """The most a step with `decode_rows` decode rows may take: the fixed target, or `factor`
        times their decode-only step (own_step) when that is longer, up to MAX_STRETCH times the
        fixed target.

        Under sustained load no step may run without prefill (a second wave arrives while the
        first still prefills), and a step of D decode rows alone is then never seen; the fit's
        line there is an extrapolation that read 95-137 ms for a 26 ms step. So a step whose D
        has no decode-only measurement, or only one older than OWN_REFRESH_STEPS steps, runs
        without prefill (prefill_tokens answers 0) and is measured: one step's chunk per decode
        row count that occurs, and one every OWN_REFRESH_STEPS steps after."""
        own = self.own_step(decode_rows) if self.factor > 0 else None
        if own is None:
            return self.target_s
        return min(max(self.target_s, self.factor * own), MAX_STRETCH * self.target_s)

    def prefill_tokens(self, decode_rows: int) -> Optional[int]:
        """The most prefill tokens a step with `decode_rows` decode rows may take (None: no limit)."""
        limit = self._prefill_limit(decode_rows)
        self._limit = limit
        return limit

    def _prefill_limit(self, decode_rows: int) -> Optional[int]:
        if decode_rows <= 0 or not self._measured(True):
            return None
        if self.factor > 0 and self._steps - self._own_at.get(decode_rows, -OWN_REFRESH_STEPS) >= OWN_REFRESH_STEPS:
            self._probe = decode_rows
            return 0  # measure this many decode rows alone (target's docstring)
        room = self.max_tokens - decode_rows
        if room <= 0:
            return 0
        small = large = 0
        target = self.target(decode_rows)
        # Within the small-batch regime: up to fused_rows rows in all.
        small_room = min(room, self.fused_rows - decode_rows)
        if small_room > 0:
            small = self._largest_fitting(False, decode_rows, small_room, 1, target)
        # Beyond it: every chunk from just past the split to the budget, within the trust region.
        lo = max(1, self.fused_rows - decode_rows + 1)
        hi = min(room, max(lo, TRUST_FACTOR * self._largest_batched - decode_rows))
        if lo <= hi:
            large = self._largest_fitting(True, decode_rows, hi, lo, target)
        # Both fit: the one predicted to prefill more tokens per second (see the module docstring).
        if large and small and self._rate(False, decode_rows, small) >= self._rate(True, decode_rows, large):
            large = 0
        return max(large or small, min(self.min_chunk, room))

    def _rate(self, large: bool, decode_rows: int, prefill_tokens: int) -> float:
        """Predicted prefill tokens per second of a step (an unmeasured regime counts as fastest)."""
        if not self._measured(large):
            return float("inf")
        return prefill_tokens / max(self.fit.predict(decode_rows, prefill_tokens), 1e-9)

    def _largest_fitting(self, large: bool, decode_rows: int, hi: int, lo: int, target: float) -> int:
        """The largest P in [lo, hi] whose predicted step fits `target` seconds (0 if none). An
        unmeasured regime is tried at its largest P (it is measured once it runs)."""
        if not self._measured(large):
            return hi
        base, per_token = self.fit.line(decode_rows, large)
        if per_token <= 0:
            return hi if base <= target else 0
        p = int((target - base) / per_token)
        return min(p, hi) if p >= lo else 0
