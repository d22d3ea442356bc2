"""The store's one schema and its one migration path: ``migrate`` runs once, when the store opens.

A new file gets ``_SCHEMA`` whole; an older one runs each step of ``_MIGRATIONS`` from its
``PRAGMA user_version`` up to ``SCHEMA_VERSION``, all in one transaction, so a failed upgrade leaves the
file as it was. A file newer than this twinkle is refused rather than misread.
"""

from __future__ import annotations

import re

from twinkle.errors import StateError
from twinkle.server.store.database import Database

SCHEMA_VERSION = 8

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
    FOREIGN KEY (run_id, tenant_id) REFERENCES runs (id, tenant_id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS futures_by_status ON futures (status);
CREATE INDEX IF NOT EXISTS futures_by_session ON futures (session_id, created_at);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
    info_json TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_heartbeat_at REAL NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('active', 'finished'))
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


_CHECKPOINT_COLUMNS = 'id, run_id, tenant_id, name, path, kind, size_bytes, created_at, public, expires_at'
#: Statements that bring a database of version ``n - 1`` to version ``n``.
_MIGRATIONS = {
    2: ['ALTER TABLE tenants ADD COLUMN from_keys_file INTEGER NOT NULL DEFAULT 0'],
    3: [
        'ALTER TABLE runs ADD COLUMN session_id TEXT',
        'ALTER TABLE checkpoints RENAME TO checkpoints_v2',
        *_creating('checkpoints', 'sessions', 'sampling_sessions'),
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
}


def migrate(db: Database) -> None:
    """Bring the file to ``SCHEMA_VERSION``: create it when new, else migrate it from its version."""
    with db.write() as conn:
        version = int(conn.execute('PRAGMA user_version').fetchone()[0])
        if version > SCHEMA_VERSION:
            raise StateError(
                f'{db.path} has schema version {version}, newer than the {SCHEMA_VERSION} this twinkle '
                'understands: upgrade twinkle or point the server at another database'
            )
        if version == 0:
            for statement in _SCHEMA.split(';'):
                if statement.strip():
                    conn.execute(statement)
        else:
            for target in range(version + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[target]:
                    conn.execute(statement)
        conn.execute(f'PRAGMA user_version = {SCHEMA_VERSION}')
