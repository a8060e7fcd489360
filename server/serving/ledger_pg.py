"""The request ledger on PostgreSQL: the same interface and promises as the SQLite `Ledger`, for
several replicas sharing one database.

Driver: psycopg 3 (`psycopg`, `psycopg_pool`; the `[postgres]` extra). Chosen over asyncpg
because one driver serves both sides of pagewire: the server's async ledger and the synchronous
CLI (`pagewire requests|usage|keys`, the forced-exit sweep) use the same library, the same
libpq connection strings and the same `%s` parameter style; it is the PostgreSQL adapter the
psycopg project maintains, with a maintained pool (`psycopg_pool`).

What is the same as SQLite (inherited from `Ledger`):
- every write goes through one FIFO queue and one writer task on one connection, and the writes
  queued while a transaction is in flight commit together in the next one (group commit: one
  COMMIT per batch, not per token); `insert()` returns only after its COMMIT;
- a failed commit sets `write_error` (so /health says so and requests get 503
  `ledger_unavailable`), terminal writes that fail are owed and retried until they land.
What differs, and why:
- the writer's connection is re-opened after any failure, so a database restart heals by
  itself; a commit that takes longer than `commit_timeout_s` (a paused network) is abandoned and
  its callers told so (its outcome is unknown: an idempotency key reconciles a retry);
- reads go through a connection pool (several handlers read at once; SQLite reads one file);
- inserts run inside a SAVEPOINT, so a unique violation (an idempotency key another replica
  committed first) fails only that insert, as SQLite's ABORT conflict rule does;
- there is no flock: replicas coexist. Each registers an instance with a lease it renews
  (`lease_s`, renewed every `lease_s / 4`, on the database's clock). Open rows are interrupted
  only when their own instance's lease has lapsed, by whichever replica sweeps first (at start and
  on every renewal); a replica's own drain interrupts only its own rows.

Callers write one SQL for both backends (`?` placeholders, `ON CONFLICT` upserts); this module
turns `?` into psycopg's `%s`, maps the migrations' two type names whose meaning differs (REAL
is 4 bytes in PostgreSQL; BLOB is BYTEA) and owns the only engine-specific expressions (the
database clock, advisory locks, the day of a timestamp).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import Any, AsyncIterator, Awaitable, Optional, TypeVar

from server.serving.ledger import (
    COLUMNS,
    INTERRUPTED_MESSAGE,
    IdempotencyConflict,
    Ledger,
    LedgerError,
    LedgerWriteError,
    NewRequest,
    RequestRecord,
    _Op,
)
from server.serving.lifecycle import OPEN_STATES, LedgerState
from server.serving.schema import MIGRATIONS, SCHEMA_VERSION

log = logging.getLogger("pagewire.ledger.pg")

# pg_advisory_xact_lock key that serialises migrations of one database (any constant will do).
MIGRATION_LOCK = 0x7061676577697265  # "pagewire"
NOW = "extract(epoch from clock_timestamp())"
_OPEN = ", ".join(repr(s.value) for s in OPEN_STATES)


def pg_sql(sql: str) -> str:
    """Shared SQL → psycopg: `?` → `%s` (a literal `%` doubled first). No statement of ours has a
    `?` inside a string literal."""
    return sql.replace("%", "%%").replace("?", "%s")


def pg_migration(sql: str) -> str:
    """A migration from `schema.MIGRATIONS` for PostgreSQL: REAL (8-byte in SQLite, 4-byte in
    PostgreSQL) becomes DOUBLE PRECISION, so timestamps keep their microseconds; BLOB is BYTEA;
    INTEGER (8-byte in SQLite, 4-byte in PostgreSQL) is BIGINT, so a priority or token count the
    API accepts fits on both. (A database created before this mapping keeps its 4-byte columns.)"""
    return re.sub(r"\bINTEGER\b", "BIGINT",
                  re.sub(r"\bBLOB\b", "BYTEA", re.sub(r"\bREAL\b", "DOUBLE PRECISION", sql)))


def _no_nul(v: Any) -> Any:
    """PostgreSQL text cannot hold NUL (SQLite's can). A NUL in a free-text column (a model's raw
    `output_text`, an error) is stored as U+FFFD; the exact output is kept in `output_json`,
    whose JSON escapes it (`\\u0000`), and that is what resume and the API read.
    Query parameters get the same replacement: a value with a NUL (a client's id, say) then
    matches what a write of it stored, and never reaches the server as an error."""
    return v.replace("\x00", "\ufffd") if isinstance(v, str) and "\x00" in v else v


T = TypeVar("T")


async def bounded(aw: Awaitable[T], timeout_s: float) -> T:
    """`aw`'s result, or asyncio.TimeoutError after `timeout_s` without waiting for it to unwind.

    Not `asyncio.wait_for`: that cancels the call and then waits, without limit, for it to end.
    A psycopg call that is cancelled first asks the server to cancel the query (a blocking
    request on a thread) and then waits for the query's answer; against a database that has
    stopped answering (a stopped server, a network that drops packets without a reset) neither
    comes, so the deadline would not hold: the writer stalled behind one commit, every later
    request waited with it, and none was told 503 (issue 32). The abandoned call is cancelled
    and left to end on its own once the database answers or its connection is closed."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task in done:
        return task.result()
    task.cancel()
    task.add_done_callback(_consume)
    raise asyncio.TimeoutError


def _consume(task: "asyncio.Future[Any]") -> None:
    """An abandoned call's outcome is already reported as a timeout: do not log it again."""
    if not task.cancelled():
        task.exception()


def live_instances_sql() -> str:
    return f"SELECT instance_id FROM instances WHERE lease_until >= {NOW}"


# Interrupt the open rows of every instance whose lease lapsed (or that never registered), and
# release their quota holds. Args: (error message,).
SWEEP_SQL = (
    f"UPDATE requests SET state = '{LedgerState.INTERRUPTED.value}', finished_at = {NOW}, "
    f"error = COALESCE(error, %s) WHERE state IN ({_OPEN}) AND "
    f"(instance_id IS NULL OR instance_id NOT IN ({live_instances_sql()}))"
)
SWEEP_HOLDS_SQL = f"DELETE FROM quota_holds WHERE instance_id NOT IN ({live_instances_sql()})"


def _driver() -> Any:
    try:
        import psycopg
    except ImportError:  # the optional extra is not installed
        raise LedgerError("a postgresql:// ledger needs psycopg 3: pip install 'pagewire[postgres]'") from None
    return psycopg


async def migrate(conn: Any) -> int:
    """Bring the schema to SCHEMA_VERSION in one transaction under an advisory lock (two replicas
    starting together migrate once); refuse a newer database. Returns the version found."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        await conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        cur = await conn.execute("SELECT version FROM schema_version")
        row = await cur.fetchone()
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise LedgerError(
                f"ledger schema version {version} is newer than this pagewire understands "
                f"({SCHEMA_VERSION}); use a newer pagewire or another --db")
        for v in range(version, SCHEMA_VERSION):
            await conn.execute(pg_migration(MIGRATIONS[v]))  # several statements, no parameters
        if row is None:
            await conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (SCHEMA_VERSION,))
        elif version < SCHEMA_VERSION:
            await conn.execute("UPDATE schema_version SET version = %s", (SCHEMA_VERSION,))
    return version


class LedgerUnavailable(LedgerWriteError):
    """A read could not reach the database (503 `ledger_unavailable`, like a failed write)."""


class PgLedger(Ledger):
    """`Ledger` over PostgreSQL. Create with `await PgLedger.open(url, name=...)`."""

    shared = True

    def __init__(self, url: str, pool: Any, writer: Any, name: str, lease_s: float,
                 commit_timeout_s: float) -> None:
        super().__init__(None, writer, None)
        self.url = url
        self.instance_name = name
        self._pool = pool
        self.lease_s = lease_s
        self.commit_timeout_s = commit_timeout_s
        self.read_timeout_s = commit_timeout_s
        self.lease_lost = 0  # renewals that found the lease lapsed (then it re-registers)
        self.swept = 0  # rows of dead replicas this one interrupted
        self._lease_task: Optional[asyncio.Task[None]] = None
        self.on_tick: list[Any] = []  # async callables run after each renewal (batch pick-up)

    @classmethod
    async def open(cls, url: str, name: str = "", lease_s: float = 10.0,  # type: ignore[override]
                   commit_timeout_s: float = 5.0, pool_size: int = 4) -> "PgLedger":
        """Connect, migrate, register this replica's instance and sweep dead replicas' rows."""
        psycopg = _driver()
        from psycopg_pool import AsyncConnectionPool

        try:
            writer = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=5)
        except psycopg.Error as e:
            raise LedgerError(f"ledger: cannot connect to PostgreSQL: {e}") from None
        try:
            await migrate(writer)
        except BaseException:
            await writer.close()
            raise
        pool = AsyncConnectionPool(url, min_size=1, max_size=pool_size, open=False, timeout=commit_timeout_s,
                                   kwargs={"autocommit": True, "connect_timeout": 5},
                                   check=AsyncConnectionPool.check_connection, reconnect_timeout=0)
        await pool.open(wait=True, timeout=commit_timeout_s)
        ledger = cls(url, pool, writer, name, lease_s, commit_timeout_s)
        ledger.instance_name = name or ledger.instance_id
        await writer.execute(
            f"INSERT INTO instances (instance_id, name, started_at, lease_until) VALUES (%s, %s, {NOW}, {NOW} + %s)",
            (ledger.instance_id, ledger.instance_name, lease_s))
        ledger.interrupted_at_start = await ledger.sweep_dead()
        if ledger.interrupted_at_start:
            log.warning("ledger: %d request(s) left open by replicas whose lease lapsed are now 'interrupted'",
                        ledger.interrupted_at_start)
        ledger._lease_task = asyncio.get_running_loop().create_task(ledger._renew_loop(), name="ledger-lease")
        return ledger

    # -- leases ---------------------------------------------------------------------------------
    async def sweep_dead(self) -> int:
        """Interrupt the open rows of replicas whose lease lapsed (never a live one's); release
        their quota holds. Returns how many rows it interrupted."""
        async with self._conn() as c:
            async with c.transaction():
                cur = await c.execute(SWEEP_SQL, (INTERRUPTED_MESSAGE,))
                n = int(cur.rowcount)
                await c.execute(SWEEP_HOLDS_SQL)
                # Lapsed instances stay an hour so that messages can still name them.
                await c.execute(f"DELETE FROM instances WHERE lease_until < {NOW} - 3600")
        self.swept += n
        if n:
            log.warning("ledger: interrupted %d request(s) of replicas whose lease lapsed", n)
        return n

    async def _renew_loop(self) -> None:
        period = self.lease_s / 4
        while not self._closed:
            await asyncio.sleep(period)
            try:
                # Bounded: a paused network must not stall the renewals for good.
                await bounded(self.renew(), self.commit_timeout_s)
                await bounded(self.sweep_dead(), self.commit_timeout_s)
                for hook in list(self.on_tick):
                    await hook()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the database is away: the next tick tries again
                log.warning("ledger: lease renewal failed: %s", e)

    async def renew(self) -> None:
        async with self._conn() as c:
            cur = await c.execute(
                f"UPDATE instances SET lease_until = {NOW} + %s WHERE instance_id = %s AND lease_until >= {NOW}",
                (self.lease_s, self.instance_id))
            if cur.rowcount == 1:
                return
            # Lapsed (the database was unreachable for longer than the lease): survivors may have
            # interrupted this replica's open rows. Register again so new requests are covered.
            self.lease_lost += 1
            log.error("ledger: this replica's lease (%s) had lapsed; its open rows may have been interrupted "
                      "by another replica; registering again", self.instance_id)
            await c.execute(
                f"INSERT INTO instances (instance_id, name, started_at, lease_until) VALUES (%s, %s, {NOW}, "
                f"{NOW} + %s) ON CONFLICT (instance_id) DO UPDATE SET lease_until = excluded.lease_until",
                (self.instance_id, self.instance_name, self.lease_s))

    async def instance_label(self, instance_id: Optional[str]) -> str:
        if not instance_id:
            return "unknown"
        rows = await self.query("SELECT name FROM instances WHERE instance_id = ?", (instance_id,))
        return f"{rows[0][0]} ({instance_id})" if rows else instance_id

    async def is_live(self, instance_id: str) -> bool:
        return bool(await self.query(
            f"SELECT 1 FROM instances WHERE instance_id = ? AND lease_until >= {NOW}", (instance_id,)))

    # -- writes ---------------------------------------------------------------------------------
    async def insert(self, req: NewRequest) -> None:
        """The `queued` row, committed. `ON CONFLICT DO NOTHING`: the unique constraint decides, and
        an insert that lost to a committed key reports it as a rowcount of 0, so it needs no
        savepoint and can share a pipelined batch."""
        sql, args = self._insert_op(req)
        fut = self._enqueue(sql + " ON CONFLICT DO NOTHING", args, wait=True)
        assert fut is not None
        if await fut == 0:
            raise IdempotencyConflict(f"idempotency key {req.idempotency_key!r} is taken")

    async def _reconnect(self) -> Any:
        if self._writer is None or self._writer.closed:
            self._writer = await _driver().AsyncConnection.connect(self.url, autocommit=True, connect_timeout=5)
        return self._writer

    async def _commit(self, batch: list[_Op]) -> None:
        try:
            await bounded(self._commit_batch(batch), self.commit_timeout_s)
        except BaseException as exc:
            # The whole batch is lost or its outcome unknown (a timeout): tell every waiter and
            # drop the connection (its state is unknown); the next batch reconnects.
            timed_out = isinstance(exc, asyncio.TimeoutError)
            what = (f"ledger commit did not answer within {self.commit_timeout_s:g}s (outcome unknown; "
                    "retry with the same idempotency key)") if timed_out else f"ledger commit failed: {exc}"
            self.write_error = what
            self.failed_commits += 1
            log.error("%s", what)
            w, self._writer = self._writer, None
            if w is not None:
                with contextlib.suppress(Exception):
                    await w.close()
            for op in batch:
                if op.future is not None and not op.future.done():
                    op.future.set_exception(LedgerWriteError(what))
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _commit_batch(self, batch: list[_Op]) -> None:
        psycopg = _driver()
        conn = await self._reconnect()
        # Errors that belong to one statement, not to the database: the statement fails alone
        # (as under SQLite's ABORT rule) and the rest of the batch commits.
        own = (psycopg.IntegrityError, psycopg.DataError, psycopg.ProgrammingError)
        try:
            # The common case: BEGIN, every statement and COMMIT sent in one pipeline (libpq's
            # pipeline mode), answered together: one round trip per batch, not per statement.
            results = await self._run_pipelined(conn, batch)
        except own:
            # A statement failed, which aborts the transaction: run the batch again with every
            # statement in a SAVEPOINT of its own, so only the culprit fails.
            results = await self._run_batch(conn, batch, own, every_savepoint=True)
        self.commits += 1
        self.write_error = None
        for op, (err, n) in zip(batch, results):
            if op.future is not None and not op.future.done():
                if err is None:
                    op.future.set_result(n)
                else:
                    op.future.set_exception(err)

    async def _run_pipelined(self, conn: Any, batch: list[_Op]) -> list[tuple[Optional[BaseException], int]]:
        curs = []
        async with conn.pipeline():
            async with conn.transaction():
                for op in batch:
                    curs.append(await conn.execute(pg_sql(op.sql), tuple(_no_nul(a) for a in op.args)))
        return [(None, int(c.rowcount)) for c in curs]

    async def _run_batch(self, conn: Any, batch: list[_Op], own: tuple[type[BaseException], ...],
                         every_savepoint: bool) -> list[tuple[Optional[BaseException], int]]:
        results: list[tuple[Optional[BaseException], int]] = []
        async with conn.transaction():
            for op in batch:
                sql, args = pg_sql(op.sql), tuple(_no_nul(a) for a in op.args)
                if not every_savepoint and not sql.lstrip().upper().startswith("INSERT"):
                    cur = await conn.execute(sql, args)
                    results.append((None, int(cur.rowcount)))
                    continue
                try:
                    async with conn.transaction():  # SAVEPOINT: a failure undoes only this statement
                        cur = await conn.execute(sql, args)
                    results.append((None, int(cur.rowcount)))
                except own as e:
                    results.append((e, 0))
                    if op.future is None:
                        log.error("ledger write failed: %s (%s)", e, op.sql.split(" ")[0])
        return results

    async def interrupt_open(self, reason: str) -> None:
        """At the end of this replica's drain: its own open rows (never another replica's) become
        `interrupted`, after its owed terminal writes (same FIFO)."""
        owed = [self._finish_op(rid, t) for rid, t in list(self._owed.items())]
        fut = self._enqueue(
            f"UPDATE requests SET state = '{LedgerState.INTERRUPTED.value}', finished_at = ?, "
            f"error = COALESCE(error, ?) WHERE state IN ({_OPEN}) AND instance_id = ?",
            (time.time(), reason, self.instance_id), wait=True)
        assert fut is not None
        if owed:
            results = await asyncio.gather(*owed, return_exceptions=True)
            if not any(isinstance(r, BaseException) for r in results):
                self._owed.clear()
        await fut

    async def claim_batch_line(self, batch_id: str, line_no: int, attempt: int) -> bool:
        """Take a batch line for this replica: a pending one, or a running one whose owner's lease
        lapsed (that owner's rows are swept in the same transaction, so the line's interrupted
        attempt is seen as such). False when a live replica holds it."""
        async with self._conn() as c:
            async with c.transaction():
                await c.execute(SWEEP_SQL, (INTERRUPTED_MESSAGE,))
                cur = await c.execute(
                    "UPDATE batch_lines SET status = 'running', attempt = %s, lease_owner = %s "
                    "WHERE batch_id = %s AND line_no = %s AND (status = 'pending' OR (status = 'running' AND "
                    f"(lease_owner IS NULL OR lease_owner = %s OR lease_owner NOT IN ({live_instances_sql()}))))",
                    (attempt, self.instance_id, batch_id, line_no, self.instance_id))
                return cur.rowcount == 1

    # -- reads ----------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _conn(self) -> AsyncIterator[Any]:
        """A pooled connection; an unreachable database is 503 `ledger_unavailable`."""
        psycopg = _driver()
        from psycopg_pool import PoolTimeout

        try:
            async with self._pool.connection(timeout=self.read_timeout_s) as c:
                yield c
        except (PoolTimeout, psycopg.OperationalError, psycopg.InterfaceError) as e:
            raise LedgerUnavailable(f"ledger database unreachable: {e}") from None

    async def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        async def run() -> list[tuple[Any, ...]]:
            async with self._conn() as c:
                cur = await c.execute(pg_sql(sql), tuple(_no_nul(a) for a in args))
                return [tuple(r) for r in await cur.fetchall()]
        try:
            return await bounded(run(), self.read_timeout_s)
        except asyncio.TimeoutError:
            raise LedgerUnavailable(f"ledger read did not answer within {self.read_timeout_s:g}s") from None

    async def get(self, request_id: str) -> Optional[RequestRecord]:
        rows = await self.query(f"SELECT {COLUMNS} FROM requests WHERE request_id = ?", (request_id,))
        return RequestRecord.from_row(rows[0]) if rows else None

    async def find_by_idempotency_key(self, key: str) -> Optional[RequestRecord]:
        rows = await self.query(f"SELECT {COLUMNS} FROM requests WHERE idempotency_key = ?", (key,))
        return RequestRecord.from_row(rows[0]) if rows else None

    def day_sql(self, column: str) -> str:
        return f"to_char(to_timestamp({column}) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"

    @contextlib.asynccontextmanager
    async def key_lock(self, key_id: str) -> AsyncIterator["KeyTx"]:
        """A transaction holding the key's advisory lock: every replica's reservations for one
        key run one at a time (server.gateway.quota_db)."""
        async with self._conn() as c:
            async with c.transaction():
                # Visibility, not durability, is what makes the hold count on every replica: it is
                # visible to the next transaction as soon as it commits, whether or not its WAL
                # has reached the disk. So this commit does not wait for the WAL flush (the
                # request's own row, inserted next by the writer, does). A database crash can
                # forget holds of requests in flight; their rows then count what they cost.
                await c.execute("SET LOCAL synchronous_commit TO OFF")
                await c.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"pagewire-quota:{key_id}",))
                yield KeyTx(c)

    async def close(self) -> None:
        if self._closed:
            return
        if self._lease_task is not None:
            self._lease_task.cancel()
            with contextlib.suppress(BaseException):
                await self._lease_task
        await super().close()  # flushes queued writes; closes the writer
        with contextlib.suppress(Exception):
            async with self._pool.connection(timeout=2) as c:
                # Gone cleanly (its drain interrupted its rows): its lease ends now.
                await c.execute(f"UPDATE instances SET lease_until = {NOW} - 1 WHERE instance_id = %s",
                                (self.instance_id,))
        await self._pool.close()

    async def _close_connections(self) -> None:
        if self._writer is not None:
            await self._writer.close()


class KeyTx:
    """Reads and writes inside `PgLedger.key_lock`'s transaction (shared SQL, `?` placeholders)."""

    def __init__(self, conn: Any) -> None:
        self._c = conn

    async def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        cur = await self._c.execute(pg_sql(sql), tuple(_no_nul(a) for a in args))
        return [tuple(r) for r in await cur.fetchall()]

    async def execute(self, sql: str, args: tuple[Any, ...] = ()) -> int:
        cur = await self._c.execute(pg_sql(sql), tuple(_no_nul(a) for a in args))
        return int(cur.rowcount)
