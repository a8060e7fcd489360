"""EngineThread: runs one LLMEngine on a dedicated thread behind a thread-safe inbox.

Inputs are messages (add, abort) put on the inbox from any thread; the engine thread drains the
inbox only at step boundaries, so an abort takes effect before the next forward and nothing is
freed under a running kernel. Output is one `on_step(deltas)` call per step, made on the engine
thread; the server's bridge turns that into exactly one event-loop callback.

The thread never busy-waits: with no unfinished request it blocks on `_wake`, which every submit,
abort and shutdown sets. Nothing else stops it stepping while requests are unfinished: it never
waits on the event loop or on a client (`on_step` only posts one callback), and after a step that
could schedule nothing (a liveness bug, defensively) it steps again after a short wait.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Optional

from server.engine.config import EngineConfig
from server.engine.errors import CapacityLimits, check_capacity
from server.engine.outputs import FinishReason, RequestDelta, SampleDelta
from server.engine.sampling_params import SamplingParams
from server.models import load_progress
from server.models.load_progress import LoadProgress

if TYPE_CHECKING:  # the engine (and torch) load on the engine thread, not at import
    from server.engine.engine import EngineStats, LLMEngine

logger = logging.getLogger("pagewire.engine")

# How long the thread waits before stepping again after a step that scheduled nothing.
NO_PROGRESS_RETRY_S = 0.05


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    lora: Optional[str] = None


@dataclass(slots=True)
class _Abort:
    request_id: str


class EngineThread:
    """Owns the engine on its thread. Every public method is safe to call from any thread."""

    def __init__(self, config: EngineConfig, on_step: Callable[[list[RequestDelta]], None],
                 gate: Optional[ContextManager[object]] = None, name: str = "pagewire-engine",
                 progress: Optional[LoadProgress] = None) -> None:
        """`gate`: held around each step when several engines share the CPU (step_gate.StepGate);
        `progress`: where the model's load reports its stages (server.models.load_progress)."""
        self.progress = progress
        self.config = config
        self._on_step = on_step
        self._gate: ContextManager[object] = gate if gate is not None else contextlib.nullcontext()
        self._inbox: deque[_Add | _Abort] = deque()  # deque append/popleft are atomic
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: Optional[BaseException] = None
        self.max_model_len: int = 0
        self.vocab_size: int = 0
        self.limits: Optional[CapacityLimits] = None  # set once the engine has loaded
        self._engine: Optional[LLMEngine] = None
        self._stats: Optional[EngineStats] = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.error is None

    def wait_ready(self, timeout: Optional[float] = None) -> bool:
        self._ready.wait(timeout)
        return self.ready

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop after the current step; unfinished requests get abort deltas. Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- requests ---------------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: Optional[float] = None,
        lora: Optional[str] = None,
    ) -> None:
        """Queue a request for the next step boundary (with LoRA adapter `lora`, None: the base
        model). Raises ValueError at once if it can't fit (context, n, or KV blocks: see
        errors.check_capacity)."""
        if self._stop.is_set():
            raise RuntimeError("engine is shutting down")
        if self.limits is not None:
            check_capacity(len(prompt_token_ids), params.max_tokens, params.n, self.limits)
        self._inbox.append(
            _Add(request_id, list(prompt_token_ids), params, priority, arrival_time or time.time(), lora)
        )
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.append(_Abort(request_id))
        self._wake.set()

    def stats(self) -> Optional[EngineStats]:
        """The snapshot taken at the end of the latest step (replaced atomically, never mutated)."""
        return self._stats

    # -- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        # Shutdown signals are the main thread's business (serve.py). Blocking them here, before
        # torch starts its intra-op workers (which inherit this mask), means SIGTERM can never
        # land on the engine or an OpenMP worker mid-step and interrupt one of its system calls.
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            with load_progress.reporting(self.progress):
                # The first load's import of torch and the kernels takes seconds of its own.
                load_progress.stage("import torch and kernels")
                from server.engine.engine import LLMEngine

                engine = LLMEngine(self.config)
        except BaseException as e:  # reported through .error (the server exits with it, one line)
            logger.debug("engine failed to load", exc_info=True)
            self.error = e
            self._ready.set()
            return
        self._engine = engine
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.limits = engine.limits
        self._stats = engine.stats()
        self._ready.set()
        # The step's thread modes (inference mode, batch-invariant mode, the autotune table) held
        # for the whole loop: the steps then enter nothing (LLMEngine.step_modes says why). Every
        # tensor the loop makes stays on this thread.
        with engine.step_modes():
            self._serve(engine)
        self._on_step_safe(engine.abort_all())

    def _serve(self, engine: LLMEngine) -> None:
        """Step while requests are unfinished, block (no polling) while idle, until shutdown."""
        stalled = False  # the previous step scheduled nothing (logged once per episode)
        while not self._stop.is_set():
            # Clear before draining: a message put after this point sets _wake again, so the
            # wait below returns at once instead of sleeping on work already queued.
            self._wake.clear()
            extra = self._drain(engine)
            if not engine.has_unfinished_requests():
                if extra:
                    self._on_step_safe(extra)
                    continue
                self._wake.wait()
                continue
            try:
                with self._gate:
                    deltas = extra + engine.step()
                progressed = engine.last_step_progressed
            except Exception as e:  # a failed step fails its requests, the server keeps serving
                logger.exception("engine step failed")
                deltas = extra + engine.fail_all(f"engine error: {e}")
                progressed = True
            self._stats = engine.stats()
            if deltas:
                # Nothing may end this loop but shutdown: a dead engine thread would freeze every
                # stream (and a graceful drain would wait out its whole grace for nothing).
                try:
                    self._on_step(deltas)
                except Exception:
                    logger.exception("on_step callback failed")
            if not progressed:
                # Unreachable while add_request refuses what can never run (tests/engine/
                # test_liveness.py). Should it happen, step again after a short wait rather than
                # wait for the next message: an indefinite wait here would freeze every running
                # stream until something else arrived, and a graceful drain admits nothing new,
                # so it would only end with the grace period.
                if not stalled:
                    logger.error("engine step scheduled nothing with %d requests pending; retrying",
                                 len(engine.requests))
                stalled = True
                self._wake.wait(NO_PROGRESS_RETRY_S)
            else:
                stalled = False

    def _drain(self, engine: LLMEngine) -> list[RequestDelta]:
        """Apply inbox messages; returns error deltas for adds the engine refused."""
        errors: list[RequestDelta] = []
        while self._inbox:
            msg = self._inbox.popleft()
            if isinstance(msg, _Abort):
                engine.abort_request(msg.request_id)
                continue
            try:
                engine.add_request(
                    msg.request_id, msg.prompt_token_ids, msg.params, msg.priority, msg.arrival_time, msg.lora
                )
            except Exception as e:  # noqa: BLE001 - refused or broken, the request fails alone
                errors.append(_error_delta(msg.request_id, len(msg.prompt_token_ids), msg.arrival_time, str(e)))
        return errors

    def _on_step_safe(self, deltas: list[RequestDelta]) -> None:
        if deltas:
            try:
                self._on_step(deltas)
            except Exception:
                logger.exception("on_step callback failed during shutdown")


def _error_delta(request_id: str, n_prompt: int, arrival: float, message: str) -> RequestDelta:
    return RequestDelta(
        request_id=request_id,
        samples=[SampleDelta(index=0, token_ids=[], text="", finish_reason=FinishReason.ERROR)],
        finished=True,
        num_prompt_tokens=n_prompt,
        num_cached_tokens=0,
        arrival_time=arrival,
        finished_time=time.time(),
        error=message,
    )
