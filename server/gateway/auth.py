"""Authentication: who is calling, decided once per HTTP request or WebSocket upgrade.

Credentials, in order: the `Authorization: Bearer <secret>` header (HTTP and WebSocket upgrade),
else an `x-api-key: <secret>` header (how Anthropic's clients send it), else, for browsers (which
cannot set headers on a WebSocket), a `Sec-WebSocket-Protocol` entry `pagewire-key.<secret>` next
to `pagewire`; the server then answers with the `pagewire`
subprotocol, never echoing the secret (docs/websocket.md).

When auth is required (`AuthPolicy`), every route except /health and the chat page's static
files needs a valid key: 401 `invalid_api_key` otherwise. Admin routes (/metrics) need the admin
key (`--admin-key-file`): 403 `permission_denied` for any other key. The admin key may also do
everything a key may, over every key's requests. The metrics token (`--metrics-key-file`) may read
/metrics and nothing else (anywhere else it is an unknown key's 401), so a Prometheus scrape needs
no admin secret. The `--metrics-port` listener serves /metrics alone (server.api.metrics_listener)
and, with a metrics token set, asks for it there too.

Keys are cached in memory by id; the cache is reloaded when the `key_generation` counter in the
ledger changes (one indexed read per request, so `pagewire keys revoke` takes effect on the next
request of a running server). An open WebSocket is re-checked (`recheck`) on every request it
submits and once a second while it is open (server/api/ws.py), so a revoke, an expiry, or auth
turning on closes it. Secrets are compared as SHA-256 digests with `hmac.compare_digest`.
Nothing here logs a secret: log lines name the key id (`pw-…`) only.
"""
from __future__ import annotations

import ipaddress
import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, MutableMapping, Optional

from server.gateway.keys import ApiKey, KeyStore, hash_secret, key_id_of, secret_matches
from server.gateway.quotas import Limits
from server.serving.admission import BATCH
from server.serving.errors import InvalidApiKey
from server.serving.jobs import GenerationSpec

log = logging.getLogger("pagewire.auth")

