"""A key's per-model limits (issue 30), without a server: the quota book reserving against the
key-wide and the model's buckets with an injected clock (nothing taken when either refuses,
settled to both, the day read back by model), the key store and its schema migration from an
older ledger, and the `keys` CLI's `--model-limit` / `--clear-model-limit`."""
from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Optional

import pytest

from server.gateway.auth import Authenticator
from server.gateway.cli import parse_model_limits
from server.gateway.keys import KeyError_, KeyStore
from server.gateway.quotas import Limits, QuotaBook, RateLimited
from server.serving.ledger import Ledger
from server.serving.schema import MIGRATIONS, SCHEMA_VERSION
from tests.gateway.test_keys_and_quotas import Clock


def _book(limits: Limits, clock: Optional[Clock] = None) -> tuple[QuotaBook, Clock]:
    clock = clock or Clock()
    return QuotaBook(lambda k: limits, clock), clock


def _levels(book: QuotaBook, key: str, model: str) -> tuple[float, float, int, int]:
    """(key-wide tokens, model tokens, key-wide reserved, model reserved)."""
    k, m = book._keys[key], book._models[(key, model)]
    assert k.tokens is not None and m.tokens is not None
    return k.tokens.level, m.tokens.level, k.reserved, m.reserved


def test_a_models_tpm_refuses_that_model_while_another_is_served_and_both_settle() -> None:
    book, clock = _book(Limits(tpm=1000, models={"a": Limits(tpm=100)}))
    r1 = book.reserve("k", 80, "a")
    assert _levels(book, "k", "a") == (920, 20, 80, 80)
    with pytest.raises(RateLimited) as e:
        book.reserve("k", 80, "a")
    err = e.value
    assert err.status == 429 and err.code == "rate_limit_exceeded" and err.param == "model"
    assert "rate limit reached for this key on model 'a': 100 tokens per minute" in err.message
    # The headers are the model's bucket (the one that refused), and its wait: 60 tokens at 100/60 per s.
    assert (err.headers["x-ratelimit-limit-tokens"], err.headers["x-ratelimit-remaining-tokens"]) == ("100", "20")
    assert err.retry_after_s == pytest.approx(36.0)
    # Nothing leaked: the key-wide bucket and reservations are as before the refusal.
    assert _levels(book, "k", "a") == (920, 20, 80, 80)
    # Model b has no limit of its own: only the key-wide bucket holds it.
    r2 = book.reserve("k", 500, "b")
    assert book._keys["k"].tokens.level == 420  # type: ignore[union-attr]
    # Headers of a request: per kind, whichever bucket binds first.
    assert book.headers("k", "a")["x-ratelimit-remaining-tokens"] == "20"
    assert book.headers("k", "b")["x-ratelimit-remaining-tokens"] == "420"
    assert book.headers("k")["x-ratelimit-limit-tokens"] == "1000"
    # Settling gives the unused part back to both the key-wide and the model's bucket.
    book.settle(r1, 30)
    assert _levels(book, "k", "a") == (470, 70, 500, 0)
    book.settle(r1, 30)  # idempotent
    assert _levels(book, "k", "a") == (470, 70, 500, 0)
    book.settle(r2, 0, ran=False)
    assert book.used_today("k") == 30 and book.used_today("k", "a") == 30 and book.used_today("k", "b") == 0
    # After exactly the advertised wait a refused request fits.
    book.reserve("k", 70, "a")
    with pytest.raises(RateLimited) as e2:
        book.reserve("k", 80, "a")
    clock.t += e2.value.retry_after_s or 0
    book.reserve("k", 80, "a")


def test_a_key_wide_refusal_takes_nothing_from_the_model_either() -> None:
    book, _ = _book(Limits(rpm=1, models={"a": Limits(tpm=100, rpm=5)}))
    book.reserve("k", 10, "a")
    m = book._models[("k", "a")]
    before = (m.tokens.level, m.requests.level, m.reserved)  # type: ignore[union-attr]
    with pytest.raises(RateLimited, match="rate limit reached for this key: 1 requests per minute") as e:
        book.reserve("k", 10, "a")
    assert e.value.param is None and e.value.retry_after_s == pytest.approx(60.0)
    assert (m.tokens.level, m.requests.level, m.reserved) == before  # type: ignore[union-attr]


def test_the_longest_wait_of_either_scope_is_the_one_reported() -> None:
    # Key-wide tokens need 6 s; the model's one request per minute needs 60 s: the retry must wait 60.
    book, clock = _book(Limits(tpm=600, models={"a": Limits(rpm=1)}))
    book.reserve("k", 540, "a")
    with pytest.raises(RateLimited) as e:
        book.reserve("k", 120, "a")
    assert e.value.retry_after_s == pytest.approx(60.0) and "on model 'a': 1 requests per minute" in e.value.message
    # Requests headers from the model (it refused), tokens from the key-wide bucket (the only one).
    h = e.value.headers
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("600", "60")
    clock.t += 60
    book.reserve("k", 120, "a")


