"""The /v1/ws ASGI endpoint: accepts sockets (each one a `ws.WsConnection`), re-checks the open
sockets' keys once a tick, and closes them all with 1001 when the runtime drains."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from server.api.context import ApiContext
from server.api.ws import CLOSE_GOING_AWAY, WsConnection

log = logging.getLogger("pagewire.ws")

# How often open sockets' keys are re-checked (a revoke from the CLI reaches a socket that
# submits nothing within this; one indexed ledger read per tick for all sockets together).
KEY_RECHECK_S = 1.0


class WsEndpoint:
    """ASGI app for /v1/ws; owns the open connections, which the Runtime's drain closes with 1001."""

    def __init__(self, api: ApiContext) -> None:
        self.api = api
        self.connections: set[WsConnection] = set()
        self._none_left = asyncio.Event()
        self._none_left.set()
        self._rechecking: Optional[asyncio.Task[None]] = None
        api.rt.on_drain(self.close_all)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        service = self.api.rt.service
        if service is None or service.draining:
            await receive()
            await send({"type": "websocket.close", "code": CLOSE_GOING_AWAY})
            return
        await WsConnection(self, scope, receive, send).run()

    def joined(self, conn: WsConnection) -> None:
        self.connections.add(conn)
        self._none_left.clear()
        if self._rechecking is None or self._rechecking.done():
            self._rechecking = asyncio.get_running_loop().create_task(self._recheck_keys())

    async def _recheck_keys(self) -> None:
        """While sockets are open: re-check every socket's caller once a tick, so a revoke (from
        the CLI, another process: there is nothing to wait on but the ledger's key generation),
        an expiry, or auth turning on closes sockets that submit nothing."""
        auth = self.api.gateway.auth
        if auth is None:
            return
        while self.connections:
            await asyncio.sleep(KEY_RECHECK_S)
            try:
                auth.refresh()
            except Exception:  # a busy ledger: keep the cache, try again next tick
                log.warning("re-checking WebSocket keys failed", exc_info=True)
                continue
            for conn in list(self.connections):
                conn.check_auth(refresh=False)

    def left(self, conn: WsConnection) -> None:
        self.connections.discard(conn)
        if not self.connections:
            self._none_left.set()

    async def close_all(self, flush_s: float = 10.0) -> None:
        """Drain hook: every request has ended, so each writer flushes its final frames and closes
        with 1001; wait until every connection has gone (an event, so a fast flush costs nothing;
        `flush_s` only bounds a client that has stopped reading, which uvicorn then cuts)."""
        for conn in list(self.connections):
            conn.shutdown()
        try:
            await asyncio.wait_for(self._none_left.wait(), flush_s)
        except asyncio.TimeoutError:
            log.warning("%d WebSocket(s) still flushing at shutdown", len(self.connections))
