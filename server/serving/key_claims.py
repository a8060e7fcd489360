"""Idempotency keys on the request path: who holds a key now, and which request a reused key names.

A key is claimed in memory from the moment a new request for it is being accepted until that
request's terminal row commits, so two attempts with one key in this process share one request.
Before claiming, the ledger is asked for the key's row: a finished or running original is the
answer (after the fingerprint check of server.serving.idempotency), an orphaned `queued` row of
this instance is reclaimed, and an original open on another replica of a shared ledger is waited
for. The request service owns the jobs; this module only reads them.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Mapping, Optional

from server.serving.errors import Conflict
from server.serving.idempotency import check_reuse, fingerprint
from server.serving.jobs import GenerationSpec, Job
from server.serving.ledger import Ledger, RequestRecord

log = logging.getLogger("pagewire.service")


class KeyClaims:
    """The in-flight idempotency keys of one service, and the look-up of a key's original request."""

    ELSEWHERE_POLL_S = 0.1

    def __init__(self, ledger: Ledger, jobs: Mapping[str, Job]) -> None:
        self.ledger = ledger
        self._jobs = jobs  # the service's accepted, not yet ended requests (read only here)
        # idempotency key → future of its request id; covers the window before the row commits
        # and the whole live life of the request (released after the terminal commit).
        self.pending: dict[str, asyncio.Future[Optional[str]]] = {}

    async def find_or_claim(self, spec: GenerationSpec,
                            default_timeout_s: Optional[float]) -> Optional[tuple[str, Optional[RequestRecord]]]:
        """The original request for `spec`'s key, as (request id, its ledger row when it was read
        there); or None when `spec` has no key, or when the key is now claimed for a new request
        (settle the claim with `settle` once its acceptance ends)."""
        key = spec.idempotency_key
        while key is not None:
            fut = self.pending.get(key)
            if fut is not None:
                rid = await asyncio.shield(fut)
                if rid is not None:
                    await self._check_same_request(spec, rid, None)
                    return rid, None
                continue  # the first attempt was rejected before acceptance: try afresh
            record = await self.ledger.find_by_idempotency_key(key)
            if record is not None and await self._reclaim_orphan(record):
                record = None  # the first attempt's ambiguous commit landed, but it never ran
            if record is not None:
                await self._check_same_request(spec, record.request_id, record)
                if self._elsewhere(record):
                    record = await self._await_end_elsewhere(record, spec.timeout_s or default_timeout_s)
                return record.request_id, record
            if key in self.pending:  # someone claimed it while we read the ledger
                continue
            claim: asyncio.Future[Optional[str]] = asyncio.get_running_loop().create_future()
            self.pending[key] = claim
            break
        return None

    def settle(self, key: str, task: "asyncio.Task[Job]") -> None:
        """The acceptance of the request that claimed `key` ended: waiters get its id, or retry
        afresh when it was rejected (the claim is then dropped)."""
        fut = self.pending.get(key)
        ok = not task.cancelled() and task.exception() is None
        if not ok:
            self.pending.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(task.result().request_id if ok else None)

    def release(self, key: str) -> None:
        """The key's request has its terminal row: the ledger answers for the key from now on."""
        self.pending.pop(key, None)

    async def _check_same_request(self, spec: GenerationSpec, request_id: str,
                                  record: Optional[RequestRecord]) -> None:
        """409 when an idempotency key is reused for a different request (see idempotency)."""
        job = self._jobs.get(request_id)
        if job is not None:
            stored: Optional[str] = fingerprint(job.spec)
        else:
            if record is None:
                record = await self.ledger.get(request_id)
            stored = record.request_hash if record is not None else None
        check_reuse(spec, stored, request_id)

    async def _reclaim_orphan(self, record: RequestRecord) -> bool:
        """Reconcile an ambiguous commit by its idempotency key. A `queued` row of this instance
        with no job here is the insert of an attempt whose COMMIT did not answer in time (the
        client was told 503 and is retrying): it may have landed, but it was never run. Its row
        is removed (only while still `queued` and ours) so that the retry runs it, once."""
        if record.state != "queued" or record.instance_id != self.ledger.instance_id or \
                record.request_id in self._jobs:
            return False
        n = await self.ledger.execute("DELETE FROM requests WHERE request_id = ? AND state = 'queued' AND "
                                      "instance_id = ?", (record.request_id, self.ledger.instance_id))
        if n:
            log.warning("ledger: %s was committed by an attempt that timed out and never ran; its retry "
                        "(same idempotency key) replaces it", record.request_id)
        return bool(n)

    def _elsewhere(self, record: RequestRecord) -> bool:
        """Open on another replica of a shared ledger (its output lives there until it ends)."""
        return not record.terminal and self.ledger.shared and record.instance_id != self.ledger.instance_id

    async def _await_end_elsewhere(self, record: RequestRecord, timeout_s: Optional[float]) -> RequestRecord:
        """An idempotent retry of a request that another replica is running: wait for its terminal
        row (or for its replica's lease to lapse, when a sweep interrupts it), then answer from the
        ledger, so the same key gives one request and one output wherever it is retried. Polled:
        the row is the only news one replica has of another's request."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout_s or 600.0)
        while True:
            await asyncio.sleep(self.ELSEWHERE_POLL_S)
            await self.ledger.sweep_dead()
            fresh = await self.ledger.get(record.request_id)
            if fresh is not None and fresh.terminal:
                return fresh
            if loop.time() >= deadline:
                where = await self.ledger.instance_label(record.instance_id)
                raise Conflict(f"request {record.request_id} (this idempotency key's) is still running on replica "
                               f"{where}; retry later", code="request_running_elsewhere")
