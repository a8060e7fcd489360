"""A real PostgreSQL for the tests: Debian's `postgresql` package, initdb into a temporary folder,
run as an unprivileged user (`nobody` when the tests run as root: PostgreSQL refuses root), on a
free loopback port, its socket in that folder. Started by fixtures, stopped after.

No mock stands in for it: every PostgreSQL test talks to this server through psycopg.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Optional

from tests.server.harness import free_port


def pg_bindir() -> Optional[Path]:
    """The newest installed PostgreSQL's bin folder (Debian: /usr/lib/postgresql/N/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    which = shutil.which("initdb")
    return Path(which).parent if which else None


def missing_reason() -> Optional[str]:
    if pg_bindir() is None:
        return "PostgreSQL is not installed (apt-get install postgresql; .ci/run and `make sysdeps` do)"
    try:
        import psycopg  # noqa: F401
        import psycopg_pool  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e '.[postgres]')"
    return None


class PostgresServer:
    def __init__(self, settings: tuple[str, ...] = ("fsync=off",)) -> None:
        bindir = pg_bindir()
        assert bindir is not None
        self.bindir = bindir
        self.settings = settings
        self.dir = Path(tempfile.mkdtemp(prefix="pagewire-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.user = "nobody" if os.geteuid() == 0 else None
        if self.user is not None:
            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "pagewire", "--auth=trust", "-E", "UTF8",
                  "--no-instructions")

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / tool), *args]
        if self.user is not None:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=300, cwd=self.dir)

    def start(self) -> "PostgresServer":
        opts = [f"-p {self.port}", f"-k {self.dir}", "-c listen_addresses=127.0.0.1",
                *(f"-c {s}" for s in self.settings)]
        r = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w", "-t", "120",
                      "-o", " ".join(opts), "start", check=False)
        if r.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {r.stdout}{r.stderr}\n{self.log()}")
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "120", "stop", check=False)

    def log(self) -> str:
        try:
            return (self.dir / "server.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://pagewire@127.0.0.1:{self.port}/{db}"

    def new_database(self) -> str:
        """A fresh, empty database on this server; its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def cleanup(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)
