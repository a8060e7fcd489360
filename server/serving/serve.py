"""Running the server process: uvicorn on uvloop with httptools and the `websockets` implementation,
plus pagewire's two-stage shutdown.

uvicorn's own handling of SIGINT/SIGTERM would stop accepting and then cut WebSockets with 1012
before the app could finish its requests. We take the signals instead:
1. first signal: `Runtime.drain()` runs (no new requests, /health 503, grace period for in-flight
   requests, the rest interrupted, every ledger row terminal, WebSockets closed with 1001);
   only then is uvicorn told to exit, and its lifespan shutdown stops the engine and the ledger;
2. second signal: forced exit now; rows still open are marked `interrupted` synchronously (best
   effort) and the process exits with status 130 — anything missed is caught at the next start.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import warnings
from pathlib import Path
from types import FrameType
from typing import Iterator, Optional

import uvicorn

from server.serving.runtime import Runtime
from server.serving.settings import ServeSettings

log = logging.getLogger("pagewire")

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class PagewireServer(uvicorn.Server):
    """uvicorn.Server whose signal handling runs the Runtime's graceful drain first."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime) -> None:
        super().__init__(config)
        self.runtime = runtime
        self._signals = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def serve(self, sockets: Optional[list] = None) -> None:
        self._loop = asyncio.get_running_loop()
        with self.capture_signals():
            await self._serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            # Unlike uvicorn, do not re-raise the captured signal: the drain already handled it.
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        # Runs in the main thread between bytecodes of the loop; only schedule work here.
        self._signals += 1
        if self._signals == 1 and self._loop is not None and self.started:
            log.info("received %s: draining (send it again to force exit)", signal.Signals(sig).name)
            self._loop.call_soon_threadsafe(self._start_drain)
        elif self._signals == 1:
            self.should_exit = True  # still starting up: nothing to drain
        else:
            self._force_exit()

    def _start_drain(self) -> None:
        task = asyncio.get_running_loop().create_task(self._drain_then_exit())
        task.add_done_callback(lambda _: None)
        self._drain_task = task

    async def _drain_then_exit(self) -> None:
        try:
            await self.runtime.drain()
        except Exception:
            log.exception("graceful drain failed")
        self.should_exit = True

    def _force_exit(self) -> None:
        log.warning("second signal: forcing exit")
        try:
            from server.serving.ledger_sync import interrupt_open_sync

            interrupt_open_sync(self.runtime.settings.db_path, "server was forced to stop")
        except Exception as e:  # best effort: the next start interrupts whatever is left
            log.error("could not mark open requests interrupted: %s", e)
        os._exit(130)


def _check_auth(settings: ServeSettings) -> None:
    """Refuse (AuthConfigError) to serve a non-loopback address without authentication."""
    from server.gateway.auth import check_policy, read_admin_key
    from server.gateway.keys import count_keys

    has_admin = bool(settings.admin_key_file) and bool(read_admin_key(settings.admin_key_file or ""))
    check_policy(settings.auth, settings.host, count_keys(settings.db_path) > 0, has_admin,
                 settings.insecure_no_auth)


def run(settings: ServeSettings, model_dir: Path, model_name: str) -> None:
    """Serve until a signal stops us. Blocks. Raises LedgerLocked (naming the holder's PID) at
    once, before anything is loaded or bound, when another server owns the same ledger."""
    from server.api.app import build_app
    from server.gateway import redact
    from server.serving.db_lock import LedgerLock

    redact.install()  # before uvicorn logs anything (it logs request headers at debug level)
    # Held until the process exits (or the ledger closes); a crash releases it with the fd.
    lock = LedgerLock.acquire(settings.db_path)
    try:
        _check_auth(settings)
    except BaseException:
        lock.release()
        raise
    runtime = Runtime(settings, model_dir, model_name, lock=lock)
    with warnings.catch_warnings():
        # uvicorn marks its `websockets` implementation deprecated in favour of `websockets-sansio`;
        # the issue asks for this one, and it is fully functional.
        warnings.filterwarnings("ignore", message=r"The `websockets` implementation is deprecated")
        config = uvicorn.Config(
            build_app(runtime),
            host=settings.host,
            port=settings.port,
            loop="uvloop",
            http="httptools",
            ws="websockets",
            lifespan="on",
            log_level=settings.log_level,
            ws_max_size=max(16 * 1024 * 1024, 2 * settings.max_request_bytes),
            # pagewire owns WebSocket liveness (server.api.ws_watchdog): the library's keepalive
            # would close a client that stops reading with 1011 before the slow-consumer cut.
            ws_ping_interval=None,
            ws_ping_timeout=None,
            timeout_graceful_shutdown=5,
            access_log=False,
        )
        config.load()
    PagewireServer(config, runtime).run()
    if runtime.closed:
        _exit_now()


def _exit_now() -> None:
    """Exit at once once the Runtime has closed (ledger flushed and closed, lock released).

    Interpreter finalisation would wait for whatever threads are left, which own nothing that
    needs saving: a tokenisation of a prompt no one awaits on its daemon thread, torch's and the
    tokenizers library's pools. It took seconds (5 s idle, 10 s with a multi-megabyte tokenisation
    running), past `--shutdown-grace`. Logs and stdio are flushed first."""
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)
