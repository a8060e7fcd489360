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

from server.models.generation_defaults import generation_defaults
from server.models.pooling import Pooler, resolve_pooler
from server.models.registry import read_model_config
from server.serving.access import AccessPolicy
from server.serving.admission import AdmissionQueue
from server.serving.bridge import EngineBridge
from server.serving.db_lock import LedgerLock
from server.serving.jobs import Job
from server.serving.ledger import Ledger
from server.serving.metrics import Metrics
from server.serving.model_names import ModelNames
from server.serving.output_budget import OutputBudget
from server.serving.prompts import PromptPreparer
from server.serving.router_view import router_gauges
from server.serving.service import RequestService
from server.serving.settings import ServeSettings
from server.serving.streams import StreamRegistry
from server.text.loader import load_tokenizer
from server.text.reasoning import ReasoningFormat, detect_reasoning_parser, reasoning_format
from server.text.tokenizer import ChatTemplateError, Tokenizer

log = logging.getLogger("pagewire")


def _encoder(tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def pick_reasoning_format(tokenizer: Tokenizer, name: str) -> Optional[ReasoningFormat]:
    """The reasoning parser (`--reasoning-parser`): the one named, or with `auto` the one the chat
    template implies. A named parser whose tags are not single tokens is a start-up error (a
    ValueError naming the option); `auto` then serves without one."""
    if name == "none":
        return None
    if name == "auto":
        try:
            source: Optional[str] = tokenizer.template_source()
        except ChatTemplateError:
            source = None
        detected = detect_reasoning_parser(source)
        if detected is None:
            return None
        try:
            fmt = reasoning_format(detected, tokenizer.token_to_id, _encoder(tokenizer))
        except ValueError as e:
            log.info("reasoning parser: none (the template looks like %s, but %s)", detected, e)
            return None
        log.info("reasoning parser: %s (from the chat template)", fmt.parser)
        return fmt
    try:
        fmt = reasoning_format(name, tokenizer.token_to_id, _encoder(tokenizer))
    except ValueError as e:
        raise ValueError(f"--reasoning-parser {name}: {e}") from None
    log.info("reasoning parser: %s (--reasoning-parser)", fmt.parser)
    return fmt


def one_line(exc: BaseException) -> str:
    """An exception's text on one line (whitespace folded), or its type when it has none."""
    return " ".join(str(exc).split()) or type(exc).__name__


class Runtime:
    def __init__(self, settings: ServeSettings, model_dir: Path, model_name: str,
                 lock: Optional[LedgerLock] = None, policy: Optional[AccessPolicy] = None) -> None:
        self.settings = settings
        self.lock = lock  # the ledger's exclusive lock, when taken before start (serve.run)
        self.model_dir = model_dir
        self.model_name = model_name
        # What a request's `model` may name: this model, or a LoRA adapter over it (--lora).
        self.names = ModelNames(model_name, [n for n, _ in settings.lora])
        self.ledger: Optional[Ledger] = None
        self.tokenizer: Optional[Tokenizer] = None
        self.sampling_defaults: dict[str, Any] = {}
        self.reasoning: Optional[ReasoningFormat] = None  # the reasoning parser in use (set in start)
        # An embedding model's pooling recipe (set in start; None: a generation model), --task.
        self.pooler: Optional[Pooler] = None
        self.bridge: Optional[EngineBridge] = None
        self.service: Optional[RequestService] = None
        self.admission: Optional[AdmissionQueue[Job]] = None
        # Who may do what, and how much (server.gateway.policy.Gateway in a server; None: no
        # keys, no quotas). Started once the ledger is open, closed after it.
        self.policy = policy
        self.metrics: Metrics
        self._drain_hooks: list[Callable[[], Awaitable[None]]] = []
        self._fatal_hooks: list[Callable[[str], None]] = []
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
        self.tokenizer = await loop.run_in_executor(None, load_tokenizer, self.model_dir)
        self.sampling_defaults = await loop.run_in_executor(None, generation_defaults, self.model_dir)
        self.reasoning = pick_reasoning_format(self.tokenizer, s.reasoning_parser)
        # The engine reads the same recipe; read here too (torch-free) so that requests for the
        # other task are refused before they are queued.
        self.pooler = await loop.run_in_executor(None, resolve_pooler, s.task, self.model_dir)
        width: Optional[int] = None
        if self.pooler is not None:
            width = (await loop.run_in_executor(None, read_model_config, self.model_dir)).hidden_size
            log.info("task: embed (%s pooling%s, from %s)", self.pooler.method.value,
                     ", normalised" if self.pooler.normalize else "", self.pooler.source)
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
            quotas=self.policy.quotas if self.policy is not None else None, ledger_text=s.ledger_text,
            reasoning=self.reasoning, embedding_width=width,
        )
        self.metrics.add_gauges(self.service.memory_gauges)
        bridge = self.bridge
        self.metrics.add_gauges(lambda: router_gauges(bridge.stats()))
        self.bridge.start()
        loop.create_task(self._report_ready())

    # Indirections so the bridge and admission can be built before the service exists.
    def _dispatch(self, deltas: list[Any]) -> None:
        assert self.service is not None
        self.service.on_step(deltas)

    def _submit(self, job: Job) -> None:
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

    async def _report_ready(self) -> None:
        assert self.bridge is not None
        while not self.bridge.ready and self.bridge.error is None:
            await asyncio.sleep(0.05)
        if self.bridge.error is not None:
            # The traceback is logged at debug level by the engine thread.
            if not self._fatal(f"model failed to load: {one_line(self.bridge.error)}"):
                log.error("model failed to load: %s", self.bridge.error)  # in-process: keep answering 503
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
        # The policy's keys connection first: the ledger's close releases the lock, whose
        # descriptor on the database file must outlive every SQLite connection of this process
        # (db_lock).
        if self.policy is not None:
            self.policy.close()
        if self.ledger is not None:
            await self.ledger.close()
