"""ModelPool: which declared models are loaded, within one memory budget, loaded on demand.

Every declared model has a ModelLane (server.serving.model_lane). The pool owns their loads and
unloads, all on the event loop:

* `want(lane)`: a request for the lane was accepted (the service calls it after `hold`). An
  unloaded lane starts loading; the request waits in the lane's paused admission queue, so its
  TTFT includes the load, and it is never refused for being unloaded.
* The budget (`--memory-budget`, default 90 % of MemAvailable at start) counts each loaded or
  loading lane's footprint: weights + activations + KV pool, as `pagewire plan` computes them.
  A load that would exceed it first unloads the least recently used idle lane (no live request:
  queued, running or streaming), and waits for one to become idle when none is. A lane with a
  live request is never unloaded.
* Keep-alive: an idle lane unloads after its keep_alive (a request's Ollama `keep_alive`, else
  `--keep-alive`; negative: only when its memory is needed; 0: as soon as it is idle).
* A load that fails ends the requests waiting for it (`on_load_failed`) and leaves the lane
  unloaded: the next request tries again.
* Adapters (LoRA, `--lora`: over the default model) and other aliases: `add_alias(name, base,
  adapter)` makes `name` route to the base model's lane with that adapter (`Route.adapter`); the
  service puts it on the request's spec (`GenerationSpec.lora`).

One engine thread per loaded lane; they share the CPU through one StepGate (server.engine.step_gate).
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

from server import heap
from server.engine.step_gate import StepGate
from server.models.load_progress import LoadProgress
from server.serving.bridge import EngineBridge
from server.serving.model_lane import LaneState, ModelLane
from server.serving.settings import ServeSettings

log = logging.getLogger("pagewire")


PROGRESS_LOG_S = 5.0  # without a terminal: a log line this often while a model loads
PROGRESS_TTY_S = 0.25  # on a terminal: the bar's redraw interval


def _bar(p: LoadProgress, width: int = 24) -> str:
    if not p.total_bytes:
        return ""
    frac = min(1.0, p.done_bytes / p.total_bytes)
    return "[" + "#" * int(frac * width) + "." * (width - int(frac * width)) + f"] {frac * 100:3.0f}% "


async def report_progress(name: str, p: LoadProgress, done: asyncio.Event) -> None:
    """Show a load's stages until `done`: on a terminal a bar per stage (bytes and time), redrawn
    in place, a finished stage left on its own line; otherwise a log line every PROGRESS_LOG_S."""
    tty = sys.stderr.isatty()
    shown = 0
    while not done.is_set():
        try:
            await asyncio.wait_for(done.wait(), PROGRESS_TTY_S if tty else PROGRESS_LOG_S)
        except asyncio.TimeoutError:
            pass
        if tty:
            for stage, n, secs in p.finished[shown:]:
                size = f" {n / 2**20:.1f} MiB," if n else ""
                sys.stderr.write(f"\r\x1b[K{name}: {stage}{size} {secs:.1f} s\n")
            shown = len(p.finished)
            if not done.is_set() and p.stage is not None:
                sys.stderr.write(f"\r\x1b[K{name}: {_bar(p)}{p.describe()}")
            sys.stderr.flush()
        elif not done.is_set():
            log.info("model %s: loading: %s (%.0f s so far)", name, p.describe(), time.monotonic() - p.started)
    if tty:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()


@dataclass(frozen=True)
class Route:
    """Where a request's `model` name goes: a lane, and an adapter on it (None: the base model)."""

    lane: ModelLane
    adapter: Optional[str] = None


def available_memory() -> Optional[int]:
    """MemAvailable from /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_budget(lanes: list[ModelLane]) -> int:
    """90 % of the memory available now, or the largest model's footprint if that is more."""
    avail = available_memory()
    largest = max((lane.footprint for lane in lanes), default=0)
    return max(int(avail * 0.9), largest) if avail is not None else max(largest, 1) * len(lanes)


