"""How many CPU threads the engine's steps run on while other processes crowd the cores
(ThreadGovernor).

Why: a step's multi-threaded kernels split their work in static shares (each thread one slice of a
weight), and a decode step hands out a hundred or more of them (a DecodeStack crew's handoffs,
OpenMP regions), the waiting threads spinning between shares. When another busy process wants one
of the cores, the scheduler takes it from one of the step's threads for a slice of several
milliseconds at a time, and every share handed to that thread meanwhile waits the slice out while
its partner spins. On the 2-core Zen 3, one `yes` loop beside the default model turned a 7 ms decode
step into 100 ms, where the same step on one thread took 11 ms (bench/crowded_decode.py,
bench/RESULTS.md session 40). Results do not depend on the thread count (docs/determinism.md: the
kernels split by output rows, never inside a reduction), so the count can follow the machine.

How, from the steps' own wall times (nothing asks the OS; a crowd of any origin counts, this
process's own other threads included):
  * Only decode-only steps are compared, each with steps of the same number of rows at the same
    thread count: a shape's best time there, which may rise DRIFT per step as contexts grow.
  * STRIKES such steps in a row over SLOW times their best make a probe: the next PROBE_STEPS
    decode-only steps run on half the threads, each compared with its row count's reference, the
    median of the last (up to) RECENT steps of that row count on the current count (at least two:
    one cold first step after start-up read 7x a settled one in serving). Where they take at most
    WIN of it, the engine stays on fewer threads; otherwise it goes back, and the slower times
    become the shape's best (the work grew). A probe whose steps never match a reference's row
    count within PROBE_GIVE_UP steps of any kind (serving's batch changing) is inconclusive:
    nothing learnt, nothing held against the next try.
  * A crowd already there when the engine starts leaves no faster best to compare with: so on all
    the threads, every EXPLORE_S (the first after EXPLORE_AFTER decode-only steps and
    EXPLORE_FIRST_S) a probe of half the threads runs anyway. Where nothing crowds, it costs one
    step (a step on half the threads takes ABORT times the time or more there).
  * On fewer threads, every HOLD_S (doubling after each failed try, up to MAX_HOLD_S) a probe the
    other way tries twice the threads, and takes them where they win by the same margin.
Only decode-only steps of a row count the probe has a reference for run on its count; the others
(prefill chunks, mixed steps, other batch sizes) keep the settled count while a probe lasts: on a
crowded machine a step on both threads costs ten of the other kind. For the same reason a probe
step that comes out clearly slower (ABORT times its reference) ends the probe at once.

Owned by the stepping thread: LLMEngine asks threads_for once a step is scheduled (its decode
rows and prefill tokens known) and reports the finished step to observe. The engine applies a
count other than `full` for the step alone (torch.set_num_threads: the calling thread's OpenMP
count, which every kernel reads; 0.3 us) and puts `full` back after it, so a thread that steps an
engine (LLM.generate's caller) keeps its own count between steps.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

__all__ = ["ThreadGovernor"]

logger = logging.getLogger("pagewire.threads")

SLOW = 2.0          # a decode-only step this many times its shape's best counts as crowded
STRIKES = 3         # crowded steps in a row before a probe of fewer threads
RECENT = 3          # steps per row count a reference is the median of (at least 2 of them)
PROBE_STEPS = 3     # comparable decode-only steps a probe times
PROBE_GIVE_UP = 16  # steps a probe waits for them (row counts that keep changing, prefill)
WIN = 0.8           # a probed count must take at most this share of the reference's time
ABORT = 1.5         # one probe step this many times its reference ends the probe
DRIFT = 1.002       # per observation, how far a shape's best may rise (longer contexts)
HOLD_S = 1.0        # on fewer threads: seconds before trying more
MAX_HOLD_S = 4.0    # ... doubling after each lost try up to this
EXPLORE_AFTER = 32  # on all the threads: decode-only steps before the first probe on the clock
EXPLORE_FIRST_S = 1.0  # ... and seconds from the first decode-only step
EXPLORE_S = 30.0    # ... and between such probes after it


@dataclass
class _Probe:
    """Steps on `threads` compared with the settled count's steps just before (`ref`: rows -> seconds)."""
    threads: int
    ref: dict[int, float]
    explore: bool = False  # a probe made on the clock, not by crowded steps
    ratios: list[float] = field(default_factory=list)
    seen: int = 0