def test_a_request_larger_than_a_models_tpm_is_never_retried() -> None:
    book, _ = _book(Limits(models={"a": Limits(tpm=100)}))
    with pytest.raises(RateLimited, match="more than this key's limit of 100 tokens per minute for model 'a'") as e:
        book.reserve("k", 101, "a")
    assert e.value.code == "tokens_exceed_limit" and e.value.headers["x-should-retry"] == "false"
    book.reserve("k", 10_000, "b")  # another model: no limit


def test_a_models_daily_quota_is_read_back_and_counts_the_day_from_its_start() -> None:
    clock = Clock()
    clock.t = 86400.0 * 100 + 3600  # 01:00 UTC
    limits = Limits(daily_tokens=10_000, models={"a": Limits(daily_tokens=1000)})
    book, _ = _book(limits, clock)
    day = book.day_of(clock.t)
    # What a restarted server reads from the ledger: the key's day, and the key's day on each model.
    book.load_daily({"k": 950}, day, {("k", "a"): 900, ("k", "b"): 50})
    with pytest.raises(RateLimited) as e:
        book.reserve("k", 200, "a")
    err = e.value
    assert err.code == "daily_quota_exceeded" and err.param == "model"
    assert "daily token quota reached for this key on model 'a': 100 of 1000 tokens left today" in err.message
    assert (err.headers["x-ratelimit-limit-tokens-day"], err.headers["x-ratelimit-remaining-tokens-day"]) == (
        "1000", "100")
    assert err.retry_after_s == pytest.approx(23 * 3600) and err.headers["x-should-retry"] == "false"
    assert book._keys["k"].reserved == 0  # the key-wide quota took nothing
    book.settle(book.reserve("k", 5000, "b"), 5000)  # b is limited by the key-wide quota only
    book.settle(book.reserve("k", 100, "a"), 60)
    assert (book.used_today("k"), book.used_today("k", "a"), book.used_today("k", "b")) == (6010, 960, 5050)
    # A limit set mid-day on a model used earlier today counts that use (as the ledger would).
    limits.models["b"] = Limits(daily_tokens=5100)
    with pytest.raises(RateLimited, match="on model 'b': 50 of 5100"):
        book.reserve("k", 51, "b")
    clock.t += 23 * 3600  # the next UTC day
    assert book.used_today("k", "a") == 0
    book.reserve("k", 1000, "a")


def test_a_models_tpm_bucket_is_seeded_from_the_last_minute_of_the_ledger() -> None:
    book, clock = _book(Limits(models={"a": Limits(tpm=600)}))
    # 300 tokens on a 30 s ago (150 still owed) and 200 on b just now (b has no bucket).
    book.load_window({"k": [(clock.t - 30, 300), (clock.t, 200)]},
                     {("k", "a"): [(clock.t - 30, 300)], ("k", "b"): [(clock.t, 200)]})
    with pytest.raises(RateLimited) as e:
        book.reserve("k", 451, "a")
    assert e.value.headers["x-ratelimit-remaining-tokens"] == "450"
    book.reserve("k", 450, "a")
    book.reserve("k", 10**6, "b")


# -- the key store ---------------------------------------------------------------------------------


def _store(db: Path) -> tuple[KeyStore, sqlite3.Connection]:
    async def make() -> None:
        led = await Ledger.open(db)
        await led.close()

    asyncio.run(make())
    conn = sqlite3.connect(db)
    return KeyStore(conn), conn


def test_model_limits_are_stored_with_the_key_changed_and_cleared(tmp_path: Path) -> None:
    store, conn = _store(tmp_path / "l.db")
    key, _ = store.create("alice", tpm=5000, model_limits={"small": {"tpm": 1000, "rpm": 10, "daily_tokens": 50_000}})
    assert key.model_limits == {"small": {"tpm": 1000, "rpm": 10, "daily_tokens": 50_000}}
    assert key.public()["model_limits"] == key.model_limits
    auth = Authenticator(conn, "auto")
    lim = auth.limits_of(key.key_id)
    assert lim is not None and lim.tpm == 5000 and lim.models == {"small": Limits(tpm=1000, rpm=10, daily_tokens=50_000)}
    g = store.generation()
    # Field by field: 0 removes one; a new model is added beside; the key-wide limits stay.
    k2 = store.update(key.key_id, model_limits={"small": {"rpm": 0, "tpm": 2000}, "llama3:8b": {"daily_tokens": 9}})
    assert k2.model_limits == {"small": {"tpm": 2000, "daily_tokens": 50_000}, "llama3:8b": {"daily_tokens": 9}}
    assert k2.tpm == 5000 and store.generation() == g + 1
    auth.refresh()  # what every request's authentication does first
    assert auth.limits_of(key.key_id).models["small"].tpm == 2000  # type: ignore[union-attr]
    k3 = store.update(key.key_id, clear_model_limits=["small"], model_limits={"llama3:8b": {"daily_tokens": 0}})
    assert k3.model_limits == {}
    assert conn.execute("SELECT model_limits FROM api_keys").fetchone()[0] is None
    for bad, match in (({"small": {"tpm": -1}}, "must be a positive integer"),
                       ({"small": {"tokens": 5}}, "'tokens' is not a limit"),
                       ({"": {"tpm": 5}}, "model name must be non-empty"),
                       ({"small": {}}, "give at least one")):
        with pytest.raises(KeyError_, match=match):
            store.create("bob", model_limits=bad)
    with pytest.raises(KeyError_, match=r"model_limits\['small'\].tpm: must be an integer >= 0"):
        store.update(key.key_id, model_limits={"small": {"tpm": -5}})


