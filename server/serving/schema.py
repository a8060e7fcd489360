"""The ledger's schema: its migrations, shared by the SQLite and PostgreSQL backends.

Migration i brings the schema from version i to i + 1; `ledger._migrate` runs them on SQLite,
`ledger_pg` (through `pg_migration`) on PostgreSQL. A database at a newer version is refused.
"""
from __future__ import annotations

# Never edit a released entry; append.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE requests (
        request_id       TEXT PRIMARY KEY,
        idempotency_key  TEXT UNIQUE,
        kind             TEXT NOT NULL,
        api              TEXT NOT NULL,
        client           TEXT,
        model            TEXT,
        state            TEXT NOT NULL,
        priority         INTEGER NOT NULL DEFAULT 0,
        params_json      TEXT,
        prompt_json      TEXT,
        created_at       REAL NOT NULL,
        admitted_at      REAL,
        first_token_at   REAL,
        finished_at      REAL,
        prompt_tokens    INTEGER NOT NULL DEFAULT 0,
        completion_tokens INTEGER NOT NULL DEFAULT 0,
        cached_tokens    INTEGER NOT NULL DEFAULT 0,
        finish_reason    TEXT,
        error            TEXT,
        output_text      TEXT,
        output_json      TEXT
    );
    CREATE INDEX requests_created_at ON requests (created_at);
    CREATE INDEX requests_state ON requests (state);
    """,
    # 2: the fingerprint of the request an idempotency key was first used for (server.serving.idempotency).
    """
    ALTER TABLE requests ADD COLUMN request_hash TEXT;
    """,
    # 3: API keys (server.gateway.keys) and each request's owning key. `key_generation` is bumped
    # by every key change, so a running server reloads its key cache when the CLI edits keys.
    """
    CREATE TABLE api_keys (
        key_id        TEXT PRIMARY KEY,
        name          TEXT NOT NULL,
        secret_hash   TEXT NOT NULL,
        daily_tokens  INTEGER,
        tpm           INTEGER,
        rpm           INTEGER,
        max_priority  TEXT NOT NULL DEFAULT 'interactive',
        created_at    REAL NOT NULL,
        expires_at    REAL,
        revoked_at    REAL
    );
    CREATE TABLE key_generation (generation INTEGER NOT NULL);
    INSERT INTO key_generation (generation) VALUES (0);
    ALTER TABLE requests ADD COLUMN key_id TEXT;
    CREATE INDEX requests_key_created ON requests (key_id, created_at);
    """,
    # 4: the batch tier (server.gateway): uploaded files, batches, and each batch line's progress.
    """
    CREATE TABLE files (
        file_id     TEXT PRIMARY KEY,
        purpose     TEXT NOT NULL,
        filename    TEXT NOT NULL,
        bytes       INTEGER NOT NULL,
        created_at  REAL NOT NULL
    );
    CREATE TABLE batches (
        batch_id          TEXT PRIMARY KEY,
        input_file_id     TEXT NOT NULL,
        endpoint          TEXT NOT NULL,
        completion_window TEXT NOT NULL,
        status            TEXT NOT NULL,
        metadata_json     TEXT,
        errors_json       TEXT,
        created_at        REAL NOT NULL,
        in_progress_at    REAL,
        finalizing_at     REAL,
        completed_at      REAL,
        failed_at         REAL,
        cancelling_at     REAL,
        cancelled_at      REAL,
        output_file_id    TEXT,
        error_file_id     TEXT,
        total             INTEGER NOT NULL DEFAULT 0,
        completed         INTEGER NOT NULL DEFAULT 0,
        failed            INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX batches_created_at ON batches (created_at);
    CREATE TABLE batch_lines (
        batch_id      TEXT NOT NULL,
        line_no       INTEGER NOT NULL,
        custom_id     TEXT,
        status        TEXT NOT NULL,
        attempt       INTEGER NOT NULL DEFAULT 0,
        request_id    TEXT,
        result_json   TEXT,
        PRIMARY KEY (batch_id, line_no)
    );
    """,
    # 5: the owning API key of each file and batch (server.gateway), like requests.key_id: a key
    # sees only its own; NULL when authentication was off (rows from v4 stay NULL: the admin's).
    """
    ALTER TABLE files ADD COLUMN key_id TEXT;
    ALTER TABLE batches ADD COLUMN key_id TEXT;
    CREATE INDEX batches_key_created ON batches (key_id, created_at);
    """,
    # 6: reasoning tokens apart (of completion_tokens: those inside the model's thinking block,
    # server.text.reasoning), and the Responses API's stored responses (server.api.responses_store):
    # the conversation a `previous_response_id` continues, owned by a key like requests.
    """
    ALTER TABLE requests ADD COLUMN reasoning_tokens INTEGER NOT NULL DEFAULT 0;
    CREATE TABLE responses (
        response_id           TEXT PRIMARY KEY,
        request_id            TEXT,
        key_id                TEXT,
        previous_response_id  TEXT,
        created_at            REAL NOT NULL,
        body_json             TEXT NOT NULL,
        conversation_json     TEXT NOT NULL,
        deleted_at            REAL
    );
    CREATE INDEX responses_key_created ON responses (key_id, created_at);
    """,
    # 7: several replicas on one database (server.serving.ledger_pg). Each replica registers an
    # instance with a lease it renews; a request row and a claimed batch line name their instance;
    # quota_holds are the outstanding token reservations (server.gateway.quota_db); file_blobs hold
    # file bytes where replicas share no disk. SQLite (one process) keeps its flock, in-memory
    # quotas and files folder; it gets the same tables so both backends share one schema.
    """
    CREATE TABLE instances (
        instance_id  TEXT PRIMARY KEY,
        name         TEXT NOT NULL,
        started_at   REAL NOT NULL,
        lease_until  REAL NOT NULL
    );
    ALTER TABLE requests ADD COLUMN instance_id TEXT;
    CREATE INDEX requests_instance_state ON requests (instance_id, state);
    ALTER TABLE batch_lines ADD COLUMN lease_owner TEXT;
    CREATE TABLE quota_holds (
        hold_id      TEXT PRIMARY KEY,
        key_id       TEXT NOT NULL,
        tokens       INTEGER NOT NULL,
        created_at   REAL NOT NULL,
        instance_id  TEXT NOT NULL
    );
    CREATE INDEX quota_holds_key ON quota_holds (key_id, created_at);
    CREATE TABLE file_blobs (
        file_id  TEXT PRIMARY KEY,
        content  BLOB NOT NULL
    );
    """,
    # 8: the per-minute token buckets of a key, shared by replicas (server.gateway.quota_db): the
    # level and the time it was computed at, read, refilled, taken and written back under the key's
    # lock, and given back at settle. kind is 'tokens' (TPM) or 'requests' (RPM).
    """
    CREATE TABLE quota_buckets (
        key_id  TEXT NOT NULL,
        kind    TEXT NOT NULL,
        level   REAL NOT NULL,
        t       REAL NOT NULL,
        PRIMARY KEY (key_id, kind)
    );
    """,
    # 9: per-model limits of a key (server.gateway.keys: JSON {model: {tpm, rpm, daily_tokens}}),
    # and, for a shared database (server.gateway.quota_db), each hold's model and the per-model
    # buckets, as quota_buckets is per key. A key from v8 has none (NULL): its limits are key-wide.
    """
    ALTER TABLE api_keys ADD COLUMN model_limits TEXT;
    ALTER TABLE quota_holds ADD COLUMN model TEXT;
    CREATE TABLE quota_model_buckets (
        key_id  TEXT NOT NULL,
        model   TEXT NOT NULL,
        kind    TEXT NOT NULL,
        level   REAL NOT NULL,
        t       REAL NOT NULL,
        PRIMARY KEY (key_id, model, kind)
    );
    """,
]

SCHEMA_VERSION = len(MIGRATIONS)
