"""The store's one schema and its migrations: ``migrate`` runs once, when the store opens.

A new database gets ``_SCHEMA`` whole; an older one runs each step of its migrations from its version up to
``SCHEMA_VERSION``, all in one transaction, so a failed upgrade leaves it as it was. A database newer than this
twinkle is refused rather than misread.

- SQLite keeps its version in ``PRAGMA user_version`` and migrates with ``_MIGRATIONS``.
- PostgreSQL gets the same schema in its own types (``postgres_schema``: 64-bit integers, double precision
  times, ``BYTEA``, and a ``rowid`` column where SQLite has its own), keeps its version in the table
  ``twinkle_schema``, and migrates with ``_POSTGRES_MIGRATIONS`` (SQLite's steps after its first version, 8, in
  its types). Gateways starting together take turns: the migration holds a transaction-wide advisory lock.
"""

from __future__ import annotations

import re

from twinkle.errors import StateError
from twinkle.server.store.database import Connection, Database

SCHEMA_VERSION = 11

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    key_hash TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL,
    -- 1 when the tenant comes from the server's API keys file, which then decides its key.
    from_keys_file INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
    base_model TEXT NOT NULL,
    adapter_name TEXT NOT NULL,
    config_json TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_request_at REAL NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('active', 'released', 'deleted')),
    -- The Tinker session that created the run (NULL for runs of the native API).
    session_id TEXT,
    UNIQUE (id, tenant_id)
);
CREATE INDEX IF NOT EXISTS runs_by_tenant ON runs (tenant_id, created_at);
CREATE INDEX IF NOT EXISTS runs_by_activity ON runs (status, last_request_at);
CREATE TABLE IF NOT EXISTS checkpoints (
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    tenant_id TEXT NOT NULL,
    name TEXT NOT NULL,
    path TEXT NOT NULL,
    -- 'external': weights exported for download (Tinker's save_weights_external).
    kind TEXT NOT NULL CHECK (kind IN ('training', 'sampler', 'external')),
    size_bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    -- A published checkpoint may be loaded (never listed, changed or deleted) by other tenants.
    public INTEGER NOT NULL DEFAULT 0,
    -- Unix time after which the checkpoint is deleted (NULL: kept until deleted).
    expires_at REAL,
    UNIQUE (run_id, kind, name),
    FOREIGN KEY (run_id, tenant_id) REFERENCES runs (id, tenant_id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS checkpoints_by_tenant ON checkpoints (tenant_id, created_at);
CREATE INDEX IF NOT EXISTS checkpoints_by_expiry ON checkpoints (expires_at);
CREATE TABLE IF NOT EXISTS futures (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
    run_id TEXT,
    op TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'running', 'done', 'failed')),
    result_json TEXT,
    error TEXT,
    category TEXT CHECK (category IN ('user', 'server')),
    created_at REAL NOT NULL,
    finished_at REAL,
    -- When its job started on a worker (NULL: it has not), and the Tinker session it belongs to.
    started_at REAL,
    session_id TEXT,
    -- The client's Idempotency-Key of the request (NULL: none), one future per tenant and key, and the
    -- hash of what it asked (operation, run, body): the same key sent again is answered this future.
    idempotency_key TEXT,
    request_hash TEXT,
    FOREIGN KEY (run_id, tenant_id) REFERENCES runs (id, tenant_id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS futures_by_status ON futures (status);
CREATE UNIQUE INDEX IF NOT EXISTS futures_by_idempotency_key ON futures (tenant_id, idempotency_key);
CREATE INDEX IF NOT EXISTS futures_by_session ON futures (session_id, created_at);
-- What a run brought back finds acknowledged since its state was kept (``Futures.answered_since``).
CREATE INDEX IF NOT EXISTS futures_by_run ON futures (run_id, started_at);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
    info_json TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_heartbeat_at REAL NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('active', 'finished')),
    -- When the session was taken for gone: no heartbeat for tinker.session_timeout_s (NULL: it was not).
    expired_at REAL
);
CREATE INDEX IF NOT EXISTS sessions_by_tenant ON sessions (tenant_id, created_at);
CREATE TABLE IF NOT EXISTS sampling_sessions (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    base_model TEXT NOT NULL,
    -- The tinker:// path of the sampler weights (NULL: the base model).
    model_path TEXT,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS model_restarts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    -- The hosted base model (as the config names it) whose worker processes were started again.
    base_model TEXT NOT NULL,
    reason TEXT NOT NULL,
    at REAL NOT NULL
);
-- A run's figures at each optimizer step (loss, lr, grad_norm, tokens_per_s), as JSON.
CREATE TABLE IF NOT EXISTS run_steps (
    run_id TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step INTEGER NOT NULL,
    at REAL NOT NULL,
    figures_json TEXT NOT NULL,
    PRIMARY KEY (run_id, step)
);
-- A run brought back with less than it had (a model worker died, or only weights were saved): the
-- step it continued from, the checkpoint it came from (NULL: the server's own saved state), whether its
-- optimizer started afresh, and how many recorded steps after that step it lost.
CREATE TABLE IF NOT EXISTS run_restores (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    at REAL NOT NULL,
    step INTEGER NOT NULL,
    checkpoint TEXT,
    fresh_optimizer INTEGER NOT NULL,
    lost_steps INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS run_restores_by_run ON run_restores (run_id, id);
-- The kept state a run continues from (its folder, ``state@<id>``, in host memory or on disk, NULL: none)
-- and when it was committed, the requests acknowledged after it that a worker's death lost, as JSON, until
-- the run's client is told (NULL: none), and the time up to which acknowledged requests were looked at.
CREATE TABLE IF NOT EXISTS run_states (
    run_id TEXT PRIMARY KEY REFERENCES runs(id) ON DELETE CASCADE,
    folder TEXT,
    at REAL NOT NULL,
    lost_json TEXT,
    lost_through REAL NOT NULL DEFAULT 0
);
-- A sequence sampled with Tinker's record_stability_info: its prompt, sampled tokens (int64) and the
-- sampler's logprobs (float32), for stable_reinforce. It expires a day after it was last used.
CREATE TABLE IF NOT EXISTS sampled_sequences (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    prompt BLOB NOT NULL,
    tokens BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    created_at REAL NOT NULL,
    last_used_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS sampled_sequences_by_use ON sampled_sequences (last_used_at);
-- What a tenant used, summed per UTC hour: tokens trained, prompt and sampled tokens, compute seconds
-- and checkpoints saved, by run ('' for sampling without one), Tinker session ('' for none) and base
-- model. No key to runs: a deleted run's usage stays the tenant's.
CREATE TABLE IF NOT EXISTS usage (
    tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
    run_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    base_model TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('training', 'sampling_prefill', 'sampling_sample', 'compute_seconds',
                                       'checkpoint')),
    hour REAL NOT NULL,
    quantity REAL NOT NULL,
    PRIMARY KEY (tenant_id, hour, run_id, session_id, base_model, kind)
);
"""


def _creating(*tables: str) -> list[str]:
    """The statements of the schema that create ``tables`` and their indexes."""
    pattern = re.compile(r'(?:TABLE IF NOT EXISTS|ON) (\w+) \(')
    return [statement for statement in _SCHEMA.split(';') if (m := pattern.search(statement)) and m[1] in tables]


def _without(column: str, statements: list[str]) -> list[str]:
    """``statements`` without the definition of ``column`` (and the comments above it): a table as an
    early step made it from ``_SCHEMA``, before a later step added the column."""
    definition = re.compile(rf',\n(?:[ \t]*--[^\n]*\n)*[ \t]*{column} [^,\n]*')
    return [definition.sub('', statement) for statement in statements]


_CHECKPOINT_COLUMNS = 'id, run_id, tenant_id, name, path, kind, size_bytes, created_at, public, expires_at'
#: Statements that bring a database of version ``n - 1`` to version ``n``.
_MIGRATIONS = {
    2: ['ALTER TABLE tenants ADD COLUMN from_keys_file INTEGER NOT NULL DEFAULT 0'],
    3: [
        'ALTER TABLE runs ADD COLUMN session_id TEXT',
        'ALTER TABLE checkpoints RENAME TO checkpoints_v2',
        *_creating('checkpoints'),
        *_without('expired_at', _creating('sessions')),  # step 11 adds it
        *_creating('sampling_sessions'),
        'INSERT INTO checkpoints (id, run_id, tenant_id, name, path, kind, size_bytes, created_at) '
        'SELECT id, run_id, tenant_id, name, path, kind, size_bytes, created_at FROM checkpoints_v2',
        'DROP TABLE checkpoints_v2',
    ],
    4: _creating('model_restarts'),
    # The kind 'external': SQLite cannot change a CHECK, so the table is rebuilt.
    5: [
        'DROP INDEX IF EXISTS checkpoints_by_tenant',
        'DROP INDEX IF EXISTS checkpoints_by_expiry',
        'ALTER TABLE checkpoints RENAME TO checkpoints_v4',
        *_creating('checkpoints'),
        f'INSERT INTO checkpoints ({_CHECKPOINT_COLUMNS}) SELECT {_CHECKPOINT_COLUMNS} FROM checkpoints_v4',
        'DROP TABLE checkpoints_v4',
        *_creating('run_steps'),
    ],
    6: _creating('run_restores'),
    7: _creating('sampled_sequences'),
    8: [
        *_creating('usage'),
        'ALTER TABLE futures ADD COLUMN started_at REAL',
        'ALTER TABLE futures ADD COLUMN session_id TEXT',
        'CREATE INDEX IF NOT EXISTS futures_by_session ON futures (session_id, created_at)',
    ],
    9: [
        'ALTER TABLE futures ADD COLUMN idempotency_key TEXT',
        'ALTER TABLE futures ADD COLUMN request_hash TEXT',
        'CREATE UNIQUE INDEX IF NOT EXISTS futures_by_idempotency_key ON futures (tenant_id, idempotency_key)',
    ],
    10: [*_creating('run_states'), 'CREATE INDEX IF NOT EXISTS futures_by_run ON futures (run_id, started_at)'],
    11: ['ALTER TABLE sessions ADD COLUMN expired_at REAL'],
}


#: The first schema version a PostgreSQL store was made at; each later one needs its step here too.
POSTGRES_FIRST_VERSION = 8
#: Tables whose rows SQLite numbers in ``rowid``, sorted on as the order they were made in.
_ROWID_TABLES = ('runs', 'checkpoints', 'futures', 'sessions', 'sampling_sessions')
#: The advisory lock a PostgreSQL migration holds (any fixed number, the same in every gateway).
_MIGRATION_LOCK = 0x7477696E  # 'twin'


def _postgres_types(sql: str) -> str:
    """SQLite's column types in ``sql`` as PostgreSQL's: 64-bit integers, double precision, ``BYTEA``."""
    sql = sql.replace('INTEGER PRIMARY KEY AUTOINCREMENT', 'BIGSERIAL PRIMARY KEY')
    sql = re.sub(r'\bINTEGER\b', 'BIGINT', sql)
    sql = re.sub(r'\bREAL\b', 'DOUBLE PRECISION', sql)
    return re.sub(r'\bBLOB\b', 'BYTEA', sql)


def postgres_schema() -> list[str]:
    """``_SCHEMA`` in PostgreSQL's types, one statement each."""
    sql = _postgres_types(_SCHEMA)
    for table in _ROWID_TABLES:
        sql = sql.replace(
            f'CREATE TABLE IF NOT EXISTS {table} (\n', f'CREATE TABLE IF NOT EXISTS {table} (\n    rowid BIGSERIAL,\n'
        )
    return [statement for statement in sql.split(';') if statement.strip()]


#: The steps after ``POSTGRES_FIRST_VERSION``: SQLite's, in PostgreSQL's types (no table they create numbers its rows).
_POSTGRES_MIGRATIONS: dict[int, list[str]] = {
    version: [_postgres_types(statement) for statement in _MIGRATIONS[version]]
    for version in range(POSTGRES_FIRST_VERSION + 1, SCHEMA_VERSION + 1)
}


def migrate(db: Database) -> None:
    """Bring the database to ``SCHEMA_VERSION``: create it when new, else migrate it from its version."""
    with db.write() as conn:
        if db.dialect == 'postgresql':
            _migrate_postgres(db, conn)
            return
        version = int(conn.execute('PRAGMA user_version').fetchone()[0])
        _check_version(db, version)
        if version == 0:
            for statement in _SCHEMA.split(';'):
                if statement.strip():
                    conn.execute(statement)
        else:
            for target in range(version + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[target]:
                    conn.execute(statement)
        conn.execute(f'PRAGMA user_version = {SCHEMA_VERSION}')


def _migrate_postgres(db: Database, conn: Connection) -> None:
    conn.execute('SELECT pg_advisory_xact_lock(?)', (_MIGRATION_LOCK,))
    conn.execute('CREATE TABLE IF NOT EXISTS twinkle_schema (version INTEGER NOT NULL)')
    row = conn.execute('SELECT version FROM twinkle_schema').fetchone()
    version = 0 if row is None else int(row[0])
    _check_version(db, version)
    if version == 0:
        for statement in postgres_schema():
            conn.execute(statement)
        conn.execute('INSERT INTO twinkle_schema (version) VALUES (?)', (SCHEMA_VERSION,))
        return
    for target in range(version + 1, SCHEMA_VERSION + 1):
        for statement in _POSTGRES_MIGRATIONS[target]:
            conn.execute(statement)
    conn.execute('UPDATE twinkle_schema SET version = ?', (SCHEMA_VERSION,))


def _check_version(db: Database, version: int) -> None:
    if version > SCHEMA_VERSION:
        raise StateError(
            f'{db.where} has schema version {version}, newer than the {SCHEMA_VERSION} this twinkle '
            'understands: upgrade twinkle or point the server at another database'
        )
