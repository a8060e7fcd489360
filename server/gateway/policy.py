"""`Gateway`: one serving process's access policy, the key cache and the token quotas.

It is the `server.serving.access.AccessPolicy` the Runtime starts once the ledger is open (the
ledger migrates the schema the `api_keys` table lives in), and the object the edge asks who a
caller is (`auth`, through the AuthGuard) and what a key has left (`quotas.headers`). The
composition root (`server/serve.py`) builds it and hands it to both.
"""
from __future__ import annotations

import asyncio
import logging
import sqlite3
from typing import Optional

from server.gateway import redact
from server.gateway.auth import Authenticator, read_admin_key, read_metrics_key
from server.gateway.quotas import QuotaBook
from server.gateway.usage import daily_usage, daily_usage_by_model, recent_usage, recent_usage_by_model
from server.serving.ledger import Ledger
from server.serving.settings import ServeSettings

log = logging.getLogger("pagewire")


class Gateway:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.auth: Optional[Authenticator] = None  # set in start()
        self._quotas: Optional[QuotaBook] = None
        self._keys_conn: Optional[sqlite3.Connection] = None
        self._keys_task: Optional["asyncio.Task[None]"] = None

    @property
    def quotas(self) -> Optional[QuotaBook]:
        return self._quotas

    async def start(self, ledger: Ledger) -> None:
        s = self.settings
        redact.install()  # before any request can log a header
        if ledger.shared:
            await self._start_shared(ledger)
            return
        # The key cache reads the api_keys table through its own small connection (used on the
        # loop only; the ledger migrated the schema before this runs).
        self._keys_conn = sqlite3.connect(str(s.db_path), check_same_thread=False, isolation_level=None)
        self._keys_conn.execute("PRAGMA busy_timeout=1000")
        admin = read_admin_key(s.admin_key_file) if s.admin_key_file else None
        metrics_token = read_metrics_key(s.metrics_key_file) if s.metrics_key_file else None
        self.auth = Authenticator(self._keys_conn, s.auth, admin, s.insecure_no_auth, metrics_token)
        quotas = QuotaBook(self.auth.limits_of)
        day = QuotaBook.day_of(quotas.clock())
        quotas.load_daily(await daily_usage(ledger, day), day, await daily_usage_by_model(ledger, day))
        since = quotas.clock() - 60.0
        quotas.load_window(await recent_usage(ledger, since), await recent_usage_by_model(ledger, since))
        self._quotas = quotas
        log.info("auth: %s (%s)", "required" if self.auth.required else "off",
                 f"mode {s.auth}" + (", admin key set" if admin else ""))

    KEYS_POLL_S = 0.5

    async def _start_shared(self, ledger: Ledger) -> None:
        """A ledger shared with other replicas (PostgreSQL): quotas held in the database
        (server.gateway.quota_db); keys polled every KEYS_POLL_S through the async ledger, because
        a synchronous read on the event loop could stall it as long as the network to the database
        does (so `pagewire keys revoke` takes effect within that interval, not on the next request)."""
        from server.gateway.keys import load_keys
        from server.gateway.quota_db import DbQuotas
        from server.serving.ledger_pg import PgLedger

        assert isinstance(ledger, PgLedger)
        s = self.settings
        admin = read_admin_key(s.admin_key_file) if s.admin_key_file else None
        metrics_token = read_metrics_key(s.metrics_key_file) if s.metrics_key_file else None
        auth = Authenticator(None, s.auth, admin, s.insecure_no_auth, metrics_token)
        auth.load(*await load_keys(ledger))
        self.auth = auth
        self._quotas = DbQuotas(ledger, auth.limits_of)

        async def poll_keys() -> None:
            while True:
                await asyncio.sleep(self.KEYS_POLL_S)
                try:
                    auth.load(*await load_keys(ledger))
                except Exception as e:  # the database is away: keep the cache, try again
                    log.debug("key poll failed: %s", e)

        self._keys_task = asyncio.get_running_loop().create_task(poll_keys(), name="keys-poll")
        log.info("auth: %s (%s; keys polled from the shared ledger)", "required" if auth.required else "off",
                 f"mode {s.auth}" + (", admin key set" if admin else ""))

    def close(self) -> None:
        if self._keys_task is not None:
            self._keys_task.cancel()
            self._keys_task = None
        if self._keys_conn is not None:
            self._keys_conn.close()
            self._keys_conn = None
