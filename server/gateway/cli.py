"""`pagewire keys …` and `pagewire usage …`: key management and usage reports on the ledger file.

Keys and the ledger lock: a running server holds the ledger's exclusive lock (`db_lock`) because
its start-up sweep must be the only one. Key commands never sweep and touch only the `api_keys`
table, so they work either way:
- no server holds the ledger: the command takes the lock for its short run (so no server starts
  mid-way), creates or migrates the database exactly as a server would, then releases it;
- a server holds it: the command writes through SQLite (WAL; writers take turns) only if the
  database already has this pagewire's schema, and the server picks the change up on its next
  request (the key generation counter). A schema mismatch is refused, naming the holder.
`usage` only reads (read-only connection, no lock), like `requests list`.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import json
import math
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any, Optional

from server.gateway.keys import PRIORITIES, ApiKey, KeyError_, KeyStore
from server.serving.db_url import DbTarget


def add_parsers(sub: Any, db_help: str) -> None:
    keys = sub.add_parser("keys", help="manage API keys (stored hashed in the ledger database)")
    ks = keys.add_subparsers(dest="action", required=True)

    def limits(p: argparse.ArgumentParser, update: bool) -> None:
        zero = " (0 removes it)" if update else ""
        p.add_argument("--daily-tokens", type=int, default=None, help=f"tokens per UTC day{zero}")
        p.add_argument("--tpm", type=int, default=None, help=f"tokens per minute{zero}")
        p.add_argument("--rpm", type=int, default=None, help=f"requests per minute{zero}")
        p.add_argument("--model-limit", action="append", default=None, metavar="MODEL:LIMIT=N[,LIMIT=N]",
                       help="limits for one model name, on top of the key-wide ones (repeatable); LIMIT is "
                            f"tpm, rpm or daily (tokens per UTC day), e.g. small:tpm=1000,rpm=10{zero}")
        p.add_argument("--max-priority", choices=PRIORITIES, default=None,
                       help="interactive (default) or batch (every request runs in the batch class)")
        p.add_argument("--expires", default=None,
                       help="expiry: ISO date (valid through that UTC day) or date-time" +
                            (", or 'never'" if update else ""))
        p.add_argument("--db", default=None, help=db_help)

    c = ks.add_parser("create", help="create a key and print its secret (shown once)")
    c.add_argument("--name", required=True)
    limits(c, False)
    c.add_argument("--json", action="store_true")
    lst = ks.add_parser("list", help="every key (never secrets)")
    lst.add_argument("--db", default=None, help=db_help)
    lst.add_argument("--json", action="store_true")
    for name, h in (("show", "one key"), ("revoke", "revoke a key (takes effect on its next request)")):
        p = ks.add_parser(name, help=h)
        p.add_argument("key_id")
        p.add_argument("--db", default=None, help=db_help)
    u = ks.add_parser("update", help="change a key's name, limits, priority or expiry")
    u.add_argument("key_id")
    u.add_argument("--name", default=None)
    limits(u, True)
    u.add_argument("--clear-model-limit", action="append", default=None, metavar="MODEL",
                   help="remove every limit the key has for MODEL (repeatable)")

    us = sub.add_parser("usage", help="token usage by key, model or day (SQL over the ledger)")
    us.add_argument("--since", default=None, help="start: ISO date/date-time (UTC), Unix seconds, or Nd/Nh ago")
    us.add_argument("--until", default=None, help="end (exclusive), same forms as --since")
    us.add_argument("--key", default=None, help="only this key id")
    us.add_argument("--group-by", choices=("key", "model", "day"), default="key")
    us.add_argument("--format", choices=("table", "json", "csv"), default="table")
    us.add_argument("--db", default=None, help=db_help)


def parse_when(text: str, name: str, end_of_day: bool = False) -> float:
    """Unix seconds, `7d`/`12h` (ago), or an ISO date/date-time (UTC unless it names a zone)."""
    t = text.strip()
    try:
        value = float(t)
    except ValueError:
        pass
    else:
        if not math.isfinite(value):  # "nan", "inf", "1e309": no time
            raise ValueError(f"{name}: must be a finite number of Unix seconds, got {text!r}")
        return value
    if t[:-1].isdigit() and t[-1:] in ("d", "h"):
        return time.time() - int(t[:-1]) * (86400 if t[-1] == "d" else 3600)
    try:
        dt = datetime.datetime.fromisoformat(t)
    except ValueError:
        raise ValueError(f"{name}: expected an ISO date or date-time, Unix seconds or Nd/Nh, got {text!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=datetime.timezone.utc)
    if end_of_day and len(t) == 10:  # a bare date: valid through that day
        dt += datetime.timedelta(days=1)
    return dt.timestamp()


_LIMIT_NAMES = {"tpm": "tpm", "rpm": "rpm", "daily": "daily_tokens", "daily_tokens": "daily_tokens",
                "daily-tokens": "daily_tokens"}


def parse_model_limits(specs: Optional[list[str]]) -> dict[str, dict[str, int]]:
    """`--model-limit small:tpm=1000,rpm=10` (repeatable) → {"small": {"tpm": 1000, "rpm": 10}}.
    The model name is everything before the last `:` (so Ollama-style `llama3:8b:tpm=5` works);
    a model given twice merges, the later value of a limit winning. Raises ValueError naming the
    flag and the bad part."""
    out: dict[str, dict[str, int]] = {}
    for spec in specs or ():
        model, colon, fields = spec.rpartition(":")
        if not colon or not model.strip() or not fields.strip():
            raise ValueError(f"--model-limit: expected MODEL:LIMIT=N[,LIMIT=N...] (LIMIT: tpm, rpm or daily), "
                             f"got {spec!r}")
        limits = out.setdefault(model.strip(), {})
        for part in fields.split(","):
            name, eq, value = part.strip().partition("=")
            field = _LIMIT_NAMES.get(name.strip().lower())
            if not eq or field is None:
                raise ValueError(f"--model-limit {spec!r}: {part.strip()!r} is not LIMIT=N with LIMIT one of "
                                 "tpm, rpm, daily")
            try:
                limits[field] = int(value.strip())
            except ValueError:
                raise ValueError(f"--model-limit {spec!r}: {name.strip()} must be an integer, got "
                                 f"{value.strip()!r}") from None
    return out


def _limits_text(per_model: dict[str, dict[str, int]]) -> str:
    """The per-model limits as `--model-limit` would take them, `;`-separated (`-`: none)."""
    short = {"tpm": "tpm", "rpm": "rpm", "daily_tokens": "daily"}
    return "; ".join(f"{m}:" + ",".join(f"{short[f]}={v}" for f, v in sorted(fields.items()))
                     for m, fields in sorted(per_model.items())) or "-"


def _open_for_keys(db: "Path | DbTarget") -> tuple[Any, Any]:
    """A read-write connection with the current schema, and the lock when we took it (see module).
    A PostgreSQL ledger needs no lock (nothing here sweeps; replicas share it)."""
    from server.serving.db_lock import LedgerLock, LedgerLocked, secure_paths
    from server.serving.ledger import LedgerError, _migrate
    from server.serving.schema import SCHEMA_VERSION

    if isinstance(db, DbTarget):
        if db.url is not None:
            from server.serving.ledger_pg_sync import open_for_keys

            return open_for_keys(db.url), None
        assert db.path is not None
        db = db.path

    lock: Any = None
    holder: Optional[LedgerLocked] = None
    try:
        lock = LedgerLock.acquire(db)
    except LedgerLocked as e:
        holder = e
    else:
        try:
            secure_paths(db)

            async def migrate() -> None:
                import aiosqlite

                conn = await aiosqlite.connect(str(db), isolation_level=None)
                try:
                    await conn.execute("PRAGMA journal_mode=WAL")
                    await _migrate(conn)
                finally:
                    await conn.close()

            asyncio.run(migrate())
        except BaseException:
            lock.release()
            raise
    conn = sqlite3.connect(str(db), timeout=5.0)
    version = conn.execute("SELECT version FROM schema_version").fetchone() if _has_table(conn, "schema_version") else None
    if holder is not None and (version is None or version[0] != SCHEMA_VERSION):
        conn.close()
        raise LedgerError(f"{holder}; its schema ({version[0] if version else 'none'}) is not this pagewire's "
                          f"({SCHEMA_VERSION}), so keys cannot be changed while it runs")
    return conn, lock


def _open_readonly(db: "Path | DbTarget") -> Any:
    from server.serving.ledger_sync import open_readonly

    if isinstance(db, DbTarget):
        if db.url is not None:
            from server.serving.ledger_pg_sync import connect_sync

            return connect_sync(db.url)
        assert db.path is not None
        db = db.path
    return open_readonly(db)


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone() is not None


def _fmt(t: Optional[float]) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M") if t else "-"


def _print_keys(keys: list[ApiKey], as_json: bool) -> None:
    if as_json:
        for k in keys:
            print(json.dumps(k.public()))
        return
    print(f"{'KEY ID':<16} {'NAME':<20} {'STATUS':<8} {'DAILY':>10} {'TPM':>8} {'RPM':>6} {'PRIORITY':<11} "
          f"{'CREATED (UTC)':<16} {'EXPIRES (UTC)':<16} MODEL LIMITS")
    for k in keys:
        def n(v: Optional[int]) -> str:
            return "-" if v is None else str(v)
        print(f"{k.key_id:<16} {k.name[:20]:<20} {k.status():<8} {n(k.daily_tokens):>10} {n(k.tpm):>8} "
              f"{n(k.rpm):>6} {k.max_priority:<11} {_fmt(k.created_at):<16} {_fmt(k.expires_at):<16} "
              f"{_limits_text(k.model_limits)}")


def run_keys(ns: argparse.Namespace, db: "Path | DbTarget") -> int:
    from server.serving.ledger import LedgerError

    try:
        conn, lock = _open_for_keys(db)
    except LedgerError as e:
        print(f"pagewire: {e}", file=sys.stderr)
        return 1
    try:
        store = KeyStore(conn)
        if ns.action == "create":
            expires = parse_when(ns.expires, "--expires", end_of_day=True) if ns.expires else None
            key, secret = store.create(ns.name, daily_tokens=ns.daily_tokens, tpm=ns.tpm, rpm=ns.rpm,
                                       max_priority=ns.max_priority or "interactive", expires_at=expires,
                                       model_limits=parse_model_limits(ns.model_limit))
            if ns.json:
                print(json.dumps({**key.public(), "secret": secret}))
            else:
                print(f"created {key.key_id} ({key.name}). Its secret, shown only now:\n\n    {secret}\n")
                print("Send it as `Authorization: Bearer <secret>`; pagewire stores only its hash.")
        elif ns.action == "list":
            _print_keys(store.list(), ns.json)
        elif ns.action == "show":
            print(json.dumps(store.require(ns.key_id).public(), indent=2))
        elif ns.action == "revoke":
            print(json.dumps(store.revoke(ns.key_id).public(), indent=2))
        else:
            changes: dict[str, Any] = {}
            for f in ("name", "daily_tokens", "tpm", "rpm", "max_priority"):
                v = getattr(ns, f)
                if v is not None:
                    changes[f] = v
            if ns.model_limit or ns.clear_model_limit:
                changes["model_limits"] = parse_model_limits(ns.model_limit)
                changes["clear_model_limits"] = ns.clear_model_limit or []
            if ns.expires is not None:
                changes["expires_at"] = (None if ns.expires == "never"
                                         else parse_when(ns.expires, "--expires", end_of_day=True))
            print(json.dumps(store.update(ns.key_id, **changes).public(), indent=2))
    except (KeyError_, ValueError) as e:
        print(f"pagewire: {e}", file=sys.stderr)
        return 2
    finally:
        conn.close()
        if lock is not None:
            lock.release()
    return 0


def run_usage(ns: argparse.Namespace, db: "Path | DbTarget") -> int:
    from server.gateway.usage import usage_report_sync
    from server.serving.ledger import LedgerError

    try:
        start = parse_when(ns.since, "--since") if ns.since else None
        end = parse_when(ns.until, "--until") if ns.until else None
        conn = _open_readonly(db)
    except (ValueError, LedgerError) as e:
        print(f"pagewire: {e}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) and not isinstance(e, LedgerError) else 1
    try:
        try:
            rows = usage_report_sync(conn, start, end, ns.group_by, ns.key)
        except sqlite3.OperationalError as e:  # a ledger from before keys has no key_id column
            print(f"pagewire: {db}: {e} (open it once with this pagewire's server or `keys list`)", file=sys.stderr)
            return 1
    finally:
        conn.close()
    if ns.format == "json":
        print(json.dumps(rows, indent=2))
    elif ns.format == "csv":
        cols = [ns.group_by, "requests", "prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens",
                "billable_tokens"]
        w = csv.DictWriter(sys.stdout, fieldnames=cols, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    else:
        print(f"{ns.group_by.upper():<16} {'REQUESTS':>9} {'PROMPT':>10} {'COMPLETION':>11} {'REASONING':>10} "
              f"{'CACHED':>9} {'BILLABLE':>10}")
        for r in rows:
            print(f"{str(r[ns.group_by]):<16} {r['requests']:>9} {r['prompt_tokens']:>10} "
                  f"{r['completion_tokens']:>11} {r['reasoning_tokens']:>10} {r['cached_tokens']:>9} "
                  f"{r['billable_tokens']:>10}")
    return 0