ADMIN_ID = "admin"
SCOPE_KEY = "pagewire.principal"
WS_SUBPROTOCOL = "pagewire"
WS_KEY_PREFIX = "pagewire-key."
OPEN_PATHS = ("/health",)
ADMIN_PATHS = ("/metrics",)
METRICS_PATHS = ("/metrics",)  # what the metrics token may read
METRICS_LISTENER = "pagewire.metrics_listener"  # scope flag: the request came in on --metrics-port


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: a key, or the admin."""

    key_id: str
    admin: bool = False
    key: Optional[ApiKey] = None

    def may_see(self, owner: Optional[str]) -> bool:
        """Ownership: a key sees only its own requests; the admin sees all."""
        return self.admin or owner == self.key_id


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class AuthConfigError(ValueError):
    """`serve` refuses to start with this auth configuration (the message says why and what to do)."""


def read_admin_key(path: str, option: str = "--admin-key-file", what: str = "the admin key") -> str:
    p = Path(path).expanduser()
    try:
        secret = p.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise AuthConfigError(f"{option} {p}: {e.strerror}") from None
    if len(secret) < 16:
        raise AuthConfigError(f"{option} {p}: {what} must be at least 16 characters")
    return secret


def read_metrics_key(path: str) -> str:
    return read_admin_key(path, "--metrics-key-file", "the metrics token")


def check_policy(mode: str, host: str, has_keys: bool, has_admin: bool, insecure_no_auth: bool) -> None:
    """The secure default: refuse to serve a non-loopback address without authentication.

    - `--auth off` is allowed only on a loopback address (or with `--insecure-no-auth`);
    - binding any other address needs keys (or an admin key) unless `--insecure-no-auth`.
    """
    if mode not in ("auto", "on", "off"):
        raise AuthConfigError(f"--auth: expected auto, on or off, got {mode!r}")
    if insecure_no_auth or is_loopback(host):
        return
    if mode == "off":
        raise AuthConfigError(
            f"--auth off is only allowed when binding a loopback address, not {host!r}; "
            "create keys (pagewire keys create) or pass --insecure-no-auth to serve without authentication")
    if not has_keys and not has_admin:
        raise AuthConfigError(
            f"refusing to serve {host!r} without authentication: there are no API keys in the ledger and no "
            "--admin-key-file; create one with `pagewire keys create --name NAME --db DB`, or pass "
            "--insecure-no-auth")


class Authenticator:
    """Turns a secret into a Principal. Runs on the event loop (its reads are small and indexed)."""

    def __init__(self, conn: Optional[sqlite3.Connection], mode: str = "auto",
                 admin_secret: Optional[str] = None, insecure_no_auth: bool = False,
                 metrics_secret: Optional[str] = None) -> None:
        self._store = KeyStore(conn) if conn is not None else None
        self.mode = mode
        self._admin_hash = hash_secret(admin_secret) if admin_secret else None
        self._metrics_hash = hash_secret(metrics_secret) if metrics_secret else None
        self.insecure_no_auth = insecure_no_auth
        self._keys: dict[str, ApiKey] = {}
        self._generation = -1
        self.refresh()

    def load(self, generation: int, keys: dict[str, ApiKey]) -> None:
        """Replace the key cache (a shared database's keys, read asynchronously: `keys.load_keys`)."""
        if generation != self._generation:
            self._keys, self._generation = keys, generation

    def refresh(self) -> None:
        """Reload the key cache if a key changed since the last look."""
        if self._store is None:
            return
        gen = self._store.generation()
        if gen != self._generation:
            self._keys = self._store.load_all()
            self._generation = gen

    @property
    def required(self) -> bool:
        """Whether callers must present a key. `auto` (the default): when any key exists or an
        admin key is set; so a loopback server with no keys behaves as before, and creating the
        first key turns authentication on."""
        if self.mode == "off":
            return False
        if self.mode == "on":
            return True
        self.refresh()
        return bool(self._keys) or self._admin_hash is not None

    @property
    def generation(self) -> int:
        """The key generation the cache was last loaded at (every key change bumps it)."""
        return self._generation

    def recheck(self, who: Optional[Principal], refresh: bool = True) -> Optional[Principal]:
        """The caller `who`, authenticated earlier (a WebSocket at its upgrade), as it stands now:
        with its key's current limits. Raises InvalidApiKey when it may no longer act: its key
        was revoked, removed or has expired, or `who` is None (no key) and authentication has
        since become required (the first key was created). `refresh=False` trusts the cache (a
        caller re-checking many sockets refreshes once)."""
        if refresh:
            self.refresh()
        if who is None:
            if self.required:
                raise InvalidApiKey("authentication is now required on this server; reconnect with an API key")
            return None
        if who.admin:
            return who
        key = self._keys.get(who.key_id)
        if key is None:
            raise InvalidApiKey(f"API key {who.key_id} no longer exists")
        status = key.status(time.time())
        if status != "active":
            raise InvalidApiKey(f"API key {who.key_id} is {status}")
        return who if key == who.key else Principal(key.key_id, key=key)

    @property
    def has_metrics_token(self) -> bool:
        return self._metrics_hash is not None

    def is_metrics_token(self, secret: Optional[str]) -> bool:
        """Whether `secret` is the metrics token (good for /metrics only)."""
        return bool(secret) and self._metrics_hash is not None and secret_matches(secret or "", self._metrics_hash)

    def get(self, key_id: str) -> Optional[ApiKey]:
        return self._keys.get(key_id)

    def limits_of(self, key_id: str) -> Optional[Limits]:
        k = self._keys.get(key_id)
        if k is None:
            return None
        models = {m: Limits(tpm=f.get("tpm"), rpm=f.get("rpm"), daily_tokens=f.get("daily_tokens"))
                  for m, f in k.model_limits.items()}
        return Limits(tpm=k.tpm, rpm=k.rpm, daily_tokens=k.daily_tokens, models=models)

    def is_admin(self, secret: Optional[str]) -> bool:
        return bool(secret) and self._admin_hash is not None and secret_matches(secret or "", self._admin_hash)

    def authenticate(self, secret: Optional[str]) -> Optional[Principal]:
        """The caller for `secret`; None when auth is not required and no secret was given.
        Raises InvalidApiKey (401)."""
        self.refresh()
        if not secret:
            if not self.required:
                return None
            raise InvalidApiKey("missing API key: send it as `Authorization: Bearer <key>` (or `x-api-key: <key>`)")
        if self._admin_hash is not None and secret_matches(secret, self._admin_hash):
            return Principal(ADMIN_ID, admin=True)
        key_id = key_id_of(secret)
        key = self._keys.get(key_id) if key_id is not None else None
        # The hash is compared even for an unknown id, so a miss costs the same as a wrong secret.
        stored = key.secret_hash if key is not None else "0" * 64
        if not secret_matches(secret, stored) or key is None:
            if not self.required:
                return None  # auth off: a stray header is ignored, as before keys existed
            raise InvalidApiKey("incorrect API key provided")
        status = key.status(time.time())
        if status != "active":
            raise InvalidApiKey(f"API key {key.key_id} is {status}")
        return Principal(key.key_id, key=key)


def bearer(value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _header(scope: dict[str, Any], name: bytes) -> Optional[str]:
    for k, v in scope.get("headers", ()):
        if k == name:
            return str(v.decode("latin-1"))
    return None


def ws_protocols(scope: dict[str, Any]) -> list[str]:
    raw = _header(scope, b"sec-websocket-protocol")
    return [p.strip() for p in raw.split(",")] if raw else []


def credentials(scope: dict[str, Any]) -> Optional[str]:
    """The secret a request presents (see the module docstring for where it may come from)."""
    token = bearer(_header(scope, b"authorization"))
    if token:
        return token
    api_key = _header(scope, b"x-api-key")  # Anthropic's clients send the key this way
    if api_key and api_key.strip():
        return api_key.strip()
    if scope["type"] == "websocket":
        for p in ws_protocols(scope):
            if p.startswith(WS_KEY_PREFIX):
                return p[len(WS_KEY_PREFIX):]
    return None


def principal_of(scope: "MutableMapping[str, Any]") -> Optional[Principal]:
    """The caller the AuthGuard recorded for this request (None: auth is off)."""
    p = scope.get(SCOPE_KEY)
    return p if isinstance(p, Principal) else None


def ws_subprotocol(scope: dict[str, Any]) -> Optional[str]:
    """The subprotocol to accept: `pagewire` when the client offered it, else none."""
    return WS_SUBPROTOCOL if WS_SUBPROTOCOL in ws_protocols(scope) else None


def bind(spec: GenerationSpec, who: Optional[Principal]) -> None:
    """Tie a GenerationSpec to its caller: the owning key (recorded in the ledger), the admission
    fairness key (round-robin is across API keys, so one key's flood cannot starve another's
    requests, whatever `user` they send), idempotency keys scoped per API key, and a batch-only
    key's requests in the batch class."""
    if who is None:
        return
    spec.key_id = who.key_id
    spec.client = who.key_id
    if spec.idempotency_key is not None:
        spec.idempotency_key = f"{who.key_id}:{spec.idempotency_key}"
    if who.key is not None and who.key.max_priority == "batch":
        spec.klass = BATCH
