"""The request ledger: one durable row per request in SQLite (WAL), written by one group-committing writer.

Ordering guarantees (what the rest of the server relies on):
- `insert()` returns only after the row's transaction has COMMITted, so a caller that awaits it
  and then acknowledges (`accepted`, HTTP headers) never acknowledges an unrecorded request.
- Every write goes through one FIFO queue drained by one writer task on one connection, so the
  writes of one request land in the order they were issued (queued → running → terminal) even
  when the fire-and-forget ones (`mark_running`, `mark_first_token`) are not awaited.
- Writes queued while a transaction is in flight are committed together in the next one
  ("group commit"): one COMMIT per batch, not per request.
Reads use a second connection; under WAL they see the last committed state and never block the
writer. On open, rows left `queued` or `running` by a previous process become `interrupted`.

When writes fail (disk full, I/O error) the ledger says so instead of pretending: `write_error`
holds the last failure until a commit succeeds, and `healthy` is False while it is set or while
a terminal write is still owed. A terminal write that failed is handed to `finish_later`, which
holds it (state, usage, output) in memory and retries it with backoff until it lands; nothing
else may overwrite that row meanwhile (the shutdown sweep writes owed terminals first).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import aiosqlite

from server.serving.errors import LedgerError, Unavailable  # LedgerError: re-exported
from server.serving.ledger_rows import COLUMNS as COLUMNS  # re-exported: the row types' old home
from server.serving.ledger_rows import NewRequest as NewRequest
from server.serving.ledger_rows import RequestRecord as RequestRecord
from server.serving.ledger_rows import Terminal as Terminal
from server.serving.lifecycle import END_RULES, OPEN_STATES, EndReason, LedgerState
from server.serving.schema import MIGRATIONS, SCHEMA_VERSION  # SCHEMA_VERSION: re-exported

if TYPE_CHECKING:
    from server.serving.db_lock import LedgerLock

log = logging.getLogger("pagewire.ledger")

# The one statement that closes rows nobody will finish: at open (rows a previous process left),
# at the end of a drain, and on a forced exit (`ledger_sync`). Args: (finished_at, error).
INTERRUPT_OPEN_SQL = (
    f"UPDATE requests SET state = '{LedgerState.INTERRUPTED.value}', finished_at = ?, "
    f"error = COALESCE(error, ?) "
    f"WHERE state IN ({', '.join(repr(s.value) for s in OPEN_STATES)})"
)
INTERRUPTED_MESSAGE = END_RULES[EndReason.INTERRUPTED].message

class IdempotencyConflict(LedgerError):
    """An insert lost to a committed row with the same idempotency key (the unique constraint
    decided: another replica, or an earlier attempt whose commit was ambiguous, holds the key)."""


class LedgerWriteError(LedgerError, Unavailable):
    """A write did not commit (disk full, I/O error, read-only file). A PagewireError too: a
    request whose row cannot be recorded is refused with 503 `ledger_unavailable`, never run
    unrecorded."""

    def __init__(self, message: str) -> None:
        Unavailable.__init__(self, message, code="ledger_unavailable", retry_after_s=5)


async def _apply_pragmas(conn: aiosqlite.Connection, busy_timeout_ms: int) -> None:
    await conn.execute("PRAGMA journal_mode=WAL")
    # NORMAL under WAL: a commit survives a process crash (what SIGKILL tests); only an OS
    # crash or power loss can lose the last transactions, and never corrupts the file.
    await conn.execute("PRAGMA synchronous=NORMAL")
    await conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")


async def _migrate(conn: aiosqlite.Connection) -> None:
    """Bring the schema to SCHEMA_VERSION, one transaction per step; refuse a newer database."""
    await conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    cur = await conn.execute("SELECT version FROM schema_version")
    row = await cur.fetchone()
    version = row[0] if row else 0
    if version > SCHEMA_VERSION:
        raise LedgerError(
            f"ledger schema version {version} is newer than this pagewire understands "
            f"({SCHEMA_VERSION}); use a newer pagewire or another --db"
        )
    for v in range(version, SCHEMA_VERSION):
        # executescript commits first, so the migration and the version bump share one script.
        bump = (
            f"INSERT INTO schema_version (version) VALUES ({v + 1});"
            if row is None and v == version
            else f"UPDATE schema_version SET version = {v + 1};"
        )
        await conn.executescript("BEGIN IMMEDIATE;" + MIGRATIONS[v] + ";" + bump + "COMMIT;")


class _Op:
    __slots__ = ("sql", "args", "future")

    # The future's result is the statement's rowcount (a claim checks that it won the row).
    def __init__(self, sql: str, args: tuple[Any, ...], future: Optional[asyncio.Future[Any]]):
        self.sql = sql
        self.args = args
        self.future = future


class Ledger:
    """Async front of the ledger. Create with `await Ledger.open(path)`; all methods run on the loop."""

    # One process owns a SQLite ledger; a PostgreSQL one (ledger_pg) is shared by replicas.
    shared = False

    def __init__(self, path: Optional[Path], writer: Any, reader: Any):
        self.path = path  # the database file; None where there is none (PostgreSQL)
        # This process's instance id, recorded on every row it accepts (see migration 6).
        self.instance_id = f"{os.uname().nodename}-{os.getpid()}-{os.urandom(3).hex()}"
        self.instance_name = self.instance_id
        self._writer = writer
        self._reader = reader
        self._ops: list[_Op] = []
        self._wake = asyncio.Event()
        self._closed = False
        self.commits = 0  # number of COMMITs (for tests of group commit)
        self.interrupted_at_start = 0
        self.lock: "Optional[LedgerLock]" = None
        self.write_error: Optional[str] = None  # the last failed write, until a commit succeeds
        self.failed_commits = 0
        # Terminal writes that failed, by request id, retried until they land (finish_later).
        self._owed: dict[str, Terminal] = {}
        self._retry_task: Optional[asyncio.Task[None]] = None
        self.retry_delays = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0)  # then 2 s apart
        self._task = asyncio.get_running_loop().create_task(self._write_loop(), name="ledger-writer")

    @classmethod
    async def open(cls, path: str | os.PathLike[str], busy_timeout_ms: int = 5000,
                   lock: "Optional[LedgerLock]" = None) -> "Ledger":
        """Open (creating if needed) the database, migrate it, and interrupt leftover open rows.

        The start-up sweep is only safe for the one process that owns the database, so the
        ledger holds its exclusive lock (`db_lock`) while open: `lock` when the caller took it
        earlier (the server does, to refuse before loading anything), else it is taken here and
        LedgerLocked names the other holder. A new folder is created 0700 and a new file 0600.
        """
        from server.serving.db_lock import LedgerLock, secure_paths

        p = Path(path).expanduser()
        own_lock = LedgerLock.acquire(p) if lock is None else lock
        try:
            secure_paths(p)
            writer = await aiosqlite.connect(str(p), isolation_level=None)
        except BaseException:
            own_lock.release()
            raise
        try:
            await _apply_pragmas(writer, busy_timeout_ms)
            await _migrate(writer)
            cur = await writer.execute(INTERRUPT_OPEN_SQL, (time.time(), INTERRUPTED_MESSAGE))
            interrupted = cur.rowcount
            reader = await aiosqlite.connect(str(p), isolation_level=None)
            await reader.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        except BaseException:
            await writer.close()
            own_lock.release()
            raise
        ledger = cls(p, writer, reader)
        ledger.lock = own_lock
        ledger.interrupted_at_start = interrupted
        if interrupted:
            log.warning("ledger: %d request(s) left open by a previous run are now 'interrupted'", interrupted)
        return ledger

    # -- writes ---------------------------------------------------------------------------------
    def _enqueue(self, sql: str, args: tuple[Any, ...], wait: bool) -> Optional[asyncio.Future[Any]]:
        if self._closed:
            raise LedgerError("ledger is closed")
        fut: Optional[asyncio.Future[Any]] = asyncio.get_running_loop().create_future() if wait else None
        self._ops.append(_Op(sql, args, fut))
        self._wake.set()
        return fut

    def _insert_op(self, req: NewRequest) -> tuple[str, tuple[Any, ...]]:
        return (
            "INSERT INTO requests (request_id, idempotency_key, kind, api, client, model, state, "
            "priority, params_json, prompt_json, created_at, prompt_tokens, request_hash, key_id, instance_id) "
            "VALUES (?, ?, ?, ?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?)",
            (req.request_id, req.idempotency_key, req.kind, req.api, req.client, req.model,
             req.priority, json.dumps(req.params),
             json.dumps(req.prompt) if req.prompt is not None else None, req.created_at,
             req.prompt_tokens, req.request_hash, req.key_id, self.instance_id))

    async def insert(self, req: NewRequest) -> None:
        """Write the `queued` row and return once it is committed."""
        fut = self._enqueue(*self._insert_op(req), wait=True)
        assert fut is not None
        try:
            await fut
        except sqlite3.IntegrityError as e:
            if req.idempotency_key is not None and "idempotency_key" in str(e):
                raise IdempotencyConflict(f"idempotency key {req.idempotency_key!r} is taken") from None
            raise

    def mark_running(self, request_id: str, admitted_at: float) -> None:
        """Queued → running (handed to the engine). Not awaited: FIFO order keeps it before the end."""
        self._enqueue(
            "UPDATE requests SET state = 'running', admitted_at = ? WHERE request_id = ? AND state = 'queued'",
            (admitted_at, request_id), wait=False,
        )

    def mark_first_token(self, request_id: str, at: float) -> None:
        self._enqueue(
            "UPDATE requests SET first_token_at = ? WHERE request_id = ? AND first_token_at IS NULL",
            (at, request_id), wait=False,
        )

    def mark_progress(self, request_id: str, completion_tokens: int) -> None:
        """Record how many tokens a running request has emitted so far (not awaited), so that a
        request cut off by a crash still counts what it emitted against its key's daily quota."""
        self._enqueue(
            "UPDATE requests SET completion_tokens = ? WHERE request_id = ? AND state = 'running'",
            (completion_tokens, request_id), wait=False,
        )

    @property
    def healthy(self) -> bool:
        return self.write_error is None and not self._owed

    @property
    def owed(self) -> dict[str, Terminal]:
        """Terminal writes still waiting to land, by request id (read-only view for health)."""
        return dict(self._owed)

    def finish_later(self, request_id: str, t: Terminal) -> None:
        """Hold a terminal write that failed and retry it in the background until it commits."""
        self._owed[request_id] = t
        if self._retry_task is None or self._retry_task.done():
            self._retry_task = asyncio.get_running_loop().create_task(self._retry_owed(), name="ledger-retry")

    async def _retry_owed(self) -> None:
        attempt = 0
        while self._owed and not self._closed:
            await asyncio.sleep(self.retry_delays[min(attempt, len(self.retry_delays) - 1)])
            attempt += 1
            if await self._write_owed():
                log.warning("ledger: owed terminal writes landed after %d retr%s", attempt,
                            "y" if attempt == 1 else "ies")

    async def _write_owed(self) -> bool:
        """One attempt at every owed terminal write; True when all of them landed."""
        batch = list(self._owed.items())
        futs = [(rid, t, self._finish_op(rid, t)) for rid, t in batch]
        ok = True
        for rid, t, fut in futs:
            try:
                await fut
            except Exception:
                ok = False
                continue
            if self._owed.get(rid) is t:
                del self._owed[rid]
        return ok

    def _finish_op(self, request_id: str, t: Terminal) -> "asyncio.Future[Any]":
        fut = self._enqueue(
            "UPDATE requests SET state = ?, finish_reason = ?, error = ?, prompt_tokens = ?, "
            "completion_tokens = ?, cached_tokens = ?, output_text = ?, output_json = ?, "
            "first_token_at = COALESCE(first_token_at, ?), finished_at = ?, reasoning_tokens = ? "
            "WHERE request_id = ? AND state IN ('queued', 'running')",
            (t.state, t.finish_reason, t.error, t.prompt_tokens, t.completion_tokens,
             t.cached_tokens, t.output_text, json.dumps(t.output), t.first_token_at,
             t.finished_at, t.reasoning_tokens, request_id),
            wait=True,
        )
        assert fut is not None
        return fut

    async def finish(self, request_id: str, t: Terminal) -> None:
        """Write the terminal state, usage and output; return once committed."""
        await self._finish_op(request_id, t)

    async def interrupt_open(self, reason: str) -> None:
        """Last resort at shutdown: every row still open becomes `interrupted`. Owed terminal
        writes are queued first (same transaction, FIFO), so a request that finished keeps its
        real state and usage rather than being swept into `interrupted`."""
        owed = [self._finish_op(rid, t) for rid, t in list(self._owed.items())]
        fut = self._enqueue(INTERRUPT_OPEN_SQL, (time.time(), reason), wait=True)
        assert fut is not None
        if owed:
            results = await asyncio.gather(*owed, return_exceptions=True)
            if not any(isinstance(r, BaseException) for r in results):
                self._owed.clear()
        await fut

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._ops = self._ops, []
            if not batch:
                if self._closed:
                    return
                continue
            await self._commit(batch)

    async def _commit(self, batch: list[_Op]) -> None:
        # One transaction per batch. A failing statement (e.g. a duplicate idempotency key) only
        # rolls back itself under SQLite's default ABORT conflict rule, so the rest still commit.
        errors: list[Optional[BaseException]] = []
        counts: list[int] = []
        storage_error: Optional[str] = None
        try:
            await self._writer.execute("BEGIN IMMEDIATE")
            for op in batch:
                try:
                    cur = await self._writer.execute(op.sql, op.args)
                    counts.append(cur.rowcount)
                    errors.append(None)
                except sqlite3.Error as exc:
                    failure: BaseException = exc
                    if not isinstance(exc, sqlite3.IntegrityError):  # not a client's duplicate key
                        storage_error = f"{exc}"
                        failure = LedgerWriteError(f"ledger write failed: {exc}")
                    errors.append(failure)
                    counts.append(0)
                    if op.future is None:
                        log.error("ledger write failed: %s (%s)", exc, op.sql.split(" ")[0])
            await self._writer.execute("COMMIT")
            self.commits += 1
        except BaseException as exc:  # the whole batch is lost: tell every waiter
            self.write_error = f"{exc}"
            self.failed_commits += 1
            log.error("ledger commit failed: %s", exc)
            try:
                await self._writer.execute("ROLLBACK")
            except Exception:
                pass
            for op in batch:
                if op.future is not None and not op.future.done():
                    op.future.set_exception(LedgerWriteError(f"ledger commit failed: {exc}"))
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self.write_error = storage_error
        if storage_error is not None:
            self.failed_commits += 1
        for op, err, n in zip(batch, errors, counts):
            if op.future is not None and not op.future.done():
                if err is None:
                    op.future.set_result(n)
                else:
                    op.future.set_exception(err)

    # -- reads ----------------------------------------------------------------------------------
    async def get(self, request_id: str) -> Optional[RequestRecord]:
        cur = await self._reader.execute(f"SELECT {COLUMNS} FROM requests WHERE request_id = ?", (request_id,))
        row = await cur.fetchone()
        return RequestRecord.from_row(tuple(row)) if row else None

    async def find_by_idempotency_key(self, key: str) -> Optional[RequestRecord]:
        cur = await self._reader.execute(f"SELECT {COLUMNS} FROM requests WHERE idempotency_key = ?", (key,))
        row = await cur.fetchone()
        return RequestRecord.from_row(tuple(row)) if row else None

    # -- the batch tier's tables (server.gateway): same writer queue, same reader ---------------
    async def execute(self, sql: str, args: tuple[Any, ...] = ()) -> int:
        """One write through the writer queue; returns its rowcount once committed (FIFO with
        request writes). Callers write the SQL both backends share (`?` placeholders, ON CONFLICT
        upserts, no engine-specific functions); a backend translates what it must."""
        fut = self._enqueue(sql, args, wait=True)
        assert fut is not None
        return int(await fut)

    def execute_nowait(self, sql: str, args: tuple[Any, ...] = ()) -> None:
        """A write queued behind everything already queued, not awaited (like mark_running)."""
        self._enqueue(sql, args, wait=False)

    def day_sql(self, column: str) -> str:
        """The SQL expression for the UTC day (YYYY-MM-DD) of a Unix-seconds column."""
        return f"date({column}, 'unixepoch')"

    async def instance_label(self, instance_id: Optional[str]) -> str:
        """How to name a replica in a message (its registered name, else its id)."""
        return instance_id or "unknown"

    async def sweep_dead(self) -> int:
        """Interrupt the rows of replicas whose lease lapsed: none here (one process owns the file;
        its start-up sweep did this)."""
        return 0

    async def claim_batch_line(self, batch_id: str, line_no: int, attempt: int) -> bool:
        """Take a batch line for this process: one process owns a SQLite ledger, so every line a
        previous run left open is its to resume. True when the line was still open."""
        n = await self.execute(
            "UPDATE batch_lines SET status = 'running', attempt = ?, lease_owner = ? WHERE batch_id = ? "
            "AND line_no = ? AND status IN ('pending', 'running')", (attempt, self.instance_id, batch_id, line_no))
        return n == 1

    async def execute_many(self, statements: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Several writes queued back to back, so they commit in one transaction (group commit)."""
        futs = [self._enqueue(sql, args, wait=True) for sql, args in statements]
        await asyncio.gather(*[f for f in futs if f is not None])

    async def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Rows of a read on the reader connection (the last committed state)."""
        cur = await self._reader.execute(sql, args)
        return [tuple(r) for r in await cur.fetchall()]

    async def close(self) -> None:
        """Flush queued writes, then close both connections. Idempotent."""
        if self._closed:
            return
        if self._owed:
            await self._write_owed()
            for rid, t in self._owed.items():
                log.error("ledger: closing with the terminal write of %s still failing (%s, %d prompt + "
                          "%d completion tokens); the next start marks it interrupted", rid, t.state,
                          t.prompt_tokens, t.completion_tokens)
        self._closed = True
        self._wake.set()
        if self._retry_task is not None:
            self._retry_task.cancel()
        await self._task
        await self._close_connections()
        if self.lock is not None:
            self.lock.release()

    async def _close_connections(self) -> None:
        await self._reader.close()
        await self._writer.close()
