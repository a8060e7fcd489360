"""FileStore limits: an upload over the size or line limit is refused naming the file; a stored file is
complete on disk and recorded in the ledger."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.serving.errors import InvalidRequest, NotFound, TooLarge
from server.serving.files import FileLimits, FileStore
from server.serving.ledger import Ledger


def test_upload_limits_and_storage(tmp_path: Path) -> None:
    async def run() -> None:
        ledger = await Ledger.open(tmp_path / "l.db")
        try:
            store = FileStore(ledger, tmp_path / "files", FileLimits(max_bytes=64, max_lines=2))
            with pytest.raises(TooLarge, match="'big.jsonl'"):
                await store.upload("batch", "big.jsonl", b"{}\n" * 30)
            with pytest.raises(InvalidRequest, match="3 lines, over the limit of 2") as e:
                await store.upload("batch", "many.jsonl", b"{}\n{}\n{}\n")
            assert e.value.param == "file"
            with pytest.raises(InvalidRequest, match="not UTF-8"):
                await store.upload("batch", "bin.jsonl", b"\xff\xfe")
            rec = await store.upload("batch", "ok.jsonl", b'{"a": 1}\n\n{"b": 2}\n')
            assert (await store.get(rec.file_id)) == rec
            assert await store.content(rec.file_id) == b'{"a": 1}\n\n{"b": 2}\n'
            assert (tmp_path / "files" / rec.file_id).stat().st_mode & 0o777 == 0o600
            with pytest.raises(NotFound):
                await store.get("file-missing")
        finally:
            await ledger.close()

    asyncio.run(run())
