"""The composition root: puts a serving process together (`compose`: the Runtime, its Gateway and
the app) and runs it: uvicorn on uvloop with httptools and the `websockets` implementation, plus
pagewire's two-stage shutdown.

It sits at the top level, beside `server/cli.py`, because it is the one module that names every
layer (api, gateway, serving); no layer imports it (docs/architecture.md, "Layers").

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
from typing import Iterator, NamedTuple, Optional

import uvicorn
from starlette.applications import Starlette

from server.api.app import build_app
from server.gateway.policy import Gateway
from server.serving.db_lock import LedgerLock
from server.serving.model_catalog import ModelEntry
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
        self.failure: Optional[str] = None  # why start-up failed after the socket was up (see fail)

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

    def fail(self, message: str) -> None:
        """Start-up failed after serving began (the model did not load): exit, and `run` raises
        StartupError(message), so a supervisor sees a non-zero exit instead of a server that
        answers 503 forever. Called on the loop."""
        self.failure = message
        self.should_exit = True

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

            target, ledger = self.runtime.settings.db_target, self.runtime.ledger
            if target.is_postgres:  # only this replica's rows
                from server.serving.ledger_pg_sync import interrupt_own_sync

                assert target.url is not None and ledger is not None
                interrupt_own_sync(target.url, ledger.instance_id, "server was forced to stop")
            else:
                interrupt_open_sync(self.runtime.settings.db_path, "server was forced to stop")
        except Exception as e:  # best effort: the next start interrupts whatever is left
            log.error("could not mark open requests interrupted: %s", e)
        os._exit(130)


def _check_auth(settings: ServeSettings) -> None:
    """Refuse (AuthConfigError) to serve a non-loopback address without authentication."""
    from server.gateway.auth import check_policy, read_admin_key, read_metrics_key
    from server.gateway.keys import count_keys

    has_admin = bool(settings.admin_key_file) and bool(read_admin_key(settings.admin_key_file or ""))
    if settings.metrics_key_file:
        read_metrics_key(settings.metrics_key_file)  # a missing or short file: refused before anything starts
    if settings.db_target.is_postgres:
        from server.serving.ledger_pg_sync import count_keys_pg

        assert settings.db_target.url is not None
        n = count_keys_pg(settings.db_target.url)
    else:
        n = count_keys(settings.db_path)
    check_policy(settings.auth, settings.host, n > 0, has_admin, settings.insecure_no_auth)


class Composed(NamedTuple):
    runtime: Runtime
    gateway: Gateway
    app: Starlette


def compose(settings: ServeSettings, model_dir: Path, model_name: str,
            lock: Optional[LedgerLock] = None, metrics_port: Optional[int] = None,
            models: Optional[list[ModelEntry]] = None) -> Composed:
    """One serving process's parts, wired: the gateway is the Runtime's access policy (started
    by it once the ledger is open) and the app's (the AuthGuard asks it who a caller is).
    `metrics_port`: the port of the --metrics-port listener, which serves /metrics alone.
    `models`: every served model, the default first (server.serving.model_catalog)."""
    gateway = Gateway(settings)
    runtime = Runtime(settings, model_dir, model_name, lock=lock, policy=gateway, models=models)
    return Composed(runtime, gateway, build_app(runtime, gateway, metrics_port=metrics_port))


def run(settings: ServeSettings, model_dir: Path, model_name: str,
        models: Optional[list[ModelEntry]] = None) -> None:
    """Serve until a signal stops us. Blocks. Raises LedgerLocked (naming the holder's PID) at
    once, before anything is loaded or bound, when another server owns the same ledger, and
    StartupError when a port cannot be bound (before anything loads) or the model fails to load."""
    from server.gateway import redact
    from server.serving.listen import StartupError, bind_listeners, log_listening

    redact.install()  # before uvicorn logs anything (it logs request headers at debug level)
    # Held until the process exits (or the ledger closes); a crash releases it with the fd.
    # A PostgreSQL ledger has no lock: replicas share it by design (instance leases instead).
    lock = None if settings.db_target.is_postgres else LedgerLock.acquire(settings.db_path)
    try:
        _check_auth(settings)
        # Bound before the Runtime starts anything (see server.serving.listen).
        listeners = bind_listeners(settings.host, settings.port, settings.metrics_host or settings.host,
                                   settings.metrics_port)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    runtime, _, app = compose(settings, model_dir, model_name, lock=lock, metrics_port=listeners.metrics_port,
                              models=models)
    with warnings.catch_warnings():
        # uvicorn marks its `websockets` implementation deprecated in favour of `websockets-sansio`;
        # the issue asks for this one, and it is fully functional.
        warnings.filterwarnings("ignore", message=r"The `websockets` implementation is deprecated")
        config = uvicorn.Config(
            app,
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
    server = PagewireServer(config, runtime)
    runtime.on_fatal(server.fail)
    log_listening(listeners)
    server.run(sockets=listeners.all)
    if server.failure is not None:
        raise StartupError(server.failure)
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
