"""StepGate: how several engine threads (one per loaded model) share one CPU.

Each engine step runs torch's intra-op pool (OpenMP) over every core it is given. Two engine
threads stepping at once would each start a full team, oversubscribing the cores (2x threads,
cache thrash, spin-waits). Instead every engine thread takes the gate for each step: a FIFO
ticket lock, so with two models decoding the steps alternate A, B, A, B, each step using all the
cores. Throughput is shared per step (a model with a longer step gets proportionally more time);
their sum stays that of one model, and a model alone never waits (an uncontended gate costs a
lock round trip per step). Loading a model (reading, repacking, autotune) does not take the gate.
"""
from __future__ import annotations

import threading
from types import TracebackType
from typing import Optional


class StepGate:
    """A fair (first come, first served) lock held for one engine step."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next_ticket = 0
        self._serving = 0

    def __enter__(self) -> "StepGate":
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            while self._serving != ticket:
                self._cond.wait()
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()
