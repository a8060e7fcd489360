"""StepBudget: sizes each step's prefill chunk from a measured step-time budget (ITL under load).

While sequences decode, every engine step is one inter-token gap for each of them, and a prefill
chunk that joins the step stretches that gap. This module owns the trade-off between the running
streams' cadence and the new requests' time to first token:

- It keeps an online estimate of what a step costs, from the wall time of every step the engine
  runs (`observe`):

      t(step) ~ fixed + per_prefill_token * P + per_decode_row * D

  (D: decode rows, a decode's speculative lookahead included; P: prefill tokens). The estimate is
  kept separately for two regimes of the step's row count M = D + P, split at `fused_rows`: on a
  CPU, steps of at most 16 rows run pagewire's fused decode layer and integer kernels, and larger
  ones switch to the batched (GEMM or chunked-dequantise) paths, whose cost jumps by a fixed amount
  (on the default Q4_1 model, one 17-row step costs about three 16-row ones). A single line through
  both regimes would misjudge both.
- Each regime is an exponentially weighted least-squares fit (the last ~`1 / (1 - DECAY)` steps
  count most, so it follows load changes on a shared host) with a small ridge: the per-row slope
  leans towards 0 and a decode row's cost leans towards a prefill token's (they are rows of the
  same GEMMs; decode rows differ by their attention over the whole context).
- The batched regime's fixed cost leans towards the small-batch regime's. Serving often shows
  that regime at one row count only (steps with nothing decoding take the whole token budget, and
  same-length prompts make every one of them the same size), which pins `fixed + slope * M` at
  that M and nothing else. With a free fixed cost, the ridge put the whole step into it (a 256-row
  step of 300 ms read as "300 ms fixed"), so no chunk beside decodes ever seemed to fit, none was
  tried, and new requests prefilled at the small regime's few tokens a step for good. Leaning on
  the small regime's fixed cost instead reads the same step as its per-row cost, which predicts
  mid-sized chunks optimistically where the batched regime has a jump: the first such chunk is
  measured, the fit then sees two row counts, and the data outweighs the lean. One step measured more than
  OUTLIER_FACTOR times its prediction (another process took the core) counts as OUTLIER_FACTOR
  times the prediction, so a single stall does not halve the chunks that follow.
- `prefill_tokens(D)`: with D > 0 decode rows this step, the most prefill tokens whose predicted
  step time stays within the ITL target, trying both regimes: the largest chunk that keeps the step
  within `fused_rows` rows, and the largest beyond it. It is at least `min_chunk` (8: a new
  request always progresses, so the TTFT lead stays, and beside up to 8 decode rows that floor
  still fits the small-batch regime) and None (no limit: the step's whole token budget,
  the fastest TTFT) when nothing decodes, since then there is no cadence to keep, or before the
  batched regime has been measured at all.

Pure Python and deterministic: the policy is a function of the observations fed to it, so
tests drive it with step costs of their choosing (tests/engine/test_step_budget.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Weight of the previous estimate per new observation in the regime (about the last 10 steps count).
DECAY = 0.9
# An observed step longer than this times its prediction is counted as this times the prediction:
# a lasting slowdown is still followed (the prediction grows by up to this factor per step).
OUTLIER_FACTOR = 1.5
# Ridge weights of the fit's parameters (fixed, per row, a decode row's extra): the fixed cost is
# free; the per-row slope leans weakly towards 0 and a decode row's extra cost towards 0 (see above).
_RIDGE = (1e-9, 1e-3, 4.0)
# The batched regime's fixed cost leans towards the small regime's with this weight: it decides
# only what the data leaves open (one row count seen), since two row counts a few tokens apart
# already outweigh it by orders of magnitude.
_FIXED_LEAN = 1e-3


class _RegimeFit:
    """t ~ a + b * M + e * D over the steps of one regime, exponentially weighted, with a ridge
    that leans (a, b, e) towards `prior` with the weights `ridge`.

    b is the cost of one prefill token and b + e that of one decode row."""

    def __init__(self, ridge: tuple[float, float, float] = _RIDGE) -> None:
        # Weighted normal equations: XtX (3 x 3, symmetric) and Xt t over features (1, M, D).
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xtt = [0.0] * 3
        self.count = 0
        self.ridge = ridge
        self.prior = (0.0, 0.0, 0.0)
        self.theta = (0.0, 0.0, 0.0)

    def predict(self, decode_rows: int, prefill_tokens: int) -> float:
        a, b, e = self.theta
        return a + b * (decode_rows + prefill_tokens) + e * decode_rows

    def add(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        x = (1.0, float(decode_rows + prefill_tokens), float(decode_rows))
        for i in range(3):
            self._xtt[i] = DECAY * self._xtt[i] + x[i] * seconds
            for j in range(3):
                self._xtx[i][j] = DECAY * self._xtx[i][j] + x[i] * x[j]
        self.count += 1
        self.solve()

    def lean(self, prior: tuple[float, float, float]) -> None:
        """Lean the fit towards `prior` from now on (and refit)."""
        self.prior = prior
        if self.count:
            self.solve()

    def solve(self) -> None:
        # The ridge's minimum: (XtX + R) theta = Xt t + R prior.
        r = self.ridge
        self.theta = _solve([[self._xtx[i][j] + (r[i] if i == j else 0.0) for j in range(3)] for i in range(3)],
                            [self._xtt[i] + r[i] * self.prior[i] for i in range(3)])


def _solve(a: list[list[float]], y: list[float]) -> tuple[float, float, float]:
    """a x = y for a symmetric positive definite 3 x 3 a (Gaussian elimination with partial pivoting)."""
    n = 3
    m = [row[:] + [y[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        piv = m[c][c]
        for r in range(c + 1, n):
            f = m[r][c] / piv
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x[0], x[1], x[2]


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
        max_tokens: the step's token budget (max_num_batched_tokens); no limit exceeds it.
        fused_rows: the row count up to which steps take the small-batch kernels (the regimes' split).
        min_chunk: the fewest prefill tokens a step with decodes is allowed.
    """

    def __init__(self, target_s: float, max_tokens: int, fused_rows: int = 16, min_chunk: int = 8) -> None:
        if not target_s > 0:
            raise ValueError(f"itl_target_ms: must be positive, got {target_s * 1e3}")
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.fused_rows = fused_rows
        self.min_chunk = max(1, min(min_chunk, max_tokens))
        self.small = _RegimeFit()
        self.large = _RegimeFit((_FIXED_LEAN, *_RIDGE[1:]))
        self.last = StepRecord()
        self._limit: Optional[int] = None  # what prefill_tokens last returned (for `last`)

    def _fit(self, rows: int) -> _RegimeFit:
        return self.small if rows <= self.fused_rows else self.large

    def predict(self, decode_rows: int, prefill_tokens: int) -> Optional[float]:
        """Predicted seconds of a step with these rows; None while its regime is unmeasured."""
        fit = self._fit(decode_rows + prefill_tokens)
        return fit.predict(decode_rows, prefill_tokens) if fit.count else None

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """Feed one step's measured wall time (the engine calls this after every step that ran)."""
        self.last = StepRecord(decode_rows, prefill_tokens, self._limit, seconds)
        self._limit = None
        rows = decode_rows + prefill_tokens
        if rows <= 0:
            return
        fit = self._fit(rows)
        if fit.count:
            seconds = min(seconds, OUTLIER_FACTOR * max(fit.predict(decode_rows, prefill_tokens), 1e-6))
        fit.add(decode_rows, prefill_tokens, seconds)
        if fit is self.small:  # the batched regime's fixed cost leans on the small one's (see above)
            self.large.lean((self.small.theta[0], 0.0, 0.0))

    def prefill_tokens(self, decode_rows: int) -> Optional[int]:
        """The most prefill tokens a step with `decode_rows` decode rows may take (None: no limit)."""
        limit = self._prefill_limit(decode_rows)
        self._limit = limit
        return limit

    def _prefill_limit(self, decode_rows: int) -> Optional[int]:
        if decode_rows <= 0 or not self.large.count:
            return None
        room = self.max_tokens - decode_rows
        if room <= 0:
            return 0
        best = 0
        # Within the small-batch regime: up to fused_rows rows in all.
        small_room = min(room, self.fused_rows - decode_rows)
        if small_room > 0:
            best = self._largest_fitting(self.small, decode_rows, small_room, 1)
        # Beyond it: every chunk from just past the split to the budget.
        lo = max(1, self.fused_rows - decode_rows + 1)
        if lo <= room:
            best = max(best, self._largest_fitting(self.large, decode_rows, room, lo))
        return max(best, min(self.min_chunk, room))

    def _largest_fitting(self, fit: _RegimeFit, decode_rows: int, hi: int, lo: int) -> int:
        """The largest P in [lo, hi] whose predicted step fits the target (0 if none). An unmeasured
        regime is tried at its largest P (it is measured once it runs)."""
        if not fit.count:
            return hi
        a, b, e = fit.theta
        per_token = b
        base = a + (b + e) * decode_rows
        if per_token <= 0:
            return hi if base <= self.target_s else 0
        p = int((self.target_s - base) / per_token)
        return min(p, hi) if p >= lo else 0
