"""Runtime: the one object that owns a serving process's parts and their start/stop order.

Start (ASGI lifespan, before the socket accepts): open the ledger (which turns rows a previous
process left open into `interrupted`), load the tokenizer, wire admission/streams/metrics/service,
and start the engine thread, which loads the weights in the background (/health is 503 until then).

Stop, in two stages (see `server.serve`): `drain()` stops accepting, gives in-flight requests the
grace period, interrupts the rest, makes every ledger row terminal, then runs the drain hooks that
the edges registered (the WebSocket endpoint closes its sockets with 1001 after flushing their
final frames); `close()` stops the engine thread and the ledger.

The Runtime knows nothing of the API layer (HTTP, WebSocket, OpenAI shapes) nor of the gateway:
the edges import it, never the other way round, and the gateway's policy (keys, quotas) comes in
as an `AccessPolicy` (server.serving.access) from the composition root, `server/serve.py`.
"""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from server.models.pooling import Pooler
from server.serving.access import AccessPolicy
from server.serving.admission import AdmissionQueue
from server.serving.bridge import EngineBridge
from server.serving.db_lock import LedgerLock
from server.serving.ledger import Ledger
from server.serving.metrics import Metrics
from server.serving.model_catalog import ModelEntry
from server.serving.model_lane import LaneState, ModelLane, open_lane
from server.serving.model_lane import pick_reasoning_format as pick_reasoning_format  # re-exported
from server.serving.model_metrics import ModelCollector
from server.serving.model_names import ModelNames
from server.serving.model_pool import ModelPool
from server.serving.output_budget import OutputBudget
from server.serving.router_view import router_gauges
from server.serving.service import RequestService
from server.serving.settings import ServeSettings
from server.serving.streams import StreamRegistry
from server.text.reasoning import ReasoningFormat
from server.text.tokenizer import Tokenizer

log = logging.getLogger("pagewire")


def one_line(exc: BaseException) -> str:
    """An exception's text on one line (whitespace folded), or its type when it has none."""
    return " ".join(str(exc).split()) or type(exc).__name__


