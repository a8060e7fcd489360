"""API keys: generation, hashing, and the `api_keys` table of the ledger database.

A secret looks like `pw-<id>.<43 url-safe characters>` (256 random bits). Only its SHA-256 is
stored; `pw-<id>` (the key id) is safe to log and is what every ledger row records. A plain hash
(no salt, no slow KDF) is enough because the secret is high-entropy random, not a password: there
is nothing to guess. Checks compare hashes with `hmac.compare_digest`.

Besides its key-wide limits a key may carry limits for named models (`model_limits`, issue 30):
`{"small": {"tpm": 1000, "rpm": 10, "daily_tokens": 50000}}`, stored as JSON in the key's row so
a key and its per-model limits are read (and changed) together. A model is named as requests
name it: a LoRA adapter's name is a model of its own, as the ledger records it.

`KeyStore` is synchronous (sqlite3): the CLI uses it directly, and the server reads through it
(`load_all`, a few hundred microseconds for a small table) only when `generation()` changes,
which every write here bumps in the same transaction.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

PREFIX = "pw-"
PRIORITIES = ("interactive", "batch")
_FIELDS = ("key_id, name, secret_hash, daily_tokens, tpm, rpm, max_priority, created_at, expires_at, "
           "revoked_at, model_limits")
LIMIT_FIELDS = ("tpm", "rpm", "daily_tokens")  # what a key may limit, key-wide and per model


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
    # Limits per model name: {model: {"tpm"|"rpm"|"daily_tokens": n}} (absent: that model is
    # limited only by the key-wide limits). Not hashed: a dict; compared like the other fields.
    model_limits: dict[str, dict[str, int]] = field(default_factory=dict, hash=False)

    @classmethod
    def from_row(cls, row: "tuple[Any, ...] | Any") -> "ApiKey":
        """A key from a `SELECT {_FIELDS}` row (its model limits JSON decoded)."""
        (key_id, name, secret_hash, daily_tokens, tpm, rpm, max_priority, created_at, expires_at, revoked_at,
         limits) = tuple(row)
        return cls(key_id, name, secret_hash, daily_tokens, tpm, rpm, max_priority, created_at, expires_at,
                   revoked_at, json.loads(limits) if limits else {})

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
                "expires_at": self.expires_at, "revoked_at": self.revoked_at,
                "model_limits": self.model_limits}


def _check_limit(name: str, v: Optional[int]) -> None:
    if v is not None and v <= 0:
        raise KeyError_(f"{name}: must be a positive integer (got {v}); omit it for no limit")


def _check_model_name(model: str) -> None:
    if not model.strip() or model != model.strip():
        raise KeyError_(f"model_limits: a model name must be non-empty, without surrounding spaces (got {model!r})")


def merge_model_limits(current: dict[str, dict[str, int]], changes: dict[str, dict[str, int]],
                       clear: "tuple[str, ...] | list[str]" = ()) -> dict[str, dict[str, int]]:
    """`current` with `clear`'s models removed, then each of `changes`' fields set (0 removes that
    field; a model left with no field is removed). Raises KeyError_ naming a bad model or field."""
    out = {m: dict(f) for m, f in current.items() if m not in clear}
    for model in clear:
        _check_model_name(model)
    for model, fields in changes.items():
        _check_model_name(model)
        if not fields:
            raise KeyError_(f"model_limits[{model!r}]: give at least one of {', '.join(LIMIT_FIELDS)}")
        merged = dict(out.get(model, {}))
        for f, v in fields.items():
            if f not in LIMIT_FIELDS:
                raise KeyError_(f"model_limits[{model!r}]: {f!r} is not a limit; expected one of "
                                f"{', '.join(LIMIT_FIELDS)}")
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise KeyError_(f"model_limits[{model!r}].{f}: must be an integer >= 0 (0 removes it), got {v!r}")
            if v == 0:
                merged.pop(f, None)
            else:
                merged[f] = v
        if merged:
            out[model] = merged
        else:
            out.pop(model, None)
    return out


def _dump_limits(limits: dict[str, dict[str, int]]) -> Optional[str]:
    return json.dumps(limits, sort_keys=True) if limits else None


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
               expires_at: Optional[float] = None,
               model_limits: Optional[dict[str, dict[str, int]]] = None) -> tuple[ApiKey, str]:
        """Store a new key; returns it with its secret (shown once, never stored)."""
        if not name.strip():
            raise KeyError_("name: must not be empty")
        for f, v in (("daily_tokens", daily_tokens), ("tpm", tpm), ("rpm", rpm)):
            _check_limit(f, v)
        for model, fields in (model_limits or {}).items():
            for f, v in fields.items():
                if f in LIMIT_FIELDS and isinstance(v, int) and not isinstance(v, bool):
                    _check_limit(f"model_limits[{model!r}].{f}", v)
        per_model = merge_model_limits({}, model_limits or {})
        if max_priority not in PRIORITIES:
            raise KeyError_(f"max_priority: expected one of {', '.join(PRIORITIES)}, got {max_priority!r}")
        key_id, secret = new_secret()
        now = time.time()
        with self.conn:
            self.conn.execute(
                f"INSERT INTO api_keys ({_FIELDS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, ?)",
                (key_id, name, hash_secret(secret), daily_tokens, tpm, rpm, max_priority, now, expires_at,
                 _dump_limits(per_model)))
            self._bump()
        key = self.get(key_id)
        assert key is not None
        return key, secret

    def get(self, key_id: str) -> Optional[ApiKey]:
        row = self.conn.execute(f"SELECT {_FIELDS} FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()
        return ApiKey.from_row(row) if row else None

    def require(self, key_id: str) -> ApiKey:
        key = self.get(key_id)
        if key is None:
            raise KeyError_(f"key_id: no key {key_id!r}")
        return key

    def list(self) -> list[ApiKey]:
        return [ApiKey.from_row(r) for r in self.conn.execute(f"SELECT {_FIELDS} FROM api_keys ORDER BY created_at")]

    def load_all(self) -> dict[str, ApiKey]:
        return {k.key_id: k for k in self.list()}

    def update(self, key_id: str, **changes: Any) -> ApiKey:
        """Change limits, name, max_priority or expiry. A value of 0 for a limit clears it.
        `model_limits` ({model: {field: n}}) sets per-model limits field by field (0 removes one)
        and `clear_model_limits` (model names) removes a model's; see `merge_model_limits`."""
        key = self.require(key_id)
        allowed = {"name", "daily_tokens", "tpm", "rpm", "max_priority", "expires_at"}
        sets: list[str] = []
        args: list[Any] = []
        per_model = changes.pop("model_limits", None)
        clear = changes.pop("clear_model_limits", None)
        if per_model or clear:
            sets.append("model_limits = ?")
            args.append(_dump_limits(merge_model_limits(key.model_limits, per_model or {}, list(clear or ()))))
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
    return (int(gen[0][0]) if gen else 0), {r[0]: ApiKey.from_row(r) for r in rows}


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
