"""One server per ledger: an exclusive `flock` on the database file itself, and on a sidecar.

A second `pagewire serve` on the same database would run its start-up sweep (open rows become
`interrupted`) over the first server's live requests, so it must refuse to start. The locks are
kernel `flock`s: the kernel drops them when the holder's file descriptor closes, which includes a
crash or SIGKILL, so no stale lock is ever left behind. SQLite's own locks cannot do this: WAL
mode lets many writers take turns on the same file, which is exactly what must not happen here.

"The same database" is the same file, not the same name: a symlink or a hard link to a live
server's ledger must be refused too. So the path is resolved (`realpath`) and the lock that
decides is an `flock` on the database file's own inode (its device and inode number), which every
name of the file shares. The sidecar `<realpath>.lock` is locked as well and holds the holder's
PID, so the refusal can name it (for a hard link under another name the PID comes from
/proc/locks, which lists each flock by device and inode).

Why an fd on the database file is safe beside SQLite: Linux `flock` and SQLite's POSIX record
locks are independent, but closing *any* descriptor of a file drops the process's POSIX locks on
it. So the descriptor is opened before SQLite opens the file and closed (`release`) only after
the ledger's connections are closed.

The sidecar (and, when pagewire creates them, the database's folder and file) are private to the
user: the ledger holds prompts and outputs (see `secure_paths`).
"""
from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Callable, Optional

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


def resolve(db: str | os.PathLike[str]) -> Path:
    """The database's real path: `~` expanded, absolute, every symlink followed."""
    return Path(os.path.realpath(Path(db).expanduser()))


class LedgerLock:
    """Holds the exclusive lock for one database for the life of the process (or until release)."""

    def __init__(self, db: Path, fd: int, lock_path: Path, db_fd: int) -> None:
        self.db = db
        self.path = lock_path
        self._fd: Optional[int] = fd
        self._db_fd: Optional[int] = db_fd

    @classmethod
    def acquire(cls, db: str | os.PathLike[str]) -> "LedgerLock":
        """Take the lock or raise LedgerLocked naming the holder's PID. Never blocks.

        Creates the database file (empty, 0600) when missing, so that its inode can be locked."""
        p = resolve(db)
        ensure_private_dir(p.parent)
        lp = lock_path_for(p)
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            _flock(fd, p, lp, holder=lambda: _read_pid(fd))
            # The sidecar only covers this name; the database's inode covers every name.
            create_private_file(p)
            db_fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(fd)
            raise
        try:
            st = os.fstat(db_fd)
            _flock(db_fd, p, lp, holder=lambda: _flock_holder(st.st_dev, st.st_ino))
        except BaseException:
            os.close(db_fd)
            os.close(fd)
            raise
        # Ours now: record who holds it (the previous holder's PID may still be in the file).
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(p, fd, lp, db_fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the locks (closing the descriptors drops the flocks). Idempotent. Call it only
        after this process's SQLite connections to the file are closed (see module). The sidecar
        stays: deleting it would race with a newcomer that already opened it."""
        if self._db_fd is not None:
            dfd, self._db_fd = self._db_fd, None
            os.close(dfd)
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _flock(fd: int, db: Path, lock_path: Path, holder: Callable[[], Optional[int]]) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise LedgerLocked(db, lock_path, holder()) from None
        raise LedgerError(f"ledger lock {lock_path}: {e.strerror}") from None


def _flock_holder(dev: int, ino: int, proc_locks: str = "/proc/locks") -> Optional[int]:
    """The PID holding an flock on (dev, ino), from /proc/locks (Linux); None when unknown.

    A line reads `1: FLOCK  ADVISORY  WRITE 1234 08:02:5678 0 EOF` (device as hex major:minor)."""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    try:
        with open(proc_locks, encoding="ascii", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want and parts[4].isdigit():
                    return int(parts[4])
    except OSError:
        pass
    return None


def _read_pid(fd: int) -> Optional[int]:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None