class ThreadGovernor:
    """The steps' settled thread count (`threads`) and its probes, from the decode-only steps' times."""

    def __init__(self, threads: int, clock: Callable[[], float] = time.monotonic) -> None:
        if threads < 1:
            raise ValueError(f"threads: must be >= 1, got {threads}")
        self.full = threads
        self.threads = threads
        self.switches = 0  # count changes made (stats, tests)
        self._clock = clock
        self._best: dict[tuple[int, int], float] = {}  # (threads, rows) -> best decode-only step
        self._recent: dict[int, deque[float]] = {}  # rows -> the last decode-only steps on `threads`
        self._observed = 0
        self._strikes = 0
        self._probe: Optional[_Probe] = None
        self._hold_s = HOLD_S
        self._retry_at = 0.0  # on fewer than `full` threads: when to try more
        self._explore_at: Optional[float] = None  # on `full` threads: when to try fewer anyway

    def threads_for(self, decode_rows: int, prefill_tokens: int) -> int:
        """The threads a scheduled step runs on: the settled count, or a probe's for a decode-only
        step (which may start one: on fewer than `full` past the hold, a probe of more; on `full`,
        now and then a probe of fewer)."""
        if prefill_tokens or decode_rows <= 0:
            return self.threads
        if self._probe is None:
            now = self._clock()
            if self.threads < self.full:
                if now >= self._retry_at:
                    self._start(min(self.full, self.threads * 2))
            elif (self.threads > 1 and self._explore_at is not None and now >= self._explore_at
                  and self._observed >= EXPLORE_AFTER):
                self._explore_at = now + EXPLORE_S
                self._start(max(1, self.threads // 2), explore=True)
        p = self._probe
        return p.threads if p is not None and decode_rows in p.ref else self.threads

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """A finished step's shape and wall time (as threads_for was asked); only decode-only steps
        are compared."""
        p = self._probe
        if prefill_tokens or decode_rows <= 0 or seconds <= 0 or (p is not None and decode_rows not in p.ref):
            if p is not None:  # a step on the settled count, toward PROBE_GIVE_UP
                p.seen += 1
                if p.seen >= PROBE_GIVE_UP:
                    self._finish(won=False)
            return
        self._observed += 1
        if self._explore_at is None:
            self._explore_at = self._clock() + EXPLORE_FIRST_S
        key = (p.threads if p is not None else self.threads, decode_rows)
        best = self._best.get(key)
        self._best[key] = seconds if best is None else min(seconds, best * DRIFT)
        if p is not None:
            self._probe_step(decode_rows, seconds)
            return
        self._recent.setdefault(decode_rows, deque(maxlen=RECENT)).append(seconds)
        if best is not None and seconds > SLOW * best:
            self._strikes += 1
            if self._strikes >= STRIKES and self.threads > 1:
                self._start(max(1, self.threads // 2))
        else:
            self._strikes = 0

    def _references(self) -> dict[int, float]:
        """Per row count, the median of its recent steps on the current count (two or more)."""
        return {rows: statistics.median(d) for rows, d in self._recent.items() if len(d) >= 2}

    def _start(self, threads: int, explore: bool = False) -> None:
        ref = self._references()
        if not ref:
            return  # nothing to compare with yet: the next step asks again
        logger.debug("probe of %d threads (from %d, %s)", threads, self.threads,
                     "on the clock" if explore else "crowded steps" if threads < self.threads else "after the hold")
        self._probe = _Probe(threads=threads, ref=ref, explore=explore)
        self._strikes = 0

    def _probe_step(self, rows: int, seconds: float) -> None:
        p = self._probe
        assert p is not None
        p.seen += 1
        p.ratios.append(seconds / p.ref[rows])
        if p.ratios[-1] >= ABORT:
            self._finish(won=False)
        elif len(p.ratios) >= PROBE_STEPS:
            self._finish(won=statistics.median(p.ratios) <= WIN)
        elif p.seen >= PROBE_GIVE_UP:
            self._finish(won=False)

    def _finish(self, won: bool) -> None:
        p = self._probe
        assert p is not None
        self._probe = None
        fewer = p.threads < self.threads  # (the settled count does not move during a probe)
        measured = len(p.ratios) >= PROBE_STEPS or (p.ratios and p.ratios[-1] >= ABORT)
        logger.debug("probe of %d threads %s: ratios %s", p.threads,
                     "won" if won else "lost" if measured else "inconclusive", " ".join(f"{r:.2f}" for r in p.ratios))
        if won:
            logger.info("CPU threads %d -> %d: decode steps took %.2fx the time on %d (%s)", self.threads, p.threads,
                        statistics.median(p.ratios), p.threads,
                        "other processes crowd the cores" if fewer else "the crowd has gone")
            if not fewer:
                self._hold_s = HOLD_S
            self._recent = {}
            self.threads = p.threads
            self.switches += 1
        else:
            if measured and not fewer:
                self._hold_s = min(MAX_HOLD_S, self._hold_s * 2)
            elif measured and not p.explore:  # not a crowd: the work grew, the slower times are the best now
                for rows, s in p.ref.items():
                    self._best[(self.threads, rows)] = s
        if self.threads < self.full:
            self._retry_at = self._clock() + self._hold_s
        else:
            self._explore_at = self._clock() + EXPLORE_S
