"""What a `--db` value (or `PAGEWIRE_DB`) names: an embedded SQLite file, or a PostgreSQL database.

Accepted forms:
- a path (`ledger.db`, `~/data/ledger.db`, `/var/lib/pagewire/ledger.db`): SQLite, as always;
- `sqlite:PATH` (also `sqlite://PATH` and `sqlite:///ABSOLUTE`): SQLite, spelled as a URL;
- `postgresql://…` or `postgres://…` (libpq's connection URI): PostgreSQL.

Anything else that is shaped like a URL (`mysql://…`, `postgresql:/typo`, `redis:host`) is an
error naming the supported schemes. Before this check existed, `--db postgresql://host/db` was
taken as a relative path and created a folder named `postgresql:`. A file whose first path
component contains a colon can still be named: `./name:with:colons.db` or `sqlite:name:with.db`.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit, urlunsplit

SQLITE_SCHEME = "sqlite"
POSTGRES_SCHEMES = ("postgresql", "postgres")
SCHEMES_HELP = "a file path, sqlite:PATH, postgresql://… or postgres://…"

# What RFC 3986 allows before the colon; two characters at least, so that nothing on this
# platform that is a plain relative path with a one-letter prefix is mistaken for a scheme.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):(.*)$", re.S)


def default_db_path() -> Path:
    """The single-box default: the user data dir's pagewire/ledger.db."""
    import platformdirs

    return Path(platformdirs.user_data_dir("pagewire")) / "ledger.db"


class DbSpecError(argparse.ArgumentTypeError, ValueError):
    """A `--db` value that names neither a file nor a supported database URL (argparse shows the
    message as it is; the environment path reports it as a ValueError naming the variable)."""


@dataclass(frozen=True)
class DbTarget:
    """A parsed `--db`: `kind` is "sqlite" (with `path`) or "postgresql" (with `url`)."""

    kind: str
    path: Optional[Path] = None
    url: Optional[str] = None

    @property
    def is_postgres(self) -> bool:
        return self.kind == "postgresql"

    def display(self) -> str:
        """For logs and messages: the path, or the URL with any password masked."""
        if self.path is not None:
            return str(self.path)
        assert self.url is not None
        return redact_url(self.url)

    def __str__(self) -> str:
        return self.display()


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = (parts.username or "") + ":***"
    return urlunsplit((parts.scheme, f"{user}@{netloc[-1]}", parts.path, parts.query, parts.fragment))


def parse_db(value: Optional[str], default: Optional[Path] = None) -> DbTarget:
    """The target a `--db` value names (None or empty: `default`, a SQLite file).

    Raises DbSpecError naming the supported schemes for anything URL-shaped that is not one."""
    if value is None or not value.strip():
        if default is None:
            default = default_db_path()
        return DbTarget("sqlite", path=default)
    text = value.strip()
    m = _SCHEME.match(text)
    if m is None or "/" in m.group(1):
        return DbTarget("sqlite", path=Path(text).expanduser())
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme == SQLITE_SCHEME:
        # sqlite:///abs → /abs; sqlite://rel → rel; sqlite:rel → rel (SQLAlchemy's and the plain forms).
        path = rest[2:] if rest.startswith("//") else rest
        if not path:
            raise DbSpecError(f"--db {value!r}: sqlite: needs a file path (sqlite:/path/to/ledger.db)")
        return DbTarget("sqlite", path=Path(path).expanduser())
    if scheme in POSTGRES_SCHEMES:
        if not rest.startswith("//"):
            raise DbSpecError(f"--db {value!r}: a PostgreSQL URL starts with {scheme}:// "
                              f"(e.g. postgresql://user@127.0.0.1:5432/pagewire); expected {SCHEMES_HELP}")
        return DbTarget("postgresql", url=text)
    raise DbSpecError(
        f"--db {redact_url(value)!r}: unsupported scheme {scheme!r}; expected {SCHEMES_HELP} "
        "(a file whose name has a colon can be given as ./NAME or sqlite:NAME)")


def check_db_value(text: str) -> str:
    """The serve option's parser: validate, keep the text (ServeSettings.db stays a string)."""
    parse_db(text)
    return text
