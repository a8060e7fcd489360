"""Synchronous ledger access for code without an event loop: `pagewire requests list|show`, and
the forced-exit path (second signal), which must finish before the process dies.

Reads open the database read-only; under WAL they never block the server's writer.
"""
from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Optional

from server.serving.ledger import COLUMNS, INTERRUPT_OPEN_SQL, LedgerError, RequestRecord


def open_readonly(path: str | os.PathLike[str]) -> sqlite3.Connection:
    p = Path(path).expanduser()
    if not p.exists():
        raise LedgerError(f"no ledger at {p}")
    conn = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
    conn.execute("PRAGMA busy_timeout=5000")
    return conn


def _columns(conn: sqlite3.Connection) -> str:
    """COLUMNS, or its older form for a ledger no newer server has opened yet (read-only here, so
    the CLI cannot migrate it): a column added since reads as NULL."""
    if getattr(conn, "current_schema", False):  # a PostgreSQL ledger (ledger_pg_sync)
        return COLUMNS
    names = {row[1] for row in conn.execute("PRAGMA table_info(requests)")}
    cols = COLUMNS
    for optional in ("request_hash", "key_id", "reasoning_tokens", "instance_id"):  # schema v2, v3, v6, v7
        if optional not in names:
            cols = cols.replace(optional, "NULL")
    return cols


def list_records(conn: sqlite3.Connection, limit: int = 50, state: Optional[str] = None,
                 key_id: Optional[str] = None) -> list[RequestRecord]:
    cols = _columns(conn)
    where: list[str] = []
    args: tuple[Any, ...] = ()
    if state:
        where.append("state = ?")
        args += (state,)
    if key_id:
        if "key_id" not in cols:  # a ledger from before keys (read as NULL): no request has a key
            return []
        where.append("key_id = ?")
        args += (key_id,)
    sql = f"SELECT {cols} FROM requests" + (" WHERE " + " AND ".join(where) if where else "")
    sql += " ORDER BY created_at DESC LIMIT ?"
    return [RequestRecord.from_row(r) for r in conn.execute(sql, args + (limit,))]


def get_record(conn: sqlite3.Connection, request_id: str) -> Optional[RequestRecord]:
    row = conn.execute(f"SELECT {_columns(conn)} FROM requests WHERE request_id = ?", (request_id,)).fetchone()
    return RequestRecord.from_row(row) if row else None


def interrupt_open_sync(path: str | os.PathLike[str], reason: str, busy_timeout_ms: int = 1000) -> int:
    """Best effort on a forced exit (second signal): mark open rows interrupted, synchronously."""
    conn = sqlite3.connect(str(path), timeout=busy_timeout_ms / 1000)
    try:
        cur = conn.execute(INTERRUPT_OPEN_SQL, (time.time(), reason))
        conn.commit()
        return cur.rowcount
    finally:
        conn.close()
