"""Runtime: the one object that owns a serving process's parts and their start/stop order.

Start (ASGI lifespan, before the socket accepts): open the ledger (which turns rows a previous
process left open into `interrupted`), load the tokenizer, wire admission/streams/metrics/service,
and start the engine thread, which loads the weights in the background (/health is 503 until then).

Stop, in two stages (see `server.serving.serve`): `drain()` stops accepting, gives in-flight requests the
grace period, interrupts the rest, makes every ledger row terminal, then runs the drain hooks that
the edges registered (the WebSocket endpoint closes its sockets with 1001 after flushing their
final frames); `close()` stops the engine thread and the ledger.

The Runtime knows nothing of the API layer (HTTP, WebSocket, OpenAI shapes): the edges import it,
never the other way round.
"""
from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from server.gateway import redact
from server.gateway.auth import Authenticator, read_admin_key
from server.gateway.quotas import QuotaBook
from server.gateway.usage import daily_usage, recent_usage
from server.models.generation_defaults import generation_defaults
from server.serving.admission import AdmissionQueue
from server.serving.bridge import EngineBridge
from server.serving.db_lock import LedgerLock
from server.serving.jobs import Job
from server.serving.ledger import Ledger
from server.serving.metrics import Metrics
from server.serving.output_budget import OutputBudget
from server.serving.prompts import PromptPreparer
from server.serving.service import RequestService
from server.serving.settings import ServeSettings
from server.serving.streams import StreamRegistry
from server.text.tokenizer import Tokenizer

log = logging.getLogger("pagewire")


class Runtime:
    def __init__(self, settings: ServeSettings, model_dir: Path, model_name: str,
                 lock: Optional[LedgerLock] = None) -> None:
        self.settings = settings
        self.lock = lock  # the ledger's exclusive lock, when taken before start (serve.run)
        self.model_dir = model_dir
        self.model_name = model_name
        self.ledger: Optional[Ledger] = None
        self.tokenizer: Optional[Tokenizer] = None
        self.sampling_defaults: dict[str, Any] = {}
        self.bridge: Optional[EngineBridge] = None
        self.service: Optional[RequestService] = None
        self.admission: Optional[AdmissionQueue[Job]] = None
        self.auth: Optional[Authenticator] = None  # server.gateway.auth; set in start()
        self.quotas: Optional[QuotaBook] = None
        self._keys_conn: Optional[sqlite3.Connection] = None
        self.metrics: Metrics
        self._drain_hooks: list[Callable[[], Awaitable[None]]] = []
        self._drained = False
        self._closed = False

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

    async def start(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        self.ledger = await Ledger.open(s.db_path, lock=self.lock)
        log.info("ledger: %s (%d request(s) marked interrupted from the previous run)",
                 s.db_path, self.ledger.interrupted_at_start)
        redact.install()  # before any request can log a header
        # The gateway's key cache reads the api_keys table through its own small connection
        # (used on the loop only; the ledger migrated the schema above).
        self._keys_conn = sqlite3.connect(str(s.db_path), check_same_thread=False, isolation_level=None)
        self._keys_conn.execute("PRAGMA busy_timeout=1000")
        admin = read_admin_key(s.admin_key_file) if s.admin_key_file else None
        self.auth = Authenticator(self._keys_conn, s.auth, admin, s.insecure_no_auth)
        self.quotas = QuotaBook(self.auth.limits_of)
        day = QuotaBook.day_of(self.quotas.clock())
        self.quotas.load_daily(await daily_usage(self.ledger, day), day)
        self.quotas.load_window(await recent_usage(self.ledger, self.quotas.clock() - 60.0))
        log.info("auth: %s (%s)", "required" if self.auth.required else "off",
                 f"mode {s.auth}" + (", admin key set" if admin else ""))
        self.tokenizer = await loop.run_in_executor(None, Tokenizer.load, self.model_dir)
        self.sampling_defaults = await loop.run_in_executor(None, generation_defaults, self.model_dir)
        log.info("model: %s; default sampling values from the model: %s", self.model_dir,
                 self.sampling_defaults or "none (pagewire's own defaults apply)")
        self.bridge = EngineBridge(s.engine_config(str(self.model_dir)), self._dispatch)
        self.admission = AdmissionQueue(
            max_queued=s.max_queue,
            max_queued_per_client=s.max_queue_per_client or s.max_queue,
            max_in_engine=s.in_engine_limit,
            submit=self._submit,
        )
        self.metrics = Metrics(self.bridge.stats, lambda: self.admission.queued if self.admission else 0)
        self.service = RequestService(
            self.bridge, self.ledger, self.admission, StreamRegistry(s.stream_retention, s.stream_retention_bytes),
            PromptPreparer(self.tokenizer, s.offload_chars, self.sampling_defaults,
                           grammar_timeout_s=s.grammar_compile_timeout), self.metrics,
            s.request_timeout if s.request_timeout > 0 else None,
            OutputBudget(s.max_output_bytes, s.max_client_output_bytes),
            quotas=self.quotas, ledger_text=s.ledger_text,
        )
        self.metrics.add_gauges(self.service.memory_gauges)
        self.bridge.start()
        loop.create_task(self._report_ready())

    # Indirections so the bridge and admission can be built before the service exists.
    def _dispatch(self, deltas: list[Any]) -> None:
        assert self.service is not None
        self.service.on_step(deltas)

    def _submit(self, job: Job) -> None:
        assert self.service is not None
        self.service.submit(job)

    async def _report_ready(self) -> None:
        assert self.bridge is not None
        while not self.bridge.ready and self.bridge.error is None:
            await asyncio.sleep(0.05)
        if self.bridge.error is not None:
            log.error("model failed to load: %s", self.bridge.error)
        else:
            log.info("model loaded: %s (max_model_len %d); ready", self.model_name, self.bridge.max_model_len)

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
        if self.bridge is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.bridge.shutdown, 5.0)
        # The keys connection first: the ledger's close releases the lock, whose descriptor on
        # the database file must outlive every SQLite connection of this process (db_lock).
        if self._keys_conn is not None:
            self._keys_conn.close()
        if self.ledger is not None:
            await self.ledger.close()
