"""Admission: the bounded queue between accepted requests and the engine, with fairness and backpressure.

The engine is handed at most `max_in_engine` requests at a time (its `max_num_seqs` plus a
small margin, so its next step always has work ready); every other accepted request waits here.
That keeps the engine's own waiting list short and puts the only unbounded-looking queue under
an explicit bound, so overload shows up as a 429 at the edge instead of latency everywhere.

Order of service:
1. the interactive class before the batch class;
2. within a class, round-robin across clients, so one busy client cannot starve the others;
3. within one client, lower `priority` value first (vLLM's convention), then arrival order.

Capacity is reserved (`reserve`) before the ledger insert and released on failure, so a
request is never acknowledged and then found not to fit. Everything runs on the event loop.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, Optional, TypeVar

from server.serving.errors import Overloaded

INTERACTIVE = 0
BATCH = 1

J = TypeVar("J", bound=Hashable)


@dataclass(order=True)
class _Entry(Generic[J]):
    priority: int
    order: int
    job: J = field(compare=False)


class AdmissionQueue(Generic[J]):
    """Args:
    max_queued: most requests waiting here (both classes, all clients).
    max_queued_per_client: most waiting for one client.
    max_in_engine: most requests handed to the engine and not yet finished.
    submit: called (on the loop) to hand a job to the engine. It must not raise, nor call back into
        this queue synchronously: a failed hand-off reports through `done` from a later callback.
    """

    def __init__(
        self,
        max_queued: int,
        max_queued_per_client: int,
        max_in_engine: int,
        submit: Callable[[J], None],
    ) -> None:
        self.max_queued = max_queued
        self.max_queued_per_client = max_queued_per_client
        self.max_in_engine = max_in_engine
        self._submit = submit
        # class -> client -> heap of entries; OrderedDict order is the round-robin order.
        self._queues: tuple[OrderedDict[str, list[_Entry[J]]], ...] = (OrderedDict(), OrderedDict())
        self._where: dict[J, tuple[int, str]] = {}
        self._reserved: dict[str, int] = {}  # reservations + queued, per client
        self._reserved_total = 0
        self._order = itertools.count()
        self.in_engine: set[J] = set()
        # While paused nothing is handed to the engine (its model is loading: server.serving.model_pool).
        self.paused = False
        # Mean seconds a request holds an engine slot, for Retry-After; updated by `done`.
        self.mean_service_s = 2.0

    # -- capacity -------------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        return len(self._where)

    def retry_after_s(self) -> float:
        """How long until a queue slot is likely free: the queue's drain time, clamped to [1, 60] s."""
        drain = (self._reserved_total + 1) * self.mean_service_s / max(1, self.max_in_engine)
        return float(min(60.0, max(1.0, drain)))

    def reserve(self, client: str) -> None:
        """Claim a queue slot for `client` or raise Overloaded (429) with a retry hint."""
        if self._reserved_total >= self.max_queued:
            raise Overloaded(
                f"server is at capacity: {self._reserved_total} requests are queued "
                f"(limit {self.max_queued}); retry later",
                retry_after_s=self.retry_after_s(),
            )
        mine = self._reserved.get(client, 0)
        if mine >= self.max_queued_per_client:
            raise Overloaded(
                f"too many queued requests for this client: {mine} (limit {self.max_queued_per_client}); "
                "retry later",
                retry_after_s=self.retry_after_s(),
            )
        self._reserved[client] = mine + 1
        self._reserved_total += 1

    def release(self, client: str) -> None:
        """Give back a reservation that will not be enqueued (validation or ledger failure)."""
        n = self._reserved.get(client, 0) - 1
        if n > 0:
            self._reserved[client] = n
        else:
            self._reserved.pop(client, None)
        self._reserved_total -= 1

    # -- queue ----------------------------------------------------------------------------------
    def enqueue(self, job: J, client: str, klass: int, priority: int) -> None:
        """Queue a job whose slot was reserved, then hand jobs to the engine while it has room."""
        q = self._queues[klass]
        heap = q.get(client)
        if heap is None:
            heap = q[client] = []
        heapq.heappush(heap, _Entry(priority, next(self._order), job))
        self._where[job] = (klass, client)
        self.pump()

    def remove(self, job: J) -> bool:
        """Drop a queued job (cancelled or expired before it reached the engine)."""
        where = self._where.pop(job, None)
        if where is None:
            return False
        klass, client = where
        heap = self._queues[klass][client]
        heap[:] = [e for e in heap if e.job != job]
        heapq.heapify(heap)
        if not heap:
            del self._queues[klass][client]
        self.release(client)
        return True

    def _next(self) -> Optional[tuple[J, str]]:
        for q in self._queues:
            if q:
                client, heap = next(iter(q.items()))
                entry = heapq.heappop(heap)
                # Round-robin: this client goes to the back of its class.
                if heap:
                    q.move_to_end(client)
                else:
                    del q[client]
                return entry.job, client
        return None

    def pump(self) -> None:
        """Hand queued jobs to the engine while it has fewer than max_in_engine."""
        while not self.paused and len(self.in_engine) < self.max_in_engine:
            nxt = self._next()
            if nxt is None:
                return
            job, client = nxt
            del self._where[job]
            self.release(client)
            self.in_engine.add(job)
            self._submit(job)

    def submit_to(self, submit: Callable[[J], None]) -> None:
        """Hand jobs to `submit` from now on (a model's queue is built before the service)."""
        self._submit = submit

    def take_all(self) -> list[J]:
        """Remove and return every queued job (their model failed to load), slots released."""
        jobs = list(self._where)
        for job in jobs:
            self.remove(job)
        return jobs

    def done(self, job: J, service_s: Optional[float] = None) -> None:
        """A job left the engine (finished, cancelled or failed): free its slot and refill."""
        if job in self.in_engine:
            self.in_engine.discard(job)
            if service_s is not None and service_s >= 0:
                self.mean_service_s = 0.8 * self.mean_service_s + 0.2 * service_s
            self.pump()