def test_a_ledger_from_before_model_limits_migrates_and_its_keys_keep_working(tmp_path: Path) -> None:
    """A v8 ledger (key-wide limits only) opened by this pagewire: the key is read with no model
    limits and authenticates; model limits can then be added; the server's ledger opens it too."""
    from server.gateway.cli import _open_for_keys
    from server.gateway.keys import hash_secret
    from server.serving.db_url import parse_db

    db = tmp_path / "old.db"
    c = sqlite3.connect(db)
    c.executescript("CREATE TABLE schema_version (version INTEGER NOT NULL); INSERT INTO schema_version VALUES (8);"
                    + ";".join(MIGRATIONS[:8]))
    secret = "pw-0123456789ab." + "x" * 43
    c.execute("INSERT INTO api_keys (key_id, name, secret_hash, daily_tokens, tpm, rpm, max_priority, created_at) "
              "VALUES ('pw-0123456789ab', 'old', ?, 100, 20, NULL, 'interactive', 1.0)", (hash_secret(secret),))
    c.commit()
    c.close()
    conn, lock = _open_for_keys(parse_db(str(db)))
    try:
        assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == SCHEMA_VERSION == 9
        store = KeyStore(conn)
        old = store.require("pw-0123456789ab")
        assert (old.tpm, old.daily_tokens, old.model_limits) == (20, 100, {})
        who = Authenticator(conn, "auto").authenticate(secret)
        assert who is not None and who.key_id == old.key_id
        assert store.update(old.key_id, model_limits={"a": {"tpm": 7}}).model_limits == {"a": {"tpm": 7}}
    finally:
        conn.close()
        if lock is not None:
            lock.release()
    _store(db)  # the server's ledger opens the migrated file (nothing left to migrate)


# -- the CLI -------------------------------------------------------------------------------------


def test_model_limit_flag_parsing() -> None:
    assert parse_model_limits(["small:tpm=1000,rpm=10,daily=50000"]) == {
        "small": {"tpm": 1000, "rpm": 10, "daily_tokens": 50_000}}
    # Ollama-style names keep their tag (the last `:` separates); repeated models merge.
    assert parse_model_limits(["llama3:8b:tpm=5", "llama3:8b:daily-tokens=9", "b:RPM=0"]) == {
        "llama3:8b": {"tpm": 5, "daily_tokens": 9}, "b": {"rpm": 0}}
    assert parse_model_limits(None) == {}
    for bad, match in (("small", "expected MODEL:LIMIT=N"), (":tpm=5", "expected MODEL:LIMIT=N"),
                       ("small:tokens=5", "'tokens=5' is not LIMIT=N"), ("small:tpm=lots", "tpm must be an integer"),
                       ("small:tpm", "'tpm' is not LIMIT=N")):
        with pytest.raises(ValueError, match=match):
            parse_model_limits([bad])


def test_keys_cli_creates_updates_lists_and_clears_model_limits(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from server.cli import main

    db = str(tmp_path / "l.db")

    def run(*args: str) -> tuple[int, str, str]:
        try:
            rc = main(list(args))
        except SystemExit as e:
            rc = int(e.code or 0)
        out = capsys.readouterr()
        return rc or 0, out.out, out.err

    rc, out, _ = run("keys", "create", "--name", "a", "--db", db, "--json", "--tpm", "900",
                     "--model-limit", "small:tpm=1000,rpm=10,daily=50000", "--model-limit", "big:daily=7")
    assert rc == 0
    key = json.loads(out)
    assert key["model_limits"] == {"small": {"tpm": 1000, "rpm": 10, "daily_tokens": 50_000}, "big": {"daily_tokens": 7}}
    rc, out, _ = run("keys", "update", key["key_id"], "--db", db, "--model-limit", "small:rpm=0",
                     "--clear-model-limit", "big")
    assert rc == 0 and json.loads(out)["model_limits"] == {"small": {"tpm": 1000, "daily_tokens": 50_000}}
    rc, out, _ = run("keys", "list", "--db", db)
    assert rc == 0 and "MODEL LIMITS" in out and "small:daily=50000,tpm=1000" in out
    rc, _, err = run("keys", "create", "--name", "b", "--db", db, "--model-limit", "small:tpm=-3")
    assert rc == 2 and "must be a positive integer" in err
    rc, _, err = run("keys", "create", "--name", "b", "--db", db, "--model-limit", "small")
    assert rc == 2 and "--model-limit: expected MODEL:LIMIT=N" in err
