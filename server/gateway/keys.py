"""API keys: generation, hashing, and the `api_keys` table of the ledger database.

A secret looks like `pw-<id>.<43 url-safe characters>` (256 random bits). Only its SHA-256 is
stored; `pw-<id>` (the key id) is safe to log and is what every ledger row records. A plain hash
(no salt, no slow KDF) is enough because the secret is high-entropy random, not a password: there
is nothing to guess. Checks compare hashes with `hmac.compare_digest`.

`KeyStore` is synchronous (sqlite3): the CLI uses it directly, and the server reads through it
(`load_all`, a few hundred microseconds for a small table) only when `generation()` changes,
which every write here bumps in the same transaction.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

PREFIX = "pw-"
PRIORITIES = ("interactive", "batch")
_FIELDS = ("key_id, name, secret_hash, daily_tokens, tpm, rpm, max_priority, created_at, expires_at, "
           "revoked_at")


class KeyError_(ValueError):
    """A key operation refused (unknown key, bad value); the message names the key or field."""


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def new_secret() -> tuple[str, str]:
    """(key id, secret). The id is 12 hex characters (48 bits): unique enough to name, not to guess."""
    key_id = PREFIX + secrets.token_hex(6)
    return key_id, f"{key_id}.{secrets.token_urlsafe(32)}"


def key_id_of(secret: str) -> Optional[str]:
    """The id part of a secret, or None when it is not shaped like one of ours."""
    head, dot, tail = secret.partition(".")
    if not dot or not head.startswith(PREFIX) or len(head) != len(PREFIX) + 12 or not tail:
        return None
    return head


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret).encode(), stored_hash.encode())


@dataclass(frozen=True)
class ApiKey:
    """One stored key (never its secret)."""

    key_id: str
    name: str
    secret_hash: str
    daily_tokens: Optional[int]
    tpm: Optional[int]
    rpm: Optional[int]
    max_priority: str
    created_at: float
    expires_at: Optional[float]
    revoked_at: Optional[float]

    def status(self, now: Optional[float] = None) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and (time.time() if now is None else now) >= self.expires_at:
            return "expired"
        return "active"

    def public(self) -> dict[str, Any]:
        """What `keys list/show` print: everything but the hash."""
        return {"key_id": self.key_id, "name": self.name, "status": self.status(),
                "daily_tokens": self.daily_tokens, "tpm": self.tpm, "rpm": self.rpm,
                "max_priority": self.max_priority, "created_at": self.created_at,
                "expires_at": self.expires_at, "revoked_at": self.revoked_at}


def _check_limit(name: str, v: Optional[int]) -> None:
    if v is not None and v <= 0:
        raise KeyError_(f"{name}: must be a positive integer (got {v}); omit it for no limit")


class KeyStore:
    """The `api_keys` table over one sqlite3 connection (schema from `server.serving.ledger`)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def generation(self) -> int:
        row = self.conn.execute("SELECT generation FROM key_generation").fetchone()
        return int(row[0]) if row else 0

    def _bump(self) -> None:
        self.conn.execute("UPDATE key_generation SET generation = generation + 1")

    def create(self, name: str, *, daily_tokens: Optional[int] = None, tpm: Optional[int] = None,
               rpm: Optional[int] = None, max_priority: str = "interactive",
               expires_at: Optional[float] = None) -> tuple[ApiKey, str]:
        """Store a new key; returns it with its secret (shown once, never stored)."""
        if not name.strip():
            raise KeyError_("name: must not be empty")
        for f, v in (("daily_tokens", daily_tokens), ("tpm", tpm), ("rpm", rpm)):
            _check_limit(f, v)
        if max_priority not in PRIORITIES:
            raise KeyError_(f"max_priority: expected one of {', '.join(PRIORITIES)}, got {max_priority!r}")
        key_id, secret = new_secret()
        now = time.time()
        with self.conn:
            self.conn.execute(
                f"INSERT INTO api_keys ({_FIELDS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
                (key_id, name, hash_secret(secret), daily_tokens, tpm, rpm, max_priority, now, expires_at))
            self._bump()
        key = self.get(key_id)
        assert key is not None
        return key, secret

    def get(self, key_id: str) -> Optional[ApiKey]:
        row = self.conn.execute(f"SELECT {_FIELDS} FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()
        return ApiKey(*row) if row else None

    def require(self, key_id: str) -> ApiKey:
        key = self.get(key_id)
        if key is None:
            raise KeyError_(f"key_id: no key {key_id!r}")
        return key

    def list(self) -> list[ApiKey]:
        return [ApiKey(*r) for r in self.conn.execute(f"SELECT {_FIELDS} FROM api_keys ORDER BY created_at")]

    def load_all(self) -> dict[str, ApiKey]:
        return {k.key_id: k for k in self.list()}

    def update(self, key_id: str, **changes: Any) -> ApiKey:
        """Change limits, name, max_priority or expiry. A value of 0 for a limit clears it."""
        self.require(key_id)
        allowed = {"name", "daily_tokens", "tpm", "rpm", "max_priority", "expires_at"}
        sets: list[str] = []
        args: list[Any] = []
        for f, v in changes.items():
            if f not in allowed:
                raise KeyError_(f"{f}: not a key setting")
            if f in ("daily_tokens", "tpm", "rpm"):
                if v is not None and v < 0:
                    raise KeyError_(f"{f}: must be >= 0 (0 removes the limit)")
                v = v or None
            if f == "max_priority" and v not in PRIORITIES:
                raise KeyError_(f"max_priority: expected one of {', '.join(PRIORITIES)}, got {v!r}")
            sets.append(f"{f} = ?")
            args.append(v)
        if sets:
            with self.conn:
                self.conn.execute(f"UPDATE api_keys SET {', '.join(sets)} WHERE key_id = ?", (*args, key_id))
                self._bump()
        return self.require(key_id)

    def revoke(self, key_id: str) -> ApiKey:
        self.require(key_id)
        with self.conn:
            self.conn.execute("UPDATE api_keys SET revoked_at = COALESCE(revoked_at, ?) WHERE key_id = ?",
                              (time.time(), key_id))
            self._bump()
        return self.require(key_id)


async def load_keys(ledger: Any) -> tuple[int, dict[str, ApiKey]]:
    """(generation, keys by id) read through an async ledger (a shared database, where the server
    polls for key changes instead of reading synchronously on the event loop)."""
    gen = await ledger.query("SELECT generation FROM key_generation")
    rows = await ledger.query(f"SELECT {_FIELDS} FROM api_keys ORDER BY created_at")
    return (int(gen[0][0]) if gen else 0), {r[0]: ApiKey(*r) for r in rows}


def count_keys(db: "str | Path") -> int:
    """How many keys a ledger file holds (0 when it does not exist yet or predates keys)."""
    p = Path(db).expanduser()
    if not p.exists():
        return 0
    conn = sqlite3.connect(f"file:{p}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM api_keys").fetchone()[0])
    except sqlite3.OperationalError:  # no api_keys table: a ledger from before keys
        return 0
    finally:
        conn.close()
