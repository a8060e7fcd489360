"""A PostgreSQL server that stops answering altogether (its processes stopped with SIGSTOP: the
connections stay open, nothing is reset, nothing is answered). The ledger's deadlines must still
hold: a commit fails with LedgerWriteError and a read with LedgerUnavailable within their
timeouts, and the ledger works again once the server does. Before the fix (issue 32) the commit
waited for as long as the server was stopped: `asyncio.wait_for` cancels a psycopg call and then
waits for it to end, and psycopg's cancellation asks the stopped server to cancel and waits for
its answer. That is what held test_steady_load's requests in `make test-postgres`."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import pytest

from server.serving.ledger import LedgerWriteError, NewRequest
from server.serving.ledger_pg import LedgerUnavailable, PgLedger
from tests.scaleout.postgres import PostgresServer


def _row(rid: str) -> NewRequest:
    return NewRequest(request_id=rid, kind="completion", api="http", client="c", model="m", priority=0,
                      params={"max_tokens": 4}, prompt="hi", prompt_tokens=2, created_at=time.time(),
                      idempotency_key=None, key_id=None)


def _server_pids(pg: PostgresServer) -> list[int]:
    """The postmaster (first line of postmaster.pid) and its children."""
    pm = int((pg.data / "postmaster.pid").read_text().split()[0])
    kids = subprocess.run(["pgrep", "-P", str(pm)], capture_output=True, text=True).stdout.split()
    return [pm, *map(int, kids)]


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def test_deadlines_hold_while_the_database_is_stopped(own_postgres: PostgresServer) -> None:
    if not (own_postgres.data / "postmaster.pid").exists():
        pytest.skip("no postmaster.pid to read the server's pid from")
    url = own_postgres.new_database()

    async def scenario() -> None:
        ledger = await PgLedger.open(url, name="stopped", commit_timeout_s=1.0)
        try:
            await ledger.insert(_row("req-before"))
            pids = _server_pids(own_postgres)
            _signal_all(pids, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(LedgerWriteError):
                    await ledger.insert(_row("req-while-stopped"))
                assert time.monotonic() - t0 < 1.0 + 4.0  # the commit deadline, not the stop
                t0 = time.monotonic()
                with pytest.raises(LedgerUnavailable):
                    await ledger.get("req-before")
                assert time.monotonic() - t0 < 1.0 + 4.0
            finally:
                _signal_all(_server_pids(own_postgres), signal.SIGCONT)
                _signal_all(pids, signal.SIGCONT)
            # The server answers again: the writer reconnects and the next commit lands.
            await ledger.insert(_row("req-after"))
            rec = await ledger.get("req-after")
            assert rec is not None and rec.state == "queued"
        finally:
            await asyncio.wait_for(ledger.close(), 60)

    asyncio.run(scenario())
