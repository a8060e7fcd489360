"""The bridge between the event loop and the engine thread: one hop per engine step, each way safe.

Inbound (loop → engine): `submit` and `abort` are thread-safe, non-blocking calls on the engine
thread's inbox; the engine acts on them at its next step boundary.

Outbound (engine → loop): the engine calls `on_step(deltas)` on its own thread once per step.
The bridge schedules exactly ONE `loop.call_soon_threadsafe(dispatch, deltas)` for that step,
never one per token or per request, so the loop's wakeups scale with steps, not tokens. The
list is handed over whole and never touched again by the engine thread, so no lock is needed.
Steps are dispatched in the order the engine produced them (call_soon_threadsafe is FIFO).

The engine module (and torch) is imported only in `start()`, so importing the edge stays cheap.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable, ContextManager, Optional

from server.engine.config import EngineConfig
from server.engine.outputs import RequestDelta
from server.engine.sampling_params import SamplingParams
from server.models.load_progress import LoadProgress

if TYPE_CHECKING:  # imported in start(), not at import time (it loads torch)
    from server.engine.engine import EngineStats
    from server.engine.thread import EngineThread

log = logging.getLogger("pagewire.bridge")


class EngineBridge:
    """Owns the EngineThread for the server. Create and start on the event loop.

    Args:
        config: the engine's knobs.
        dispatch: called on the event loop with each step's deltas, in step order.
    """

    def __init__(self, config: EngineConfig, dispatch: Callable[[list[RequestDelta]], None],
                 gate: Optional[ContextManager[object]] = None, name: str = "pagewire-engine",
                 progress: Optional[LoadProgress] = None) -> None:
        self.config = config
        self._dispatch = dispatch
        self._gate = gate  # shared by the engines of several models (server.engine.step_gate)
        self._name = name
        self.progress = progress  # the load's stages (server.models.load_progress)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._engine: Optional[EngineThread] = None
        self.steps_posted = 0  # count of call_soon_threadsafe hops (one per non-empty step)

    def start(self) -> None:
        """Start the engine thread; it loads the weights in the background (see `ready`)."""
        from server.engine.thread import EngineThread  # lazy: it imports torch; the edge's imports stay without

        self._loop = asyncio.get_running_loop()
        self._engine = EngineThread(self.config, self._on_step, self._gate, self._name, self.progress)
        self._engine.start()

    # Runs on the ENGINE thread.
    def _on_step(self, deltas: list[RequestDelta]) -> None:
        if not deltas:
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        self.steps_posted += 1
        try:
            loop.call_soon_threadsafe(self._dispatch_safe, deltas)
        except RuntimeError:  # the loop closed between the check and the call (process exit)
            pass

    def _dispatch_safe(self, deltas: list[RequestDelta]) -> None:
        try:
            self._dispatch(deltas)
        except Exception:  # one bad delta must not stop every other stream
            log.exception("dispatching engine step failed")

    # -- state ------------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._engine is not None

    @property
    def ready(self) -> bool:
        return self._engine is not None and self._engine.ready

    @property
    def error(self) -> Optional[BaseException]:
        return self._engine.error if self._engine is not None else None

    def wait_ready(self, timeout: Optional[float] = None) -> bool:
        """Block until the engine has loaded or failed (call via run_in_executor)."""
        return self._engine is not None and self._engine.wait_ready(timeout)

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len if self._engine is not None else 0

    def stats(self) -> Optional[EngineStats]:
        return self._engine.stats() if self._engine is not None else None

    # -- requests (thread-safe; called from the loop) --------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
               lora: Optional[str] = None) -> None:
        if self._engine is None:
            raise RuntimeError("the engine bridge has not started")
        self._engine.submit(request_id, prompt_token_ids, params, priority=priority, lora=lora)

    def abort(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.abort(request_id)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine thread (blocking up to `timeout`; call via run_in_executor)."""
        if self._engine is not None:
            self._engine.shutdown(timeout)
