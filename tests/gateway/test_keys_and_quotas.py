"""Unit tests of the gateway: key lifecycle and storage, the authenticator, the quota book (with
an injected clock), usage SQL, and fairness across keys in the admission queue."""
from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from server.gateway.auth import (
    AuthConfigError,
    Authenticator,
    Principal,
    bind,
    check_policy,
    credentials,
)
from server.gateway.cli import parse_when
from server.gateway.keys import KeyError_, KeyStore, hash_secret, key_id_of
from server.gateway.quotas import Limits, QuotaBook, RateLimited
from server.serving.admission import BATCH, INTERACTIVE, AdmissionQueue
from server.serving.errors import InvalidApiKey
from server.serving.jobs import GenerationSpec
from server.serving.ledger import Ledger


def _store(tmp_path: Path) -> tuple[KeyStore, sqlite3.Connection]:
    db = tmp_path / "l.db"

    async def make() -> None:
        led = await Ledger.open(db)
        await led.close()

    asyncio.run(make())
    conn = sqlite3.connect(db)
    return KeyStore(conn), conn


def test_key_lifecycle_and_hashed_storage(tmp_path: Path) -> None:
    store, conn = _store(tmp_path)
    key, secret = store.create("alice", tpm=100, daily_tokens=1000, max_priority="batch")
    assert key_id_of(secret) == key.key_id and key.key_id.startswith("pw-")
    # Only the hash is stored: the secret appears nowhere in the database file's rows.
    dump = "\n".join(conn.iterdump())
    assert secret not in dump and secret.split(".")[1] not in dump
    assert hash_secret(secret) in dump
    assert key.status() == "active" and key.public().get("secret_hash") is None
    g0 = store.generation()
    k2 = store.update(key.key_id, tpm=0, rpm=5, name="alice2")
    assert (k2.tpm, k2.rpm, k2.name) == (None, 5, "alice2") and store.generation() == g0 + 1
    assert store.revoke(key.key_id).status() == "revoked"
    with pytest.raises(KeyError_, match="no key"):
        store.revoke("pw-000000000000")
    with pytest.raises(KeyError_, match="tpm"):
        store.create("bob", tpm=-1)
    with pytest.raises(KeyError_, match="max_priority"):
        store.create("bob", max_priority="urgent")


def test_authenticator_accepts_live_keys_and_refuses_revoked_expired_and_wrong(tmp_path: Path) -> None:
    store, conn = _store(tmp_path)
    auth = Authenticator(conn, "auto")
    assert not auth.required and auth.authenticate(None) is None  # no keys yet: auth off on loopback
    key, secret = store.create("alice")
    old, old_secret = store.create("old", expires_at=time.time() - 1)
    assert auth.required  # the first key turns auth on (generation changed)
    who = auth.authenticate(secret)
    assert who == Principal(key.key_id, key=who.key if who else None) and who is not None and not who.admin
    with pytest.raises(InvalidApiKey, match="missing"):
        auth.authenticate(None)
    with pytest.raises(InvalidApiKey, match="incorrect"):
        auth.authenticate(secret[:-1] + ("A" if secret[-1] != "A" else "B"))
    with pytest.raises(InvalidApiKey, match="incorrect"):
        auth.authenticate("sk-not-ours")
    with pytest.raises(InvalidApiKey, match="expired"):
        auth.authenticate(old_secret)
    store.revoke(key.key_id)
    with pytest.raises(InvalidApiKey, match="revoked") as e:
        auth.authenticate(secret)
    assert e.value.status == 401 and e.value.code == "invalid_api_key"
    admin = Authenticator(conn, "on", admin_secret="a" * 32)
    assert admin.authenticate("a" * 32) == Principal("admin", admin=True)


def test_secure_default_policy() -> None:
    check_policy("auto", "127.0.0.1", False, False, False)
    check_policy("off", "::1", False, False, False)
    with pytest.raises(AuthConfigError, match="without authentication"):
        check_policy("auto", "0.0.0.0", False, False, False)
    with pytest.raises(AuthConfigError, match="loopback"):
        check_policy("off", "0.0.0.0", True, False, False)
    check_policy("auto", "0.0.0.0", True, False, False)
    check_policy("auto", "0.0.0.0", False, True, False)
    check_policy("off", "0.0.0.0", False, False, True)


