"""Synchronous access to a PostgreSQL ledger for code without an event loop: `pagewire requests`,
`usage` and `keys` on a `postgresql://` --db, the auth policy check before `serve` starts, and
the forced-exit sweep (second signal), which must finish before the process dies.

`PgSyncConn` is shaped like the `sqlite3.Connection` those callers already use (`execute(sql,
args)` returning a cursor, `with conn:` as one transaction), taking the same shared SQL (`?`
placeholders), so KeyStore, ledger_sync and the usage report run unchanged on either backend.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from server.serving.ledger import LedgerError
from server.serving.ledger_pg import _OPEN, NOW, _driver, migrate, pg_sql
from server.serving.lifecycle import LedgerState


class PgSyncConn:
    # Written only by a migrated server or `keys` (which migrates): never an older column set.
    current_schema = True

    def __init__(self, conn: Any) -> None:
        self._c = conn
        self._tx: Optional[Any] = None

    def execute(self, sql: str, args: tuple[Any, ...] = ()) -> Any:
        return self._c.execute(pg_sql(sql), args)

    def day_sql(self, column: str) -> str:
        return f"to_char(to_timestamp({column}) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"

    def __enter__(self) -> "PgSyncConn":
        self._tx = self._c.transaction()
        self._tx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        tx, self._tx = self._tx, None
        assert tx is not None
        return tx.__exit__(*exc)

    def close(self) -> None:
        self._c.close()


def connect_sync(url: str) -> PgSyncConn:
    psycopg = _driver()
    try:
        return PgSyncConn(psycopg.connect(url, autocommit=True, connect_timeout=5))
    except psycopg.Error as e:
        raise LedgerError(f"ledger: cannot connect to PostgreSQL: {e}") from None


def open_for_keys(url: str) -> PgSyncConn:
    """A connection with the current schema (migrated here if no server has run yet)."""
    psycopg = _driver()

    async def run() -> None:
        conn = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=5)
        try:
            await migrate(conn)
        finally:
            await conn.close()

    try:
        asyncio.run(run())
    except psycopg.Error as e:
        raise LedgerError(f"ledger: cannot migrate PostgreSQL: {e}") from None
    return connect_sync(url)


def count_keys_pg(url: str) -> int:
    """How many keys the database holds (0 before any migration)."""
    psycopg = _driver()
    conn = connect_sync(url)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM api_keys").fetchone()[0])
    except psycopg.errors.UndefinedTable:
        return 0
    finally:
        conn.close()


def interrupt_own_sync(url: str, instance_id: str, reason: str) -> int:
    """Best effort on a forced exit: this replica's open rows (only its own) become interrupted,
    and its lease ends now so that survivors release its quota holds."""
    conn = connect_sync(url)
    try:
        cur = conn.execute(
            f"UPDATE requests SET state = '{LedgerState.INTERRUPTED.value}', finished_at = ?, "
            f"error = COALESCE(error, ?) WHERE state IN ({_OPEN}) AND instance_id = ?",
            (time.time(), reason, instance_id))
        conn.execute(f"UPDATE instances SET lease_until = {NOW} - 1 WHERE instance_id = ?", (instance_id,))
        return int(cur.rowcount)
    finally:
        conn.close()