class Runtime:
    def __init__(self, settings: ServeSettings, model_dir: Path, model_name: str,
                 lock: Optional[LedgerLock] = None, policy: Optional[AccessPolicy] = None,
                 models: Optional[list[ModelEntry]] = None) -> None:
        """`model_dir`/`model_name`: the default model; `models`: every served model, the default
        first (server.serving.model_catalog; default: that one alone)."""
        self.settings = settings
        self.lock = lock  # the ledger's exclusive lock, when taken before start (serve.run)
        self.model_dir = model_dir
        self.model_name = model_name
        self.entries = models or [ModelEntry(model_name, model_dir, "MODEL")]
        # LoRA adapters (--lora) go over the default model: a request names one as its `model`,
        # and the pool routes it to the default model's lane with that adapter.
        self.names = ModelNames(model_name, [n for n, _ in settings.lora])
        self.ledger: Optional[Ledger] = None
        self.pool: Optional[ModelPool] = None  # the served models' lanes (set in start)
        self.service: Optional[RequestService] = None
        # Who may do what, and how much (server.gateway.policy.Gateway in a server; None: no
        # keys, no quotas). Started once the ledger is open, closed after it.
        self.policy = policy
        self.metrics: Metrics
        self._drain_hooks: list[Callable[[], Awaitable[None]]] = []
        self._fatal_hooks: list[Callable[[str], None]] = []
        self._drained = False
        self._closed = False

    # The default model's parts (the one model of a single-model server); another model's are
    # its lane's (`pool.route(name).lane`).
    @property
    def default_lane(self) -> Optional[ModelLane]:
        return self.pool.default if self.pool is not None else None

    @property
    def tokenizer(self) -> Optional[Tokenizer]:
        return self.pool.default.tokenizer if self.pool is not None else None

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        return self.pool.default.sampling_defaults if self.pool is not None else {}

    @property
    def reasoning(self) -> Optional[ReasoningFormat]:
        return self.pool.default.reasoning if self.pool is not None else None

    @property
    def pooler(self) -> Optional[Pooler]:
        return self.pool.default.pooler if self.pool is not None else None

    @property
    def bridge(self) -> Optional[EngineBridge]:
        return self.pool.default.bridge if self.pool is not None else None

    @property
    def admission(self) -> Optional[AdmissionQueue[Any]]:
        return self.pool.default.admission if self.pool is not None else None

    @property
    def closed(self) -> bool:
        """close() has run: every part is stopped and the ledger is closed."""
        return self._closed

    @property
    def stopping(self) -> bool:
        return self.service is not None and self.service.draining

    def on_drain(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run `hook` at the end of `drain()`, after every request has ended and its row is terminal."""
        self._drain_hooks.append(hook)

    def on_fatal(self, hook: Callable[[str], None]) -> None:
        """Call `hook(one-line reason)` on the loop if the model fails to load: the process that
        serves it exits non-zero (server.serve) rather than answer 503 forever."""
        self._fatal_hooks.append(hook)

    async def start(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        if s.db_target.is_postgres:  # shared by replicas (server.serving.ledger_pg)
            from server.serving.ledger_pg import PgLedger

            assert s.db_target.url is not None
            self.ledger = await PgLedger.open(s.db_target.url, name=f"{s.host}:{s.port} pid {os.getpid()}",
                                              lease_s=s.instance_lease)
            log.info("ledger: %s as replica %s (%d request(s) of lapsed replicas marked interrupted)",
                     s.db_target.display(), self.ledger.instance_id, self.ledger.interrupted_at_start)
        else:
            self.ledger = await Ledger.open(s.db_path, lock=self.lock)
            log.info("ledger: %s (%d request(s) marked interrupted from the previous run)",
                     s.db_path, self.ledger.interrupted_at_start)
        if self.policy is not None:
            await self.policy.start(self.ledger)
        lanes: list[ModelLane] = []
        for entry in self.entries:  # tokenizers and configs (torch-free); weights load on demand
            lanes.append(await loop.run_in_executor(None, open_lane, s, entry))
        for lane in lanes:
            if lane.pooler is not None:
                log.info("model %s: task embed (%s pooling%s, from %s)", lane.name, lane.pooler.method.value,
                         ", normalised" if lane.pooler.normalize else "", lane.pooler.source)
            log.info("model %s: %s; default sampling values from the model: %s", lane.name, lane.entry.path,
                     lane.sampling_defaults or "none (pagewire's own defaults apply)")
        self.pool = pool = ModelPool(s, lanes, self._dispatch)
        for name, base in self.names.all():
            if base is not None:
                pool.add_alias(name, base, name)
        if len(lanes) > 1:
            log.info("models: %s; memory budget %.2f GiB (%s)", ", ".join(lane.name for lane in lanes),
                     pool.budget / 2**30, "--memory-budget" if s.memory_budget else "90% of available memory")
        for lane in lanes:
            lane.admission.submit_to(self._submit)
        self.metrics = Metrics(lambda: pool.default.bridge.stats() if pool.default.bridge is not None else None,
                               pool.queued)
        self.metrics.registry.register(ModelCollector(pool))
        self.service = RequestService(
            pool, self.ledger, StreamRegistry(s.stream_retention, s.stream_retention_bytes), self.metrics,
            s.request_timeout if s.request_timeout > 0 else None,
            OutputBudget(s.max_output_bytes, s.max_client_output_bytes),
            quotas=self.policy.quotas if self.policy is not None else None, ledger_text=s.ledger_text,
        )
        pool.on_load_failed = self.service.fail_queued
        self.metrics.add_gauges(self.service.memory_gauges)
        self.metrics.add_gauges(lambda: router_gauges(pool.default.bridge.stats() if pool.default.bridge else None))
        # The default model's engine thread starts now (the others' on demand); ready once it has loaded.
        loop.create_task(self._report_ready(pool.start_loading(pool.default)))

    # Indirections so the bridge and admission can be built before the service exists.
    def _dispatch(self, deltas: list[Any]) -> None:
        assert self.service is not None
        self.service.on_step(deltas)

    def _submit(self, job: Any) -> None:
        assert self.service is not None
        self.service.submit(job)

    def start_failed(self, exc: BaseException) -> bool:
        """`start()` raised: hand the one-line reason to the fatal hooks (the serving process exits
        with it; the traceback only at debug level). False when there is no hook to tell."""
        log.debug("start-up failed", exc_info=exc)
        return self._fatal(f"start-up failed: {one_line(exc)}")

    def _fatal(self, reason: str) -> bool:
        for hook in self._fatal_hooks:
            hook(reason)
        return bool(self._fatal_hooks)

    async def _report_ready(self, loading: Awaitable[None]) -> None:
        """Wait for the default model's load (the others load on demand); ready once it has."""
        assert self.pool is not None and self.service is not None
        lane = self.pool.default
        await loading
        if lane.state is LaneState.LOADING:  # no engine thread was started (the edge's torch-free tests)
            return
        if not lane.ready:
            # The traceback is logged at debug level by the engine thread.
            err = lane.load_error or "unknown error"
            reason = err.split(" failed to load: ", 1)[-1]
            self.service.start_error = reason
            if not self._fatal(f"model failed to load: {reason}"):
                log.error("model failed to load: %s", reason)  # in-process: keep answering 503
        else:
            self.service.started = True
            log.info("model loaded: %s (max_model_len %d); ready", self.model_name, lane.max_model_len)

    async def drain(self) -> None:
        """Stage one of shutdown. Idempotent."""
        if self._drained or self.service is None:
            return
        self._drained = True
        log.info("shutting down: no new requests; up to %.1fs for in-flight ones", self.settings.shutdown_grace)
        await self.service.drain(self.settings.shutdown_grace)
        for hook in self._drain_hooks:
            await hook()

    async def close(self) -> None:
        """Stage two: stop the engine and close the ledger. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self.drain()
        if self.pool is not None:
            await self.pool.close()
        # The policy's keys connection first: the ledger's close releases the lock, whose
        # descriptor on the database file must outlive every SQLite connection of this process
        # (db_lock).
        if self.policy is not None:
            self.policy.close()
        if self.ledger is not None:
            await self.ledger.close()
