-- The store schema of version 1 (twinkle 0.1.0, before API keys files and Tinker), for migration tests.
CREATE TABLE IF NOT EXISTS tenants (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    key_hash TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL
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
    kind TEXT NOT NULL CHECK (kind IN ('training', 'sampler')),
    size_bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (run_id, name),
    FOREIGN KEY (run_id, tenant_id) REFERENCES runs (id, tenant_id) ON DELETE CASCADE
);
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
    FOREIGN KEY (run_id, tenant_id) REFERENCES runs (id, tenant_id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS futures_by_status ON futures (status);
PRAGMA user_version = 1;
