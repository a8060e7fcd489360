"""Fixtures for the scale-out tests: a real PostgreSQL server per session (and one per test that
restarts it), a fresh database per test, and the ledger parametrised over both backends."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.scaleout.postgres import PostgresServer, missing_reason


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    server = PostgresServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def pg_url(postgres: PostgresServer) -> str:
    return postgres.new_database()


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A server of this test's own (the test may stop and restart it)."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    server = PostgresServer().start()
    yield server
    server.cleanup()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A --db value for each backend: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "ledger.db")
    return str(request.getfixturevalue("pg_url"))


async def open_ledger(db: str, **kw: Any) -> Any:
    """The ledger a server would open for `db` (server.serving.runtime's choice)."""
    from server.serving.db_url import parse_db

    t = parse_db(db)
    if t.is_postgres:
        from server.serving.ledger_pg import PgLedger

        assert t.url is not None
        return await PgLedger.open(t.url, name="test", **kw)
    from server.serving.ledger import Ledger

    return await Ledger.open(t.path)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from server.models.demo_model import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("pagewire-cache"))
