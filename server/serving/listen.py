"""The listening sockets, bound before anything else starts.

`serve` binds its port (and the optional `--metrics-port`) itself, before the ledger opens, the
engine thread starts or torch loads, and hands the sockets to uvicorn. A port already in use is
then a one-line `StartupError` and a clean exit; when uvicorn bound it after the lifespan had
started the engine thread, its `sys.exit` tore the process down under that thread (SIGABRT).
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("pagewire")


class StartupError(Exception):
    """`serve` cannot start; the message is the one line it prints (naming the option or file)."""


@dataclass
class Listeners:
    main: socket.socket
    metrics: Optional[socket.socket] = None

    @property
    def all(self) -> list[socket.socket]:
        return [self.main] + ([self.metrics] if self.metrics is not None else [])

    @property
    def metrics_port(self) -> Optional[int]:
        return port_of(self.metrics) if self.metrics is not None else None

    def close(self) -> None:
        for s in self.all:
            s.close()


def port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def bind(host: str, port: int, option: str) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening: uvicorn calls listen). Raises
    StartupError naming `option` when the address is taken or cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As uvicorn does: a restart can rebind a port whose old connections sit in TIME_WAIT. It does
    # not let two live servers share a port on Linux (that needs SO_REUSEPORT).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        reason = "address already in use" if e.errno in (98, 48) else (e.strerror or str(e))
        raise StartupError(f"{option} {port}: cannot listen on {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock


def bind_listeners(host: str, port: int, metrics_host: str, metrics_port: Optional[int]) -> Listeners:
    main = bind(host, port, "--port")
    if metrics_port is None:
        return Listeners(main)
    try:
        metrics = bind(metrics_host, metrics_port, "--metrics-port")
    except BaseException:
        main.close()
        raise
    return Listeners(main, metrics)


def log_listening(listeners: Listeners) -> None:
    for sock, what in ((listeners.main, "listening on http://%s:%d"),
                       (listeners.metrics, "metrics on http://%s:%d/metrics")):
        if sock is not None:
            addr = sock.getsockname()
            log.info(what, f"[{addr[0]}]" if sock.family == socket.AF_INET6 else addr[0], addr[1])
