"""Uploaded and generated files (OpenAI's Files API subset): bytes under the data directory, metadata in the ledger.

A file is written to `<data dir>/files/<file_id>` through a temporary name, fsynced and renamed, and
only then recorded in the ledger's `files` table, so a recorded file is always complete on disk.
The data directory is the ledger database's folder. Purposes: `batch` (uploads: JSONL batch
input) and `batch_output` (a batch's output and error files, written by server.serving.batch).

Ownership: each file records the API key that uploaded it (an output file, its batch's key). A
key sees only its own files; another key's file id gets the same 404 as an unknown one, so ids
leak nothing. The admin, and everyone when authentication is off, sees all (`Caller.may_see`).
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from server.serving.access import Caller
from server.serving.errors import InvalidRequest, NotFound, TooLarge
from server.serving.ledger import Ledger

UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"


@dataclass(frozen=True)
class FileRecord:
    file_id: str
    purpose: str
    filename: str
    bytes: int
    created_at: float
    key_id: Optional[str] = None  # the owning API key (None: uploaded with authentication off)

    def to_json(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {"id": self.file_id, "object": "file", "bytes": self.bytes, "created_at": int(self.created_at),
                "filename": self.filename, "purpose": self.purpose, "status": "processed"}


@dataclass(frozen=True)
class FileLimits:
    max_bytes: int = 100 * 2**20
    max_lines: int = 50_000


class FileStore:
    """Files under `directory`, or, with `directory` None (a ledger shared by replicas that share
    no disk: PostgreSQL), their bytes in the ledger's `file_blobs` table, written in the same
    transaction as their metadata row, so every replica can read every file."""

    def __init__(self, ledger: Ledger, directory: Optional[Path], limits: FileLimits = FileLimits()) -> None:
        self.ledger = ledger
        self.dir = directory
        self.limits = limits
        if directory is not None:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        assert self.dir is not None
        return self.dir / file_id

    async def upload(self, purpose: str, filename: str, data: bytes, key_id: Optional[str] = None) -> FileRecord:
        """Check and store an upload; 400/413 naming the field or file when it is not acceptable."""
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequest(f"purpose: must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}",
                                 param="purpose")
        if len(data) > self.limits.max_bytes:
            raise TooLarge(f"file: {filename!r} is {len(data)} bytes, over the limit of {self.limits.max_bytes}")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequest(f"file: {filename!r} is not UTF-8 ({e})", param="file") from None
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if not lines:
            raise InvalidRequest(f"file: {filename!r} has no lines", param="file")
        if len(lines) > self.limits.max_lines:
            raise InvalidRequest(f"file: {filename!r} has {len(lines)} lines, over the limit of "
                                 f"{self.limits.max_lines}", param="file")
        return await self.write(purpose, filename, data, key_id=key_id)

    async def write(self, purpose: str, filename: str, data: bytes, file_id: Optional[str] = None,
                    key_id: Optional[str] = None) -> FileRecord:
        rec = FileRecord(file_id or f"file-{uuid.uuid4().hex[:24]}", purpose, filename, len(data), time.time(),
                         key_id)
        meta = ("INSERT INTO files (file_id, purpose, filename, bytes, created_at, key_id) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (file_id) DO UPDATE SET purpose = excluded.purpose, filename = excluded.filename, "
                "bytes = excluded.bytes, created_at = excluded.created_at, key_id = excluded.key_id",
                (rec.file_id, rec.purpose, rec.filename, rec.bytes, rec.created_at, rec.key_id))
        if self.dir is None:
            await self.ledger.execute_many([
                ("INSERT INTO file_blobs (file_id, content) VALUES (?, ?) "
                 "ON CONFLICT (file_id) DO UPDATE SET content = excluded.content", (rec.file_id, data)),
                meta])
            return rec
        await asyncio.get_running_loop().run_in_executor(None, self._write_bytes, rec.file_id, data)
        await self.ledger.execute(*meta)
        return rec

    def _write_bytes(self, file_id: str, data: bytes) -> None:
        assert self.dir is not None
        tmp = self.dir / f".{file_id}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path(file_id))

    async def get(self, file_id: str, param: str = "file_id", who: Optional[Caller] = None) -> FileRecord:
        """The file, if `who` may see it (None: no check, authentication off or the server itself)."""
        rows = await self.ledger.query(
            "SELECT file_id, purpose, filename, bytes, created_at, key_id FROM files WHERE file_id = ?", (file_id,))
        rec = FileRecord(*rows[0]) if rows else None
        if rec is None or (who is not None and not who.may_see(rec.key_id)):
            raise NotFound(f"{param}: no file {file_id!r}", param=param, code="file_not_found")
        return rec

    async def content(self, file_id: str, who: Optional[Caller] = None) -> bytes:
        await self.get(file_id, who=who)
        if self.dir is None:
            rows = await self.ledger.query("SELECT content FROM file_blobs WHERE file_id = ?", (file_id,))
            return bytes(rows[0][0])
        return await asyncio.get_running_loop().run_in_executor(None, self.path(file_id).read_bytes)