def test_credentials_from_header_or_websocket_subprotocol() -> None:
    assert credentials({"type": "http", "headers": [(b"authorization", b"Bearer pw-x.y")]}) == "pw-x.y"
    ws = {"type": "websocket", "headers": [(b"sec-websocket-protocol", b"pagewire, pagewire-key.pw-a.b")]}
    assert credentials(ws) == "pw-a.b"
    assert credentials({"type": "http", "headers": [(b"sec-websocket-protocol", b"pagewire-key.pw-a.b")]}) is None


def test_bind_scopes_idempotency_and_fairness_to_the_key() -> None:
    spec = GenerationSpec(kind="completion", api="http", client="10.0.0.1", model="m", idempotency_key="k1")
    bind(spec, Principal("pw-aaaaaaaaaaaa"))
    assert (spec.key_id, spec.client, spec.idempotency_key) == ("pw-aaaaaaaaaaaa", "pw-aaaaaaaaaaaa",
                                                               "pw-aaaaaaaaaaaa:k1")
    anon = GenerationSpec(kind="completion", api="http", client="u", model="m", idempotency_key="k1")
    bind(anon, None)
    assert anon.idempotency_key == "k1" and anon.key_id is None


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def test_tpm_bucket_reserve_reconcile_and_retry_after() -> None:
    clock = Clock()
    book = QuotaBook(lambda k: Limits(tpm=600, rpm=100), clock)
    r1 = book.reserve("k", 400)
    with pytest.raises(RateLimited) as e:
        book.reserve("k", 400)
    err = e.value
    assert err.status == 429 and err.retry_after_s == pytest.approx(20.0)  # 200 tokens at 10/s
    assert err.headers["x-ratelimit-limit-tokens"] == "600"
    assert err.headers["x-ratelimit-remaining-tokens"] == "200"
    assert err.headers["x-ratelimit-reset-tokens"] == "40s"
    assert err.headers["x-ratelimit-limit-requests"] == "100"
    # Reconcile: the request used 50 of its 400; 350 come back at once.
    book.settle(r1, 50)
    r2 = book.reserve("k", 400)
    book.settle(r2, 0, ran=False)  # cancelled before the engine: all back
    book.settle(r2, 0, ran=False)  # idempotent
    assert book.used_today("k") == 50
    # After exactly the advertised wait a refused request fits.
    book.reserve("k", 550)
    with pytest.raises(RateLimited) as e2:
        book.reserve("k", 100)
    clock.t += e2.value.retry_after_s or 0
    book.reserve("k", 100)
    with pytest.raises(RateLimited, match="more than this key's limit") as e3:
        book.reserve("k", 601)
    assert e3.value.headers["x-should-retry"] == "false"


def test_rpm_and_daily_quota_with_day_rollover() -> None:
    clock = Clock()
    clock.t = 86400.0 * 100 + 3600  # 01:00 UTC
    book = QuotaBook(lambda k: Limits(rpm=2, daily_tokens=1000), clock)
    book.load_daily({"k": 900}, book.day_of(clock.t))  # read back from the ledger at start-up
    with pytest.raises(RateLimited, match="daily token quota") as e:
        book.reserve("k", 200)
    assert e.value.code == "daily_quota_exceeded" and e.value.retry_after_s == pytest.approx(23 * 3600)
    assert e.value.headers["x-should-retry"] == "false"  # no SDK retry can wait for midnight
    r = book.reserve("k", 100)
    book.settle(r, 100)
    with pytest.raises(RateLimited, match="daily"):
        book.reserve("k", 1)
    clock.t += 23 * 3600  # next UTC day
    assert book.used_today("k") == 0
    book.reserve("k", 500)
    book.reserve("k", 100)
    with pytest.raises(RateLimited, match="2 requests per minute") as e2:
        book.reserve("k", 1)  # rpm=2, both taken this minute
    assert e2.value.retry_after_s == pytest.approx(30.0)


