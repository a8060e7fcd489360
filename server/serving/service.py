"""The request service: the one path every generation takes, shared by the HTTP and WebSocket edges.

    start(spec)   idempotency lookup → validate → tokenize → context check → reserve a queue slot
                  → ledger INSERT (queued) and COMMIT → register the stream → enqueue
    (admission)   → bridge.submit → ledger running
    on_step       → job.apply → stream events → outboxes (one loop callback per engine step)
    end           → ledger terminal row COMMIT → EndEvent to subscribers → stream retention

Ordering guarantees:
- `start` returns only after the queued row is committed; the edges acknowledge after it.
- A request's EndEvent (`done`) is published only after its terminal row is committed, so a
  client that saw `done` will find the request `finished` in the ledger even after a crash.
- All of this runs on the event loop; the engine thread is reached only through the bridge.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from server.engine.outputs import RequestDelta
from server.serving.access import Caller, Quotas, Reservation
from server.serving.errors import Conflict, NotFound, PagewireError, Unavailable
from server.serving.idempotency import fingerprint
from server.serving.job_end import end_event, terminal_row
from server.serving.jobs import GenerationSpec, Job, end_from_record, events_from_output, now_pair
from server.serving.key_claims import KeyClaims
from server.serving.lane_fit import fit_to_lane, gate_reasoning
from server.serving.ledger import IdempotencyConflict, Ledger, NewRequest, RequestRecord
from server.serving.ledger_health import unrecorded_end
from server.serving.lifecycle import (
    END_RULES,
    CancelReason,
    EndReason,
    JobState,
)
from server.serving.metrics import Metrics
from server.serving.model_lane import ModelLane
from server.serving.model_pool import ModelPool, Route
from server.serving.output_budget import OutputBudget, worst_case_bytes
from server.serving.prompts import PromptPreparer
from server.serving.streams import EndEvent, Replay, RequestStream, StreamRegistry, Subscriber

log = logging.getLogger("pagewire.service")

@dataclass
class Admitted:
    """The result of `start`: a new request, or the original one for a reused idempotency key
    (`existing`; `record` is its ledger row when it was found there)."""

    request_id: str
    record: Optional[RequestRecord] = None
    existing: bool = False
    prompt_tokens: Optional[int] = None  # known for a new request (Anthropic's message_start shows it)


class RequestService:
    def __init__(self, pool: ModelPool, ledger: Ledger,
                 registry: StreamRegistry, metrics: Metrics,
                 default_timeout_s: Optional[float], budget: Optional[OutputBudget] = None,
                 quotas: Optional[Quotas] = None, ledger_text: str = "all") -> None:
        # The served models by name (server.serving.model_pool): each request goes to its model's
        # lane (tokenizer, admission queue, engine), loaded on demand.
        self.pool = pool
        self.ledger = ledger
        self.registry = registry
        self.metrics = metrics
        self.default_timeout_s = default_timeout_s
        # Bytes of output live requests may hold (see output_budget); unbounded only when built
        # without one (offline tests of the service alone).
        self.budget = budget if budget is not None else OutputBudget(1 << 62, 1 << 62)
        # Token quotas per API key (server.serving.access.Quotas; the gateway's QuotaBook): reserved in `_accept`, settled in
        # `_commit_end`. None when auth is off.
        self.quotas = quotas
        self._reservations: dict[str, Reservation] = {}
        # What of a request's text the ledger keeps: none, prompt, or all (usage is always kept).
        self.ledger_text = ledger_text
        # Start-up: False until the default model's first load ended (requests get 503 `starting`
        # meanwhile, as with one model); `start_error` when that load failed.
        self.started = False
        self.start_error: Optional[str] = None
        # request id → (completion tokens last written to its row, monotonic time of that write)
        self._progress: dict[str, tuple[int, float]] = {}
        # Accepted requests not yet ended. Only this class reads or changes a Job: the edges go
        # through its methods (start, attach, detach, cancel, keep_for_resume, abandon).
        self._jobs: dict[str, Job] = {}
        # The idempotency keys being accepted or live, and the look-up of a key's original request.
        self._claims = KeyClaims(ledger, self._jobs)
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- models ---------------------------------------------------------------------------------
    @property
    def preparer(self) -> PromptPreparer:
        """The default model's prompt preparer (`lane(name).preparer` for another model's)."""
        return self.pool.default.preparer

    def route(self, model: Optional[str]) -> Route:
        """The lane a request's `model` names; 404 `model_not_found` for an unknown name."""
        r = self.pool.route(model)
        if r is None:
            raise NotFound(f"model: '{model}' does not exist; this server serves "
                           f"{', '.join(repr(n) for n in self.pool.names())}", param="model", code="model_not_found")
        return r

    def lane(self, model: Optional[str]) -> ModelLane:
        return self.route(model).lane

    # -- intake ---------------------------------------------------------------------------------
    def check_serving(self) -> None:
        if self.draining:
            raise Unavailable("server is shutting down", code="shutting_down", retry_after_s=5)
        if not self.started:
            if self.start_error is not None:
                raise Unavailable(f"model failed to load: {self.start_error}", code="model_load_failed")
            raise Unavailable("model is still loading", code="starting", retry_after_s=2)

    async def start(self, spec: GenerationSpec) -> Admitted:
        """Accept a request (row committed) or return the original for a reused idempotency key.

        The ledger's unique constraint is what decides between two attempts with one key: on a
        shared ledger another replica may commit the key between our lookup and our insert; the
        insert then fails (IdempotencyConflict) and the next pass finds that replica's row."""
        for _ in range(3):
            try:
                return await self._start_once(spec)
            except IdempotencyConflict:
                continue
        raise Unavailable("idempotency key is being claimed concurrently; retry", code="ledger_unavailable",
                          retry_after_s=1)

    async def _start_once(self, spec: GenerationSpec) -> Admitted:
        self.check_serving()
        found = await self._claims.find_or_claim(spec, self.default_timeout_s)
        if found is not None:
            return self._existing(*found)
        key = spec.idempotency_key
        # Acceptance runs in its own task, shielded: once the ledger INSERT is queued it will
        # commit, so a caller cancelled mid-way (socket closed, shutdown) must not orphan the
        # row; the job is registered anyway and then cancelled like any abandoned request.
        task = asyncio.get_running_loop().create_task(self._accept(spec))
        if key is not None:
            task.add_done_callback(lambda t: self._claims.settle(key, t))
        try:
            job = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._abandon_accepted)
            raise
        return Admitted(job.request_id, prompt_tokens=len(job.prompt_token_ids))

    def _abandon_accepted(self, task: "asyncio.Task[Job]") -> None:
        if not task.cancelled() and task.exception() is None:
            job = task.result()
            if not job.detached:
                self._cancel(job, CancelReason.CLIENT)

    def _existing(self, request_id: str, record: Optional[RequestRecord]) -> Admitted:
        job = self._jobs.get(request_id)
        n = len(job.prompt_token_ids) if job is not None else record.prompt_tokens if record is not None else None
        return Admitted(request_id, record=record, existing=True, prompt_tokens=n)

    async def _accept(self, spec: GenerationSpec) -> Job:
        route = self.route(spec.model)
        lane = route.lane
        fit_to_lane(spec, route)  # the route's adapter; a 400 for the task its model does not serve
        preparer = lane.preparer
        checked = preparer.check_sampling(spec)
        await preparer.compile_structured(checked, spec)  # 400 for a grammar that won't compile
        ids = await preparer.token_ids(spec, lane.max_model_len)
        self.check_serving()  # the model may have stopped while we tokenised
        params = preparer.finalize(spec, len(ids), lane.max_model_len)
        # The most this request can cost: its prompt and every sample's max_tokens.
        reservation: Optional[Reservation] = None
        request_id = f"req-{uuid.uuid4().hex[:24]}"
        if self.quotas is not None and spec.key_id is not None:
            try:
                # An embedding request emits nothing: it costs exactly its input tokens.
                output = params.n * (params.max_tokens or 0) if params.embedding is None else 0
                reservation = await self.quotas.acquire(spec.key_id, len(ids) + output, request_id, spec.model)
            except PagewireError:
                self.metrics.keys.add(spec.key_id, rate_limited=1)
                raise
        output_bytes = worst_case_bytes(params)
        try:
            self.budget.reserve(spec.client, output_bytes, params)
        except BaseException:
            if reservation is not None:
                self.quotas.settle(reservation, 0, ran=False)  # type: ignore[union-attr]
            raise
        try:
            lane.admission.reserve(spec.client)
        except BaseException:
            self.budget.release(spec.client, output_bytes)
            if reservation is not None:
                self.quotas.settle(reservation, 0, ran=False)  # type: ignore[union-attr]
            raise
        reasoning = lane.reasoning if spec.kind == "chat" else None
        if reasoning is not None:
            gate_reasoning(reasoning, ids, params, preparer)
        wall, mono = now_pair()
        job = Job(request_id, spec, ids, params, wall, mono, reasoning)
        job.output_bytes = output_bytes
        job.lane = lane
        try:
            await self.ledger.insert(NewRequest(
                request_id=job.request_id, kind=spec.kind, api=spec.api, client=spec.client,
                model=spec.model, priority=spec.priority, params=spec.params_record,
                prompt=(spec.messages if spec.kind == "chat" else spec.prompt)
                if self.ledger_text != "none" else None,
                prompt_tokens=len(ids), created_at=wall, idempotency_key=spec.idempotency_key,
                request_hash=fingerprint(spec) if spec.idempotency_key is not None else None,
                key_id=spec.key_id,
            ))
        except BaseException:
            lane.admission.release(spec.client)
            self.budget.release(spec.client, output_bytes)
            if reservation is not None:
                self.quotas.settle(reservation, 0, ran=False)  # type: ignore[union-attr]
            raise
        if reservation is not None:
            self._reservations[job.request_id] = reservation
        # Committed: from here the request exists and must reach a terminal state.
        self._jobs[job.request_id] = job
        self._idle.clear()
        self.registry.add(job.stream)
        timeout = spec.timeout_s or self.default_timeout_s
        if timeout:
            job.deadline_timer = asyncio.get_running_loop().call_later(timeout, self._expire, job)
        # Held until it ends: its model is never unloaded under it. An unloaded model starts
        # loading now; the job waits in its paused admission queue meanwhile.
        self.pool.hold(lane, spec.keep_alive_s)
        lane.admission.enqueue(job, spec.client, spec.klass, spec.priority)
        self.pool.want(lane)
        if self.draining:
            # Shutdown began while the row was being committed: the drain may already have
            # passed its cancel sweep, so end this one here (it becomes `interrupted`).
            self._cancel(job, CancelReason.SHUTDOWN)
        return job

    # -- subscribing ----------------------------------------------------------------------------
    async def attach(self, request_id: str, sub: Subscriber, after_seq: int = 0,
                     record: Optional[RequestRecord] = None,
                     on_found: Optional[Callable[[], None]] = None,
                     caller: Optional[Caller] = None) -> Optional[RequestStream]:
        """Replay what `sub` has not seen (from memory, else the ledger) and follow live output.

        `on_found` runs once the request is known to exist, immediately before the replay and in
        the same synchronous stretch, so a frame it queues (`accepted`) precedes every delta.
        Returns the live stream when `sub` was registered on one (to detach later), else None.
        `caller` (None when auth is off) must own the request or be the admin: another key gets
        the same 404 as an unknown id, so request ids leak nothing.
        """
        stream = self.registry.get(request_id)
        job = self._jobs.get(request_id)
        if (stream is None or (caller is not None and job is None)) and record is None:
            record = await self.ledger.get(request_id)
            stream = self.registry.get(request_id)  # it may have started while we read
            job = self._jobs.get(request_id)
        if caller is not None:
            owner = job.spec.key_id if job is not None else record.key_id if record is not None else None
            if not caller.may_see(owner):
                stream, record = None, None
        if stream is None and record is None:
            raise NotFound(f"request_id: no request {request_id!r}", param="request_id",
                           code="request_not_found")
        if stream is None and record is not None and not record.terminal and self.ledger.shared \
                and record.instance_id != self.ledger.instance_id:
            # Still running on another replica: its output lives there until its terminal row
            # commits. Say where, rather than replay a partial row as if it were the end.
            where = await self.ledger.instance_label(record.instance_id)
            raise Conflict(f"request_id: {request_id} is still running on replica {where}; resume it there "
                           "(or retry here once it has ended)", param="request_id", code="request_running_elsewhere")
        if on_found is not None:
            on_found()
        if stream is None:
            assert record is not None
            end = end_from_record(record)
            sub.catch_up(Replay(events_from_output(end.output or {}, after_seq), end=end))
            return None
        stream.attach(sub, after_seq)
        return stream if stream.end is None else None

    def detach(self, stream: Optional[RequestStream], sub: Subscriber) -> None:
        """`sub` leaves; the request is cancelled when nobody follows it and it is not detached."""
        if stream is None:
            return
        remaining = stream.detach(sub)
        job = self._jobs.get(stream.request_id)
        if remaining == 0 and job is not None and not job.detached:
            self._cancel(job, CancelReason.CLIENT)

    # -- the edges' controls --------------------------------------------------------------------
    def cancel(self, request_id: str, reason: CancelReason = CancelReason.CLIENT) -> bool:
        """Stop a live request (see `_cancel`); False when it is not live (unknown or ended)."""
        job = self._jobs.get(request_id)
        if job is None:
            return False
        self._cancel(job, reason)
        return True

    def keep_for_resume(self, request_id: str) -> None:
        """Its consumer was cut off: keep the request running with nobody following it, so that
        a resume (WebSocket) or an idempotent retry (HTTP) can collect the output."""
        job = self._jobs.get(request_id)
        if job is not None:
            job.detached = True

    def abandon(self, admitted: Admitted) -> None:
        """The caller that started this request left before following it: cancel it unless it
        was started detached or is an earlier request found by its idempotency key."""
        job = self._jobs.get(admitted.request_id)
        if job is not None and not job.detached and not admitted.existing:
            self._cancel(job, CancelReason.CLIENT)

    def _cancel(self, job: Job, reason: CancelReason) -> None:
        """Stop a request: a queued one ends at once, a running one at the engine's next step."""
        if job.state is JobState.QUEUED:
            if job.lane.admission.remove(job):
                job.cancel_reason = reason
                self._end(job, None)
                return
        if job.state is JobState.RUNNING and job.cancel_reason is None:
            job.cancel_reason = reason
            if job.lane.bridge is not None:
                job.lane.bridge.abort(job.request_id)

    def fail_queued(self, lane: ModelLane, message: str) -> None:
        """`lane`'s model failed to load: end every request waiting for it (failed, with why)."""
        for job in lane.admission.take_all():
            job.error = message
            self._end(job, None)

    def _expire(self, job: Job) -> None:
        job.deadline_timer = None
        if job.state in (JobState.QUEUED, JobState.RUNNING):
            log.info("request %s passed its deadline", job.request_id)
            self._cancel(job, CancelReason.DEADLINE)

    # -- engine side ----------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Admission's hand-off to the engine (must not raise; see AdmissionQueue)."""
        try:
            bridge = job.lane.bridge
            if bridge is None:
                raise RuntimeError(f"model {job.lane.name} is not loaded")
            bridge.submit(job.request_id, job.prompt_token_ids, job.params, job.spec.priority, job.spec.lora)
        except Exception as e:  # noqa: BLE001 - reported as the request's failure
            job.error = str(e)
            asyncio.get_running_loop().call_soon(self._end, job, None)
            return
        job.state = JobState.RUNNING
        wall, job.admitted_mono = now_pair()
        self.ledger.mark_running(job.request_id, wall)

    def on_step(self, deltas: list[RequestDelta]) -> None:
        """One engine step's news, on the loop (called by the bridge, once per step)."""
        now = time.monotonic()
        for d in deltas:
            job = self._jobs.get(d.request_id)
            if job is None or job.state not in (JobState.RUNNING, JobState.QUEUED):
                continue
            events = job.apply(d)
            n_new = max((len(e.token_ids) for e in events), default=0)
            if n_new:
                if job.first_token_mono is None:
                    job.first_token_mono = now
                    job.first_token_wall = time.time()
                    self.metrics.ttft.observe(now - job.created_mono)
                    self.ledger.mark_first_token(job.request_id, job.first_token_wall)
                elif job.last_token_mono is not None:
                    self.metrics.observe_tokens(now - job.last_token_mono, n_new)
                job.last_token_mono = now
                if job.spec.key_id is not None:
                    self._note_progress(job, now)
            if not job.queue_time_observed and d.first_scheduled_time is not None:
                job.queue_time_observed = True
                admission_wait = (job.admitted_mono or now) - job.created_mono
                self.metrics.queue_time.observe(admission_wait + max(0.0, d.first_scheduled_time - d.arrival_time))
            if d.finished:
                self._end(job, d)

    # Emitted tokens are written to a running row at most every PROGRESS_TOKENS tokens or
    # PROGRESS_S seconds (fire-and-forget, group-committed), so after a crash the row, and the
    # key's daily usage read back from it, counts what was emitted up to that bound.
    PROGRESS_TOKENS = 16
    PROGRESS_S = 1.0

    def _note_progress(self, job: Job, now: float) -> None:
        n = job.completion_tokens
        last_n, last_t = self._progress.get(job.request_id, (0, job.created_mono))
        if n - last_n >= self.PROGRESS_TOKENS or now - last_t >= self.PROGRESS_S:
            self._progress[job.request_id] = (n, now)
            self.ledger.mark_progress(job.request_id, n)

    def _end(self, job: Job, delta: Optional[RequestDelta]) -> None:
        """Decide how `job` ended (its EndReason) and commit that; `delta` is None when it never
        reached the engine or the engine refused it."""
        if job.state in (JobState.ENDING, JobState.ENDED):
            return
        was_running = job.state is JobState.RUNNING
        job.state = JobState.ENDING
        if job.deadline_timer is not None:
            job.deadline_timer.cancel()
            job.deadline_timer = None
        if was_running:
            job.lane.admission.done(job, time.monotonic() - (job.admitted_mono or job.created_mono))
        self.pool.release(job.lane)
        end = end_event(job, delta)
        task = asyncio.get_running_loop().create_task(self._commit_end(job, end))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _commit_end(self, job: Job, end: EndEvent) -> None:
        terminal = terminal_row(job, end, self.ledger_text)
        try:
            await self.ledger.finish(job.request_id, terminal)
        except Exception as e:
            # Not durable, so not `done`: the client hears that the record failed, and the
            # ledger holds the terminal write (usage included) and retries it until it lands.
            log.error("ledger: could not record the end of %s (%s); retrying in the background",
                      job.request_id, e)
            self.ledger.finish_later(job.request_id, terminal)
            end = unrecorded_end(end, e)
        self._progress.pop(job.request_id, None)
        reservation = self._reservations.pop(job.request_id, None)
        if reservation is not None and self.quotas is not None:
            # The same rule as usage.BILLABLE_SQL: a request that reached the engine costs its
            # prompt and what it emitted; one that never did costs nothing.
            ran = job.admitted_mono is not None
            self.quotas.settle(reservation, end.usage.prompt_tokens + end.usage.completion_tokens if ran else 0,
                               ran=ran)
            self.metrics.keys.add(reservation.key_id, requests=1, prompt=end.usage.prompt_tokens if ran else 0,
                                  completion=end.usage.completion_tokens if ran else 0)
        # Only now, with the terminal row durable, may the client hear `done`.
        job.state = JobState.ENDED
        job.end = end
        self.metrics.observe_end(end.state, (job.last_token_mono or time.monotonic()) - job.created_mono)
        job.lane.count_end(end.state, end.usage.prompt_tokens, end.usage.completion_tokens)
        job.stream.finish(end)
        self.registry.ended(job.stream)
        self._jobs.pop(job.request_id, None)
        self.budget.release(job.spec.client, job.output_bytes)
        key = job.spec.idempotency_key
        if key is not None:
            self._claims.release(key)
        if not self._jobs:
            self._idle.set()

    def memory_gauges(self) -> dict[str, tuple[str, float]]:
        """What the bounded in-memory structures hold now, for /metrics (scrape time)."""
        return {
            "pagewire_live_requests": ("Accepted requests that have not ended.", float(len(self._jobs))),
            "pagewire_output_bytes_reserved": (
                "Bytes of output reserved by live requests (bounded by --max-output-bytes).",
                float(self.budget.reserved)),
            "pagewire_stream_live_bytes": ("Bytes in the resume buffers of live requests.",
                                           float(self.registry.live_bytes())),
            "pagewire_streams_retained": ("Ended streams kept in memory for resume.",
                                          float(self.registry.ended_count)),
            "pagewire_stream_retained_bytes": (
                "Bytes held by ended streams kept for resume (bounded by --stream-retention-bytes).",
                float(self.registry.retained_bytes)),
        }

    # -- shutdown -------------------------------------------------------------------------------
    async def drain(self, grace_s: float, abort_wait_s: float = 5.0) -> None:
        """Stop accepting; let in-flight requests finish for up to `grace_s`; interrupt the rest;
        make sure every ledger row is terminal."""
        self.draining = True
        # Requests still being tokenised are not accepted yet: they get 503 now, rather than
        # hold their connections (and the exit) until their tokenisation ends.
        for lane in self.pool.lanes.values():
            lane.preparer.abort_waits(Unavailable("the server is shutting down", code="shutting_down"))
        if self._jobs:
            log.info("draining: waiting up to %.1fs for %d request(s)", grace_s, len(self._jobs))
            try:
                await asyncio.wait_for(self._idle.wait(), grace_s)
            except asyncio.TimeoutError:
                pass
        for job in list(self._jobs.values()):
            self._cancel(job, CancelReason.SHUTDOWN)
        if self._jobs:
            try:
                await asyncio.wait_for(self._idle.wait(), abort_wait_s)
            except asyncio.TimeoutError:
                log.warning("draining: %d request(s) did not stop in time", len(self._jobs))
        if self._tasks:
            # Terminal commits in flight. Bounded: a ledger that stopped answering must not hold
            # the process up for good (what did not commit is interrupted at the next start).
            _, pending = await asyncio.wait(list(self._tasks), timeout=abort_wait_s)
            if pending:
                log.warning("draining: %d terminal write(s) still pending", len(pending))
        await self.ledger.interrupt_open(END_RULES[EndReason.INTERRUPTED].message or "")

