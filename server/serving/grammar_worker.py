"""Where grammars compile: one low-priority daemon thread, and a deadline for the caller.

A structured-output constraint is compiled at admission (`PromptPreparer.compile_structured`).
llguidance drops the GIL while it compiles, but a large grammar still takes seconds of CPU (a
50,000-option `choice`: 14 s), and on a machine with few cores that CPU came out of the engine
step: another stream's worst inter-token gap went from 0.31 s to 1.06 s (issue 29). So:

* compiles run one at a time on one thread whose scheduling priority is the lowest (`nice` 19,
  set for that thread alone), so the engine thread is always served first and a flood of
  grammars queues instead of taking every core;
* the caller waits at most `timeout_s` (queue time included) and then gets a 400 naming the
  field; a compile that has not started is dropped, one that has runs on (it cannot be
  interrupted) and its result is cached, so an identical retry is a hit;
* a daemon thread: a shutdown never waits for a compile.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
from typing import Any, Callable, Optional

log = logging.getLogger("pagewire")

LOWEST_PRIORITY = 19


def _lower_priority() -> None:
    """Give this thread (only) the lowest CPU priority (Linux: setpriority on the thread id)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
    except (OSError, AttributeError):  # not Linux, or not permitted: compiles still work
        log.debug("could not lower the grammar thread's priority", exc_info=True)


class GrammarWorker:
    """Runs compile jobs in order on one low-priority daemon thread."""

    def __init__(self) -> None:
        self._jobs: "queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], Any]) -> "concurrent.futures.Future[Any]":
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((fut, fn))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pagewire-grammar", daemon=True)
                self._thread.start()
        return fut

    def _run(self) -> None:
        _lower_priority()
        while True:
            fut, fn = self._jobs.get()
            if not fut.set_running_or_notify_cancel():  # its caller gave up before it started
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)