class ModelPool:
    def __init__(self, settings: ServeSettings, lanes: list[ModelLane],
                 dispatch: Callable[[list[Any]], None]) -> None:
        self.settings = settings
        self.lanes: dict[str, ModelLane] = {lane.name: lane for lane in lanes}
        self.default = lanes[0]
        self.budget = settings.memory_budget or default_budget(lanes)
        self._dispatch = dispatch
        self.gate = StepGate()
        self._aliases: dict[str, Route] = {}
        self._changed = asyncio.Event()  # a lane became idle or unloaded: a waiting load re-checks
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.closing = False
        # Set by the Runtime: end a lane's waiting requests after a failed load; observe a load.
        self.on_load_failed: Callable[[ModelLane, str], None] = lambda lane, msg: None
        self.on_loaded: Callable[[ModelLane, float], None] = lambda lane, seconds: None
        self.on_unloaded: Callable[[ModelLane], None] = lambda lane: None
        too_big = [lane for lane in lanes if lane.footprint > self.budget]
        if too_big:
            lane = too_big[0]
            raise ValueError(f"--memory-budget {self.budget} bytes does not hold model {lane.name!r} alone "
                             f"({lane.footprint} bytes of weights, activations and KV pool; see `pagewire plan`)")

    # -- names ------------------------------------------------------------------------------------
    def add_alias(self, name: str, base: str, adapter: Optional[str] = None) -> None:
        """Route `name` to `base`'s lane with `adapter` (a LoRA adapter's name, as the lane knows it)."""
        if name in self.lanes or name in self._aliases:
            raise ValueError(f"model name {name!r} is declared twice; names must be unique")
        self._aliases[name] = Route(self.lanes[base], adapter)

    def route(self, name: Optional[str]) -> Optional[Route]:
        """The lane (and adapter) `name` selects; the default model for None; None when unknown."""
        if name is None:
            return Route(self.default)
        lane = self.lanes.get(name)
        if lane is not None:
            return Route(lane)
        return self._aliases.get(name)

    def names(self) -> list[str]:
        return [*self.lanes, *self._aliases]

    # -- memory -----------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return sum(lane.footprint for lane in self.lanes.values() if lane.reserved)

    def _victim(self, for_lane: ModelLane) -> Optional[ModelLane]:
        idle = [lane for lane in self.lanes.values()
                if lane is not for_lane and lane.state is LaneState.LOADED and lane.live == 0]
        return min(idle, key=lambda lane: lane.last_used) if idle else None

    # -- requests ---------------------------------------------------------------------------------
    def hold(self, lane: ModelLane, keep_alive_s: Optional[float] = None) -> None:
        """A request for `lane` was accepted: it stays loaded until the request ends, then for
        the request's `keep_alive_s` (None: --keep-alive), as Ollama's latest request sets it."""
        lane.keep_alive_s = keep_alive_s
        lane.live += 1
        lane.last_used = time.monotonic()
        lane.expires_at = None
        timer = self._timers.pop(lane.name, None)
        if timer is not None:
            timer.cancel()

    def release(self, lane: ModelLane) -> None:
        """A request for `lane` ended."""
        lane.live -= 1
        lane.last_used = time.monotonic()
        if lane.live == 0:
            self._changed.set()
            self._schedule_expiry(lane)

    def set_keep_alive(self, lane: ModelLane, seconds: Optional[float]) -> None:
        """An Ollama load-only request's keep_alive: how long `lane` stays loaded once idle."""
        lane.keep_alive_s = seconds
        if lane.live == 0:
            self._schedule_expiry(lane)

    def _schedule_expiry(self, lane: ModelLane) -> None:
        timer = self._timers.pop(lane.name, None)
        if timer is not None:
            timer.cancel()
        keep = lane.keep_alive_s if lane.keep_alive_s is not None else self.settings.keep_alive
        if keep < 0 or lane.state is not LaneState.LOADED or self.closing:
            lane.expires_at = None
            return
        lane.expires_at = time.time() + keep
        self._timers[lane.name] = asyncio.get_running_loop().call_later(keep, self._expire, lane)

    def _expire(self, lane: ModelLane) -> None:
        self._timers.pop(lane.name, None)
        if lane.live == 0 and lane.state is LaneState.LOADED:
            log.info("model %s: idle past its keep_alive; unloading", lane.name)
            self._spawn(self._unload(lane))

    def want(self, lane: ModelLane) -> None:
        """Make sure `lane` is loaded or loading (its admission queue opens once it is)."""
        if lane.state is LaneState.UNLOADED and not self.closing:
            lane.state = LaneState.LOADING
            self._spawn(self._load(lane))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- loading ----------------------------------------------------------------------------------
    def start_loading(self, lane: ModelLane) -> Awaitable[None]:
        """Start loading `lane` now, its engine thread started before this returns (start-up's
        default model, which fits the empty budget); await the result for the load's end."""
        assert lane.state is LaneState.UNLOADED and self.used + lane.footprint <= self.budget
        lane.state = LaneState.LOADING
        return self._finish_load(lane, self._start_engine(lane), time.monotonic())

    async def _load(self, lane: ModelLane) -> None:
        t0 = time.monotonic()
        lane.stage = "waiting for memory"
        while self.used + lane.footprint > self.budget:
            victim = self._victim(lane)
            if victim is not None:
                log.info("model %s: unloading %s (least recently used, idle) to fit %s in the memory budget",
                         lane.name, victim.name, lane.name)
                await self._unload(victim)
                continue
            self._changed.clear()
            if self.used + lane.footprint <= self.budget:
                break
            log.info("model %s: waiting for a loaded model to become idle (budget %d bytes, in use %d)",
                     lane.name, self.budget, self.used)
            await self._changed.wait()
            if self.closing:
                lane.state, lane.stage = LaneState.UNLOADED, None
                return
        await self._finish_load(lane, self._start_engine(lane), t0)

    def _start_engine(self, lane: ModelLane) -> EngineBridge:
        lane.reserved = True
        lane.stage = "loading"
        log.info("model %s: loading %s", lane.name, lane.entry.path)
        lane.progress = LoadProgress()
        config = self.settings.engine_config(str(lane.entry.path), adapters=lane is self.default)
        bridge = EngineBridge(config, self._dispatch, self.gate,
                              name=f"pagewire-engine-{lane.name}"[:15], progress=lane.progress)
        lane.bridge = bridge
        bridge.start()
        return bridge

    async def _finish_load(self, lane: ModelLane, bridge: EngineBridge, t0: float) -> None:
        loop = asyncio.get_running_loop()
        progress = lane.progress
        assert progress is not None
        loaded = asyncio.Event()
        reporter = loop.create_task(report_progress(lane.name, progress, loaded))
        try:
            ready = await loop.run_in_executor(None, bridge.wait_ready)
        finally:
            loaded.set()
            await reporter
        if not ready and bridge.error is None:  # no engine thread was started (the edge's torch-free tests)
            return
        if bridge.error is not None:
            message = f"model {lane.name} failed to load: {' '.join(str(bridge.error).split())}"
            log.error("%s", message)
            lane.bridge, lane.reserved, lane.state, lane.stage = None, False, LaneState.UNLOADED, None
            lane.load_error = message
            self._changed.set()
            self.on_load_failed(lane, message)
            return
        lane.load_seconds = time.monotonic() - t0
        lane.load_error = None
        lane.loads += 1
        lane.load_seconds_total += lane.load_seconds
        lane.state, lane.stage = LaneState.LOADED, None
        lane.last_used = time.monotonic()
        # The load's objects out of the collector's full collections (heap.settle: each walked them
        # all with the GIL held, 79 ms on SmolLM2, stalling every stream); one collection here.
        heap.settle()
        stages = ", ".join(f"{st} {secs:.1f}s" for st, _, secs in progress.finished)
        log.info("model %s: loaded in %.2fs (max_model_len %d; %s)", lane.name, lane.load_seconds,
                 bridge.max_model_len, stages or "no stages reported")
        self.on_loaded(lane, lane.load_seconds)
        if self.closing:
            return
        lane.admission.paused = False
        lane.admission.pump()
        if lane.live == 0:
            self._schedule_expiry(lane)

    async def _unload(self, lane: ModelLane) -> None:
        if lane.state is not LaneState.LOADED or lane.live:
            return
        lane.state = LaneState.UNLOADING
        lane.admission.paused = True
        lane.expires_at = None
        bridge, lane.bridge = lane.bridge, None
        if bridge is not None:
            await asyncio.get_running_loop().run_in_executor(None, bridge.shutdown, 5.0)
        del bridge
        # The engine's tensors go now, not at some later collection. Its objects were frozen when it
        # loaded (heap.settle): hand them back, then collect and freeze the other models' again.
        heap.unsettle()
        heap.settle()
        lane.reserved = False
        lane.state = LaneState.UNLOADED
        lane.unloads += 1
        log.info("model %s: unloaded", lane.name)
        self.on_unloaded(lane)
        self._changed.set()
        if lane.live:  # a request arrived while it was unloading
            self.want(lane)

    async def close(self) -> None:
        """Stop every engine (the Runtime's close, after the drain)."""
        self.closing = True
        self._changed.set()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        loop = asyncio.get_running_loop()
        for lane in self.lanes.values():
            if lane.bridge is not None:
                await loop.run_in_executor(None, lane.bridge.shutdown, 5.0)
        heap.unsettle()  # nothing stays frozen past the pool (heap.settle)

    def queued(self) -> int:
        return sum(lane.admission.queued for lane in self.lanes.values())
