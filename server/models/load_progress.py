"""Load progress: what a model's load is doing now, for /health, a terminal bar and log lines.

The engine thread builds the model; the stages report into the `LoadProgress` that thread was
given (`reporting`), through module functions that do nothing on a thread with none (the offline
`LLM`, tests): `stage(name, total_bytes)` starts a stage (read, dequantise/repack, autotune, kv
pool), `advance(n)` counts its bytes. Only plain attribute writes, read by the event loop
(server.serving.model_pool renders them: a bar per stage on a terminal, else a log line every
few seconds), so nothing here locks or blocks the load.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional


@dataclass
class LoadProgress:
    stage: Optional[str] = None  # None: not started
    done_bytes: int = 0
    total_bytes: Optional[int] = None
    stage_started: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.monotonic)
    finished: list[tuple[str, int, float]] = field(default_factory=list)  # (stage, bytes, seconds)

    def describe(self) -> str:
        """`read 12.0/48.0 MiB, 1.2 s` (the stage, its bytes, its time)."""
        if self.stage is None:
            return "starting"
        t = time.monotonic() - self.stage_started
        if self.total_bytes:
            return f"{self.stage} {self.done_bytes / 2**20:.1f}/{self.total_bytes / 2**20:.1f} MiB, {t:.1f} s"
        if self.done_bytes:
            return f"{self.stage} {self.done_bytes / 2**20:.1f} MiB, {t:.1f} s"
        return f"{self.stage}, {t:.1f} s"


_local = threading.local()


@contextlib.contextmanager
def reporting(progress: Optional[LoadProgress]) -> Iterator[None]:
    """Report this thread's load stages into `progress` while the block runs."""
    _local.progress = progress
    try:
        yield
    finally:
        _end_stage(getattr(_local, "progress", None))
        _local.progress = None


def _end_stage(p: Optional[LoadProgress]) -> None:
    if p is not None and p.stage is not None:
        p.finished.append((p.stage, p.done_bytes, time.monotonic() - p.stage_started))


def stage(name: str, total_bytes: Optional[int] = None) -> None:
    p: Optional[LoadProgress] = getattr(_local, "progress", None)
    if p is None:
        return
    _end_stage(p)
    p.done_bytes, p.total_bytes, p.stage_started = 0, total_bytes, time.monotonic()
    p.stage = name


def advance(n_bytes: int) -> None:
    p: Optional[LoadProgress] = getattr(_local, "progress", None)
    if p is not None:
        p.done_bytes += n_bytes
