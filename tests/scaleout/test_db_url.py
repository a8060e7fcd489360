"""`--db` validation: a path or sqlite: keeps the SQLite ledger, postgresql:// selects PostgreSQL,
and anything else URL-shaped is an error naming the schemes, before anything is created."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.serving.db_url import DbSpecError, parse_db

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value, path", [
    ("ledger.db", "ledger.db"),
    ("/var/lib/pw/ledger.db", "/var/lib/pw/ledger.db"),
    ("sqlite:ledger.db", "ledger.db"),
    ("sqlite:///tmp/x/ledger.db", "/tmp/x/ledger.db"),
    ("./name:with:colons.db", "name:with:colons.db"),
    ("dir/sub:x.db", "dir/sub:x.db"),
])
def test_paths_are_sqlite(value: str, path: str) -> None:
    t = parse_db(value)
    assert t.kind == "sqlite" and t.path == Path(path)


@pytest.mark.parametrize("value", ["postgresql://pw@127.0.0.1:5432/pagewire", "postgres://127.0.0.1/db"])
def test_postgres_urls(value: str) -> None:
    t = parse_db(value)
    assert t.is_postgres and t.url == value and t.path is None


def test_password_is_masked_in_display() -> None:
    assert parse_db("postgresql://pw:secret@127.0.0.1/db").display() == "postgresql://pw:***@127.0.0.1/db"


@pytest.mark.parametrize("value", ["mysql://u@127.0.0.1/db", "postgresql:/typo", "redis:cache", "sqlite:"])
def test_other_schemes_are_refused_naming_the_supported_ones(value: str) -> None:
    with pytest.raises(DbSpecError) as e:
        parse_db(value)
    msg = str(e.value)
    assert value.split(":")[0] in msg
    assert "sqlite:" in msg or "postgresql://" in msg


@pytest.mark.parametrize("argv", [
    ["keys", "create", "--name", "a", "--db", "mysql://u@127.0.0.1/db"],
    ["requests", "list", "--db", "mariadb://127.0.0.1/x"],
    ["usage", "--db", "postgresql:/pagewire"],
    ["serve", "--demo-model", "--db", "mongodb://127.0.0.1/x"],
])
def test_cli_refuses_before_creating_anything(tmp_path: Path, argv: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PAGEWIRE_DB", None)
    r = subprocess.run([sys.executable, "-m", "server.cli", *argv], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "postgresql://" in r.stderr and "sqlite:" in r.stderr
    assert list(tmp_path.iterdir()) == []  # no `mysql:` folder, no ledger file


def test_env_variable_is_checked_too(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PAGEWIRE_DB": "oracle://127.0.0.1/x"}
    r = subprocess.run([sys.executable, "-m", "server.cli", "keys", "list"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "oracle" in r.stderr and "postgresql://" in r.stderr
    assert list(tmp_path.iterdir()) == []
