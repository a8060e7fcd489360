"""The ledger's contract on both backends (SQLite file, real PostgreSQL): commit before ack,
group commit, FIFO order of one request's writes, the unique constraint deciding idempotency,
the shared SQL of the gateway's tables, schema version, batch line claims; and, on PostgreSQL,
instance leases: a replica's rows are interrupted only when its own lease lapsed."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from server.serving.ledger import SCHEMA_VERSION, IdempotencyConflict, NewRequest, Terminal
from tests.scaleout.conftest import open_ledger


def _req(rid: str, key: Any = None, created: float = 0.0) -> NewRequest:
    return NewRequest(request_id=rid, kind="completion", api="http", client="c", model="m", priority=0,
                      params={"max_tokens": 4}, prompt="hi", prompt_tokens=2, created_at=created or time.time(),
                      idempotency_key=key, key_id="pw-aaaaaaaaaaaa")


def _term(n: int) -> Terminal:
    return Terminal(state="finished", finish_reason="length", error=None, prompt_tokens=2, completion_tokens=n,
                    cached_tokens=0, output_text="x" * n, output={"samples": [], "last_seq": n},
                    first_token_at=time.time(), finished_at=time.time())


def test_commit_group_commit_and_order(db_spec: str) -> None:
    async def main() -> None:
        led = await open_ledger(db_spec)
        try:
            before = led.commits
            await asyncio.gather(*[led.insert(_req(f"r{i}")) for i in range(20)])
            # 20 inserts queued together: far fewer commits than inserts (group commit).
            assert led.commits - before < 20
            for i in range(20):  # fire-and-forget, then the awaited terminal write: FIFO order
                led.mark_running(f"r{i}", time.time())
                led.mark_progress(f"r{i}", 3)
            await asyncio.gather(*[led.finish(f"r{i}", _term(4)) for i in range(20)])
            rec = await led.get("r7")
            assert rec is not None and rec.state == "finished" and rec.completion_tokens == 4
            assert rec.admitted_at is not None and rec.instance_id == led.instance_id
            assert rec.params == {"max_tokens": 4} and rec.prompt == "hi"
            rows = await led.query("SELECT version FROM schema_version")
            assert rows == [(SCHEMA_VERSION,)]
        finally:
            await led.close()
    asyncio.run(main())


def test_unique_constraint_decides_idempotency(db_spec: str) -> None:
    async def main() -> None:
        led = await open_ledger(db_spec)
        try:
            await led.insert(_req("first", key="k1"))
            with pytest.raises(IdempotencyConflict):
                await led.insert(_req("second", key="k1"))
            # The failed insert undid only itself: a write queued beside it still committed.
            res = await asyncio.gather(led.insert(_req("third", key="k1")), led.insert(_req("fourth", key="k2")),
                                       return_exceptions=True)
            assert isinstance(res[0], IdempotencyConflict) and res[1] is None
            assert (await led.find_by_idempotency_key("k1")).request_id == "first"  # type: ignore[union-attr]
            assert await led.get("fourth") is not None and await led.get("second") is None
        finally:
            await led.close()
    asyncio.run(main())


def test_gateway_tables_through_shared_sql(db_spec: str, tmp_path: Any) -> None:
    from server.gateway.usage import usage_report
    from server.serving.files import FileStore

    async def main() -> None:
        led = await open_ledger(db_spec)
        try:
            store = FileStore(led, tmp_path / "files" if led.path is not None else None)
            rec = await store.upload("batch", "in.jsonl", b'{"a": 1}\n')
            await store.write("batch_output", "in.jsonl", b"second\n", file_id=rec.file_id)  # upsert
            assert await store.content(rec.file_id) == b"second\n"
            assert (await store.get(rec.file_id)).bytes == len(b"second\n")
            await led.insert(_req("u1", created=86400 * 20000 + 5))
            led.mark_running("u1", time.time())
            await led.finish("u1", _term(5))
            day = await usage_report(led, None, None, "day", None)
            assert day == [{"day": "2024-10-04", "requests": 1, "prompt_tokens": 2, "completion_tokens": 5,
                            "reasoning_tokens": 0, "cached_tokens": 0, "billable_tokens": 7}]
            n = await led.execute("UPDATE requests SET client = ? WHERE request_id = ?", ("z", "u1"))
            assert n == 1
        finally:
            await led.close()
    asyncio.run(main())


def test_batch_line_claim(db_spec: str) -> None:
    async def main() -> None:
        led = await open_ledger(db_spec)
        try:
            await led.execute("INSERT INTO batch_lines (batch_id, line_no, custom_id, status) VALUES (?, ?, ?, ?)",
                              ("b", 0, "c0", "pending"))
            assert await led.claim_batch_line("b", 0, 0)
            await led.execute("UPDATE batch_lines SET status = 'done' WHERE batch_id = 'b'")
            assert not await led.claim_batch_line("b", 0, 1)  # a finished line is never taken again
        finally:
            await led.close()
    asyncio.run(main())


def test_replicas_interrupt_only_lapsed_leases(pg_url: str) -> None:
    """Two replicas on one database: a live one's open rows survive the other's start and sweeps;
    once a replica stops renewing, a survivor interrupts its rows (and only them) when its lease lapses."""
    async def main() -> None:
        a = await open_ledger(pg_url, lease_s=1.0)
        await a.insert(_req("a-open"))
        b = await open_ledger(pg_url, lease_s=1.0)
        try:
            assert b.interrupted_at_start == 0
            await b.insert(_req("b-open"))
            assert await b.sweep_dead() == 0
            assert (await b.get("a-open")).state == "queued"  # type: ignore[union-attr]
            # `a` dies without a word: its renewals stop (no drain, no close).
            assert a._lease_task is not None
            a._lease_task.cancel()
            while await b.is_live(a.instance_id):
                await asyncio.sleep(0.05)
            await b.sweep_dead()  # b's own renewal loop may have swept first: either did it once
            assert b.swept == 1
            assert (await b.get("a-open")).state == "interrupted"  # type: ignore[union-attr]
            assert (await b.get("b-open")).state == "queued"  # type: ignore[union-attr]
            # A drain interrupts only its own rows.
            await b.interrupt_open("drained")
            assert (await b.get("b-open")).state == "interrupted"  # type: ignore[union-attr]
            assert (await b.instance_label(a.instance_id)).startswith("test")
        finally:
            await b.close()
            await a.close()
    asyncio.run(main())
