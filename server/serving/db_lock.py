"""One server per ledger: an exclusive `flock` on a sidecar file next to the database.

A second `pagewire serve` on the same database would run its start-up sweep (open rows become
`interrupted`) over the first server's live requests, so it must refuse to start. The lock is a
kernel `flock` on `<db>.lock`: the kernel drops it when the holder's file descriptor closes,
which includes a crash or SIGKILL, so no stale lock is ever left behind. The holder writes its
PID into the file so the refusal can name it. SQLite's own locks cannot do this: WAL mode lets
many writers take turns on the same file, which is exactly what must not happen here.

The sidecar (and, when pagewire creates them, the database's folder and file) are private to the
user: the ledger holds prompts and outputs (see `secure_paths`).
"""
from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Optional

from server.serving.errors import LedgerError

FILE_MODE = 0o600
DIR_MODE = 0o700


class LedgerLocked(LedgerError):
    """Another live process holds the ledger's lock."""

    def __init__(self, db: Path, lock_path: Path, pid: Optional[int]) -> None:
        who = f"process {pid}" if pid is not None else "another process (PID unknown)"
        super().__init__(
            f"ledger {db} is in use by {who} (lock file {lock_path}); "
            "stop that server or pass another --db"
        )
        self.db = db
        self.lock_path = lock_path
        self.pid = pid


def lock_path_for(db: Path) -> Path:
    return db.with_name(db.name + ".lock")


def ensure_private_dir(folder: Path) -> None:
    """Create `folder` and each missing parent as 0700; leave existing folders' modes alone
    (the operator chose them)."""
    missing: list[Path] = []
    p = folder
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:  # created concurrently; not ours to change
            continue
        os.chmod(d, DIR_MODE)  # mkdir's mode is filtered by the umask; say it exactly


def create_private_file(path: Path) -> bool:
    """Create `path` empty with mode 0600 unless it exists. Returns True when it was created.

    Creating the database file ourselves before SQLite opens it is what fixes its mode: SQLite
    then gives its -wal and -shm files the same permissions as the database file.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        return False
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    return True


def secure_paths(db: Path) -> None:
    """Make the ledger's folder 0700 and file 0600 when pagewire is the one creating them."""
    ensure_private_dir(db.parent)
    create_private_file(db)


class LedgerLock:
    """Holds the exclusive lock for one database for the life of the process (or until release)."""

    def __init__(self, db: Path, fd: int, lock_path: Path) -> None:
        self.db = db
        self.path = lock_path
        self._fd: Optional[int] = fd

    @classmethod
    def acquire(cls, db: str | os.PathLike[str]) -> "LedgerLock":
        """Take the lock or raise LedgerLocked naming the holder's PID. Never blocks."""
        p = Path(db).expanduser().absolute()
        ensure_private_dir(p.parent)
        lp = lock_path_for(p)
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_pid(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LedgerLocked(p, lp, holder) from None
            raise LedgerError(f"ledger lock {lp}: {e.strerror}") from None
        # Ours now: record who holds it (the previous holder's PID may still be in the file).
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(p, fd, lp)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (closing the descriptor drops the flock). Idempotent. The file stays:
        deleting it would race with a newcomer that already opened it."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _read_pid(fd: int) -> Optional[int]:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None
