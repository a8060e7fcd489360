"""Bug 2 and bug 11: one server per ledger (a second one refuses to start, naming the file and the
holder's PID; a crash frees the lock), and the ledger's folder and files are private (0700/0600)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.harness import FAST_ENGINE, REPO, ServerProcess, free_port, ledger_rows

# The SQLite ledger's lock file and file modes; PostgreSQL replicas share one database by design
# (tests/scaleout).
pytestmark = pytest.mark.sqlite_only


def _second_server(demo_model: Path, db: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "server.cli", "serve", str(demo_model), "--port", str(free_port()),
           "--db", str(db), "--log-level", "warning", *FAST_ENGINE]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


# Issue 29, break 1: the second server may name the live ledger through a symlink or a hard link
# (another name of the same file); it must be refused as for the same name, before its start-up
# sweep marks the first server's running rows `interrupted`.
@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_second_server_on_the_same_ledger_refuses_and_the_first_keeps_its_rows(demo_model: Path,
                                                                              tmp_path: Path, how: str) -> None:
    import contextlib

    db = tmp_path / "shared.db"
    first = ServerProcess(demo_model, db).start()
    other = tmp_path / "elsewhere" / "alias.db"  # another folder: no sidecar name in common
    other.parent.mkdir()
    if how == "symlink":
        other.symlink_to(db)
    elif how == "hardlink":
        os.link(db, other)
    else:
        other = db
    try:
        # Live requests of the first server, still open while the second one tries to start. One
        # long request alone can finish before a refused start does (the demo model writes
        # thousands of tokens a second on a quiet machine), so sixteen of them queue behind the KV
        # budget: far more work than a refused start takes, checked below, not assumed.
        body = {"model": "demo", "prompt": "live", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as c, contextlib.ExitStack() as streams:
            rs = [streams.enter_context(c.stream("POST", first.base + "/v1/completions", json=body))
                  for _ in range(16)]
            assert all(r.status_code == 200 for r in rs)
            rid = rs[0].headers["x-request-id"]
            lines = rs[0].iter_lines()
            first_chunk = next(ln for ln in lines if ln.startswith("data: "))
            assert first_chunk
            try:
                second = _second_server(demo_model, other)
            except subprocess.TimeoutExpired:  # it started serving instead of refusing
                states = [r_["state"] for r_ in ledger_rows(db).values()]
                pytest.fail(f"a second server on the {how} name of a live ledger started; rows now {states}")
            assert second.returncode != 0
            # A symlink is named by the file it resolves to; a hard link is its own real path.
            assert str(other if how == "hardlink" else db) in second.stderr, second.stderr
            assert f"process {first.proc.pid}" in second.stderr, second.stderr  # type: ignore[union-attr]
            # The refused server did not sweep the first one's live rows into `interrupted`, and
            # some were still open after it had exited (so the check means something).
            states = [r_["state"] for r_ in ledger_rows(db).values()]
            assert len(states) == 16 and "interrupted" not in states, states
            assert {"queued", "running"} & set(states), states
            # The first server still finishes its request. The other fifteen only had to be open
            # while the second server tried; closing them (a client going away cancels its
            # request) lets this one finish alone instead of behind 30,000 tokens of theirs.
            for r in rs[1:]:
                r.close()
            for _line in lines:
                pass
            row = ledger_rows(db)[rid]
            assert row["state"] == "finished" and row["completion_tokens"] == 2000
    finally:
        first.stop()


def test_sigkill_frees_the_ledger_lock(demo_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "crash.db"
    first = ServerProcess(demo_model, db).start()
    first.kill()  # SIGKILL: no clean-up runs; the kernel drops the flock with the process
    try:
        again = ServerProcess(demo_model, db).start()
    finally:
        first.stop()
    try:
        assert httpx.get(again.base + "/health").status_code == 200
        assert (db.parent / (db.name + ".lock")).read_text().strip() == str(again.proc.pid)  # type: ignore[union-attr]
    finally:
        again.stop()


def test_ledger_lock_in_process_names_the_holder(tmp_path: Path) -> None:
    from server.serving.db_lock import LedgerLock, LedgerLocked

    db = tmp_path / "x.db"
    held = LedgerLock.acquire(db)
    try:
        with pytest.raises(LedgerLocked) as info:
            LedgerLock.acquire(db)
        assert info.value.pid == os.getpid() and str(db) in str(info.value)
    finally:
        held.release()
    LedgerLock.acquire(db).release()  # free again once released


def test_a_new_ledger_is_private(demo_model: Path, tmp_path: Path) -> None:
    db = tmp_path / "fresh" / "nested" / "ledger.db"
    old = os.umask(0o022)  # the usual umask, which alone would give 0755 folders and 0644 files
    try:
        srv = ServerProcess(demo_model, db)
        srv.log_path = tmp_path / "server.log"  # the log must not create the ledger's folder
        srv.start()
    finally:
        os.umask(old)
    try:
        r = httpx.post(srv.base + "/v1/completions", json={"model": "demo", "prompt": "p", "max_tokens": 2})
        assert r.status_code == 200
        assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE((tmp_path / "fresh").stat().st_mode) == 0o700
        for f in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm"),
                  db.with_name(db.name + ".lock")):
            assert f.exists(), f
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, (f, oct(f.stat().st_mode))
    finally:
        srv.stop()
    assert ledger_rows(db)


# Issue 29, break 1: the lock is on the file, not the name. A symlink or a hard link to a live
# server's ledger is the same ledger; a second server on it would sweep the first one's rows.
@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_ledger_lock_covers_other_names_of_the_same_file(tmp_path: Path, how: str) -> None:
    from server.serving.db_lock import LedgerLock, LedgerLocked

    db = tmp_path / "real" / "ledger.db"
    held = LedgerLock.acquire(db)  # creates the (empty) database file, 0600
    other_dir = tmp_path / "elsewhere"
    other_dir.mkdir()
    link = other_dir / "alias.db"
    if how == "symlink":
        link.symlink_to(db)
    else:
        os.link(db, link)
    try:
        with pytest.raises(LedgerLocked) as info:
            LedgerLock.acquire(link)
        assert info.value.pid == os.getpid(), info.value  # named, even through a hard link
    finally:
        held.release()
    LedgerLock.acquire(link).release()  # free again once the first holder lets go


def test_second_server_on_a_symlink_to_a_live_ledger_refuses(demo_model: Path, tmp_path: Path) -> None:
    from server.serving.db_lock import LedgerLock

    db = tmp_path / "live.db"
    held = LedgerLock.acquire(db)  # stands in for the live server (the refusal comes before loading)
    link = tmp_path / "link.db"
    link.symlink_to(db)
    try:
        second = _second_server(demo_model, link)
        assert second.returncode != 0
        assert f"process {os.getpid()}" in second.stderr, second.stderr
        assert str(db) in second.stderr, second.stderr  # the real path is named
    finally:
        held.release()