def test_keys_without_limits_are_not_limited() -> None:
    book = QuotaBook(lambda k: None, Clock())
    for _ in range(100):
        book.settle(book.reserve("k", 10_000), 10_000)
    assert book.used_today("k") == 1_000_000


def test_one_keys_flood_does_not_starve_another_keys_interactive_requests() -> None:
    """Structural: admission round-robins across fairness keys, and `bind` makes the API key the
    fairness key, so key B's request is handed to the engine right after one of key A's, however
    many A queued (and whatever `user` A sends)."""
    submitted: list[str] = []
    q: AdmissionQueue[str] = AdmissionQueue(1000, 1000, 1, submitted.append)
    flood = []
    for i in range(50):
        spec = GenerationSpec(kind="completion", api="http", client=f"user{i}", model="m")
        bind(spec, Principal("pw-aaaaaaaaaaaa"))
        flood.append(spec)
        q.reserve(spec.client)
        q.enqueue(f"A{i}", spec.client, INTERACTIVE, 0)
    b = GenerationSpec(kind="completion", api="http", client="user0", model="m")
    bind(b, Principal("pw-bbbbbbbbbbbb"))
    q.reserve(b.client)
    q.enqueue("B0", b.client, INTERACTIVE, 0)
    assert submitted == ["A0"]
    q.done("A0")
    q.done(submitted[-1])
    assert submitted[:3] == ["A0", "A1", "B0"]
    # A batch-only key's requests go to the batch class, behind every interactive one.
    spec = GenerationSpec(kind="completion", api="http", client="x", model="m")
    from server.gateway.keys import ApiKey

    batch_key = ApiKey("pw-cccccccccccc", "c", "h", None, None, None, "batch", 0.0, None, None)
    bind(spec, Principal(batch_key.key_id, key=batch_key))
    assert spec.klass == BATCH


def test_parse_when() -> None:
    assert parse_when("2027-01-01", "x") == 1798761600.0
    assert parse_when("2027-01-01", "x", end_of_day=True) == 1798761600.0 + 86400
    assert parse_when("12.5", "x") == 12.5
    with pytest.raises(ValueError, match="--since"):
        parse_when("yesterday", "--since")


def test_log_records_are_scrubbed_of_secrets(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from server.gateway import redact
    from server.gateway.keys import new_secret

    redact.install()
    key_id, secret = new_secret()
    caplog.set_level(logging.DEBUG)
    lg = logging.getLogger("websockets.server")
    lg.debug("< authorization: Bearer %s", "admin-secret-value-123456")
    lg.debug("< sec-websocket-protocol: pagewire, pagewire-key.%s", secret)
    logging.getLogger("x").warning("key %s failed", secret)
    assert "admin-secret-value-123456" not in caplog.text and secret not in caplog.text
    assert f"{key_id}.<redacted>" in caplog.text and "Bearer <redacted>" in caplog.text


def test_tpm_bucket_is_seeded_from_the_last_minute_of_the_ledger() -> None:
    clock = Clock()
    book = QuotaBook(lambda k: Limits(tpm=600) if k == "k" else None, clock)
    # 300 tokens spent 30 s ago (half refilled: 150 still owed) and 200 just now.
    book.load_window({"k": [(clock.t - 30, 300), (clock.t, 200)], "free": [(clock.t, 10**6)]})
    with pytest.raises(RateLimited) as e:
        book.reserve("k", 251)
    assert e.value.headers["x-ratelimit-remaining-tokens"] == "250"
    book.reserve("k", 250)
    book.reserve("free", 10**6)


def test_per_key_metrics_have_bounded_cardinality() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from server.serving.metrics import KeyUsage

    ku = KeyUsage(top_n=3)
    for i in range(20):
        ku.add(f"pw-{i:012x}", requests=1, prompt=10 * i, completion=i)
    reg = CollectorRegistry()
    reg.register(ku)
    text = generate_latest(reg).decode()
    series = [ln for ln in text.splitlines() if ln.startswith("pagewire_key_prompt_tokens_total{")]
    assert len(series) == 4  # the top 3 and "other"
    assert 'key="pw-000000000013"' in text and 'key="other"' in text
    other = next(ln for ln in series if 'key="other"' in ln)
    assert float(other.split()[-1]) == sum(10 * i for i in range(17))
