"""Poison work: when a step's forward raises, find the request that causes it and fail only that one.

Without this, one request whose forward raises (a kernel error on its shapes, a bad block table,
an injected fault) fails every request in the batch, and would again in every later step.
Instead the step's batch is retried split in halves, recursively: a half that runs keeps its
logits; a half that raises is split again, until the single sequence that raises is found. Its
request is failed with the cause in the error (`finish_reason` "error"), and the step goes on
with the others, whose outputs are exactly what they would have been: every sub-batch writes
only its own sequences' K/V slots for this step and returns its own logits rows.

Bounded: at most `max_runs(n)` sub-batch forwards per step (about four per halving level). When
the bound is reached (for example when every half fails because the fault is not one request's),
what is still unresolved fails together, as before this module existed.

Why re-running is safe: the forward has no side effect but writing this step's K/V into slots
the scheduler assigned to each sequence (and the copy-on-write block copies, which are
idempotent). Nothing is advanced or sampled before the forward succeeded. Blocks a failed
sequence registered with the prefix cache this step may hold unwritten K/V, so the prefix
cache's hashes are dropped when a culprit is failed (cached blocks become free; a cache miss
costs a recompute, a wrong hit would cost correctness).

`fault_hook` is a test-only fault injector, None (off) unless a test sets it: it is called with
the request ids of every (sub-)batch before its forward and may raise.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from server.engine.scheduler import ScheduledSeq, SchedulerOutput

logger = logging.getLogger("pagewire.engine")

fault_hook: Optional[Callable[[list[str]], None]] = None

Execute = Callable[[SchedulerOutput], torch.Tensor]


def max_runs(n: int) -> int:
    """Sub-batch forwards allowed to isolate culprits in a batch of n sequences."""
    return 4 * max(1, math.ceil(math.log2(max(n, 2)))) + 2


class _Bisection:
    def __init__(self, execute: Execute, out: SchedulerOutput) -> None:
        self.execute = execute
        self.out = out
        self.runs_left = max_runs(len(out.scheduled))
        self.runs = 0
        # Per share (by position in out.scheduled): its logits rows, when it samples and ran.
        self.rows: dict[int, Optional[torch.Tensor]] = {}
        self.culprits: dict[int, BaseException] = {}

    def run(self, positions: list[int]) -> None:
        shares = [self.out.scheduled[i] for i in positions]
        logits = _run(self.execute, SchedulerOutput(shares, self.out.preempted))
        r = 0
        for i, share in zip(positions, shares):
            n = share.num_logit_rows  # 1, or 1 + k with k proposed tokens
            self.rows[i] = logits[r : r + n] if n else None
            r += n

    def solve(self, positions: list[int], exc: BaseException) -> None:
        """`positions` is known to raise `exc` as a batch; find which of them do."""
        if len(positions) == 1 or self.runs_left <= 0:
            for i in positions:
                self.culprits[i] = exc
            return
        mid = len(positions) // 2
        for half in (positions[:mid], positions[mid:]):
            if self.runs_left <= 0:
                self.solve(half, exc)
                continue
            self.runs_left -= 1
            self.runs += 1
            try:
                self.run(half)
            except Exception as e:  # noqa: BLE001 - the cause is reported as the request's error
                self.solve(half, e)


def _run(execute: Execute, out: SchedulerOutput) -> torch.Tensor:
    if fault_hook is not None:
        fault_hook([s.seq.request.request_id for s in out.scheduled])
    return execute(out)


@dataclass
class Isolated:
    """A step's forward after isolation: the logits of the sequences that go on (`out`), and the
    requests that raised, with the cause, for the engine to fail (`LLMEngine.fail_request`)."""

    logits: torch.Tensor
    out: SchedulerOutput
    failed: dict[str, BaseException] = field(default_factory=dict)


def execute_isolating(execute: Execute, out: SchedulerOutput) -> Isolated:
    """Run the step's forward; on failure, isolate the requests that raise.

    Returns the logits and the SchedulerOutput of the sequences that go on (the input `out`
    itself when nothing failed), and the failed requests. Failing them (finish_reason "error",
    the cause in the error) and dropping the prefix cache's hashes is the engine's.
    """
    try:
        return Isolated(_run(execute, out), out)
    except Exception as first:  # noqa: BLE001
        if len(out.scheduled) == 0:
            raise
        logger.warning("engine step failed (%s); isolating the request that causes it among %d",
                       first, len(out.scheduled))
        b = _Bisection(execute, out)
        b.solve(list(range(len(out.scheduled))), first)
    bad_requests = {out.scheduled[i].seq.request.request_id: exc for i, exc in b.culprits.items()}
    survivors: list[ScheduledSeq] = []
    rows: list[torch.Tensor] = []
    for i, share in enumerate(out.scheduled):
        if share.seq.request.request_id in bad_requests:
            continue  # every sample of a failed request goes, not only the one that raised
        survivors.append(share)
        row = b.rows.get(i)
        if row is not None:
            rows.append(row)
    logger.warning("engine step: failed %d request(s) (%s) after %d isolating forward(s); %d continue",
                   len(bad_requests), ", ".join(bad_requests), b.runs, len(survivors))
    logits = torch.cat(rows) if rows else torch.empty((0, 0), dtype=torch.float32)
    return Isolated(logits, SchedulerOutput(survivors, out.preempted), bad_requests)
