"""Ledger schema v5: files and batches record their owning key. A v4 ledger (batch tier, no owners)
is migrated in place, its rows kept and read as the admin's (owner NULL); the file store and the
batch manager give another key the same 404 as an unknown id, and the admin sees everything."""
from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from server.gateway.auth import ADMIN_ID, Principal
from server.serving.batch import BatchManager
from server.serving.errors import NotFound
from server.serving.files import FileStore
from server.serving.ledger import Ledger
from server.serving.schema import MIGRATIONS, SCHEMA_VERSION

ALICE = Principal("pw-aaaaaaaaaaaa")
BOB = Principal("pw-bbbbbbbbbbbb")
ADMIN = Principal(ADMIN_ID, admin=True)


def _v4_ledger(db: Path) -> None:
    c = sqlite3.connect(db)
    c.executescript("CREATE TABLE schema_version (version INTEGER NOT NULL); INSERT INTO schema_version VALUES (4);"
                    + ";".join(MIGRATIONS[:4]))
    c.execute("INSERT INTO files (file_id, purpose, filename, bytes, created_at) VALUES "
              "('file-old', 'batch', 'old.jsonl', 3, 1.0)")
    c.execute("INSERT INTO batches (batch_id, input_file_id, endpoint, completion_window, status, created_at, "
              "completed_at, total, completed) VALUES ('batch_old', 'file-old', '/v1/completions', '24h', "
              "'completed', 1.0, 2.0, 1, 1)")
    c.commit()
    c.close()


def _manager(ledger: Ledger, files: FileStore) -> BatchManager:
    def unused(*args: Any) -> Any:
        raise AssertionError("no line runs in this test")

    return BatchManager(ledger, files, unused, unused, unused, unused, concurrency=1)  # type: ignore[arg-type]


def test_a_v4_ledger_migrates_and_files_and_batches_are_owned_per_key(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    _v4_ledger(db)
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "file-old").write_bytes(b"{}\n")

    async def run() -> None:
        ledger = await Ledger.open(db)
        try:
            files = FileStore(ledger, tmp_path / "files")
            manager = _manager(ledger, files)
            # The v4 rows survive, unowned: the admin's (and everyone's with auth off), no key's.
            old = await manager.get("batch_old", ADMIN)
            assert (old.status, old.completed, old.key_id) == ("completed", 1, None)
            assert (await files.get("file-old", who=None)).key_id is None
            with pytest.raises(NotFound):
                await manager.get("batch_old", ALICE)
            with pytest.raises(NotFound):
                await files.content("file-old", ALICE)

            mine = await files.upload("batch", "a.jsonl", b'{"x": 1}\n', key_id=ALICE.key_id)
            assert (await files.get(mine.file_id, who=ALICE)).key_id == ALICE.key_id
            assert await files.content(mine.file_id, ADMIN) == b'{"x": 1}\n'
            with pytest.raises(NotFound) as other:
                await files.content(mine.file_id, BOB)
            with pytest.raises(NotFound) as unknown:
                await files.content("file-" + "0" * 24, BOB)
            # Word for word what an unknown id gets, so ids leak nothing.
            assert str(other.value).replace(mine.file_id, "ID") == str(unknown.value).replace("file-" + "0" * 24, "ID")
            # Bob cannot build a batch on Alice's file; the refusal names the field like an unknown id.
            with pytest.raises(NotFound) as e:
                await manager.create(mine.file_id, "/v1/completions", "24h", None, BOB)
            assert e.value.param == "input_file_id"
            # Rows written directly (the manager would start running them): one batch per key.
            for bid, owner in (("batch_a", ALICE.key_id), ("batch_b", BOB.key_id)):
                await ledger.execute(
                    "INSERT INTO batches (batch_id, input_file_id, endpoint, completion_window, status, created_at, "
                    "key_id) VALUES (?, ?, '/v1/completions', '24h', 'completed', 5.0, ?)", (bid, mine.file_id, owner))
            assert [b.batch_id for b in await manager.list_batches(10, None, ALICE)] == ["batch_a"]
            assert [b.batch_id for b in await manager.list_batches(10, None, BOB)] == ["batch_b"]
            assert {b.batch_id for b in await manager.list_batches(10, None, ADMIN)} == {"batch_a", "batch_b",
                                                                                        "batch_old"}
            assert len(await manager.list_batches(10, None, None)) == 3  # authentication off
            with pytest.raises(NotFound):
                await manager.cancel("batch_a", BOB)
            assert (await manager.cancel("batch_a", ALICE)).status == "completed"  # already over: unchanged
        finally:
            await ledger.close()

    asyncio.run(run())
    c = sqlite3.connect(db)
    try:
        assert c.execute("SELECT version FROM schema_version").fetchone()[0] == SCHEMA_VERSION == 9
        assert {r[1] for r in c.execute("PRAGMA table_info(batches)")} >= {"key_id"}
    finally:
        c.close()
