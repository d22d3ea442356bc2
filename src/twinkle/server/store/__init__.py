"""The service's durable state: tenants, runs, checkpoints and futures in one SQLite file.

Every write is its own transaction, committed with ``synchronous=FULL`` in WAL mode before the method
returns, so a row the server has acknowledged survives a ``kill -9`` (and a power cut); the one
exception, a future marked running, is synced by the next write, and a restart fails it anyway. Every read is
scoped by tenant: another tenant's run, checkpoint or future reads as None, exactly like one that does
not exist, so the server answers 404 for both and leaks nothing.

>>> import tempfile, os
>>> store = Store(os.path.join(tempfile.mkdtemp(), 'twinkle.db'))
>>> tenant, key = store.add_tenant('alice')
>>> store.tenant_for_key(key) == tenant
True
>>> run = store.create_run(tenant.id, 'Qwen/Qwen3-0.6B', 'default', {'r': 8})
>>> store.get_run(tenant.id, run.id).config
{'r': 8}
>>> store.close()
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle.errors import ConfigurationError, DataError, StateError, one_of
from twinkle.server.auth import MIN_KEY_LENGTH, hash_key, new_api_key
from twinkle.wire import TINKER_SCHEME, TWINKLE_SCHEME
from twinkle.wire import parse_checkpoint_path as parse_checkpoint_path  # checkpoint paths are the wire's
from twinkle.wire import parse_twinkle_path as parse_twinkle_path

SCHEMA_VERSION = 5
RUN_STATUSES = ('active', 'released', 'deleted')
CHECKPOINT_KINDS = ('training', 'sampler', 'external')
FUTURE_STATUSES = ('pending', 'running', 'done', 'failed')
ERROR_CATEGORIES = ('user', 'server')

_NAME = re.compile(r'[A-Za-z0-9][A-Za-z0-9._-]{0,63}')
TINKER_FOLDERS = {'training': 'weights', 'sampler': 'sampler_weights', 'external': 'external_weights'}
#: The folder of each kind in a twinkle:// path.
TWINKLE_FOLDERS = {'training': 'checkpoints', 'sampler': 'sampler_weights', 'external': 'external_weights'}

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
    FOREIGN KEY (run_id, tenant_id) REFERENCES runs (id, tenant_id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS futures_by_status ON futures (status);
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
}


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    created_at: float


@dataclass(frozen=True)
class Run:
    id: str
    tenant_id: str
    base_model: str
    adapter_name: str
    # The LoRA / optimizer configuration the run was created with, as the client sent it.
    config: dict[str, Any]
    created_at: float
    last_request_at: float
    status: str
    session_id: str | None = None


@dataclass(frozen=True)
class Checkpoint:
    id: str
    run_id: str
    tenant_id: str
    name: str
    # Where the files are on the server's disk; never shown to clients, who use ``twinkle_path``.
    path: str
    kind: str
    size_bytes: int
    created_at: float
    public: bool = False
    expires_at: float | None = None

    @property
    def twinkle_path(self) -> str:
        return f'{TWINKLE_SCHEME}{self.run_id}/{TWINKLE_FOLDERS[self.kind]}/{self.name}'

    @property
    def checkpoint_id(self) -> str:
        """The Tinker name: ``weights/<name>``, ``sampler_weights/<name>`` or ``external_weights/<name>``."""
        return f'{TINKER_FOLDERS[self.kind]}/{self.name}'

    @property
    def tinker_path(self) -> str:
        return f'{TINKER_SCHEME}{self.run_id}/{self.checkpoint_id}'


@dataclass(frozen=True)
class Session:
    id: str
    tenant_id: str
    #: What the client sent: tags, user_metadata, sdk_version.
    info: dict[str, Any]
    created_at: float
    last_heartbeat_at: float
    status: str


@dataclass(frozen=True)
class SamplingSession:
    id: str
    tenant_id: str
    session_id: str
    base_model: str
    model_path: str | None
    created_at: float


@dataclass(frozen=True)
class FutureRecord:
    id: str
    tenant_id: str
    run_id: str | None
    op: str
    status: str
    # The JSON-decoded result of a 'done' future; None otherwise.
    result: Any
    # What went wrong, and whose fault it was ('user' or 'server'), for a 'failed' future.
    error: str | None
    category: str | None
    created_at: float
    finished_at: float | None

    @property
    def finished(self) -> bool:
        return self.status in ('done', 'failed')


def check_name(kind: str, name: object) -> str:
    """Return ``name`` if it is a safe adapter / checkpoint / tenant name, else raise DataError.

    Safe means 1 to 64 of ``A-Z a-z 0-9 . _ -``, starting with a letter or digit: no separators, no
    ``..``, no hidden files, so a name can never reach outside the directory it is joined to.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise DataError(
            f'Invalid {kind} name {name!r}: use 1 to 64 characters from A-Z, a-z, 0-9, ".", "_", "-", '
            'starting with a letter or digit'
        )
    return name


#: Folders of a run's directory that hold something else than a checkpoint of that name.
RESERVED_CHECKPOINT_NAMES = ('released-state', 'sampler_weights', 'external_weights')


def check_checkpoint_name(name: object) -> str:
    """A safe checkpoint name (``check_name``) that is not one of the run directory's own folders."""
    name = check_name('checkpoint', name)
    if name in RESERVED_CHECKPOINT_NAMES:
        raise DataError(f'checkpoint name {name!r} is reserved; use another than {list(RESERVED_CHECKPOINT_NAMES)}')
    return name


def _new_id(prefix: str) -> str:
    return f'{prefix}-{secrets.token_hex(6)}'


class Store:
    """Tenants, runs, checkpoints and futures in the SQLite file at ``path``; safe to share across threads.

    One connection serves every thread, one statement at a time behind a lock: SQLite writes one
    transaction at a time anyway, and the service's rows are few and small. ``clock`` gives the time
    stamps (unix seconds); tests pass a fake one.
    """

    def __init__(self, path: str | os.PathLike, *, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._lock = threading.Lock()
        # Autocommit mode: transactions are opened explicitly in _write, never implicitly by the driver.
        self._conn: sqlite3.Connection | None = sqlite3.connect(
            self.path, timeout=30.0, isolation_level=None, check_same_thread=False
        )
        try:
            self._conn.row_factory = sqlite3.Row
            self._conn.execute('PRAGMA journal_mode=WAL')
            # FULL: every commit is fsynced before it returns, so an acknowledged row survives a crash.
            self._conn.execute('PRAGMA synchronous=FULL')
            self._conn.execute('PRAGMA foreign_keys=ON')
            self._migrate()
        except BaseException:
            self.close()
            raise

    def _migrate(self) -> None:
        with self._write() as conn:
            version = conn.execute('PRAGMA user_version').fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StateError(
                    f'{self.path} has schema version {version}, newer than the {SCHEMA_VERSION} this twinkle '
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

    # -- plumbing ---------------------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StateError('the store is closed: the server is stopping')  # a tenant may read this: no path
        return self._conn

    @contextmanager
    def _write(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction, holding the lock; committed (and fsynced) when the block ends.

        ``durable=False`` commits without the fsync (``synchronous=NORMAL``): for a row a crash may
        lose because the restart undoes it anyway. The next durable commit syncs it with its own."""
        with self._lock:
            conn = self._connection()
            if not durable:
                conn.execute('PRAGMA synchronous=NORMAL')
            try:
                conn.execute('BEGIN IMMEDIATE')
                try:
                    yield conn
                except BaseException:
                    conn.execute('ROLLBACK')
                    raise
                conn.execute('COMMIT')
            finally:
                if not durable:
                    conn.execute('PRAGMA synchronous=FULL')

    def _query(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._connection().execute(sql, params).fetchall()

    def _execute(self, sql: str, params: tuple = (), durable: bool = True) -> int:
        """Run one writing statement; return how many rows it changed."""
        with self._write(durable) as conn:
            return conn.execute(sql, params).rowcount

    def close(self) -> None:
        """Close the connection (checkpointing the WAL into the main file); later calls raise StateError."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- tenants ----------------------------------------------------------------------------------------

    def add_tenant(self, name: str, key: str | None = None) -> tuple[Tenant, str]:
        """Create a tenant; return it with its API key, the only time the plaintext key is available."""
        check_name('tenant', name)
        if key is None:
            key = new_api_key()
        elif len(key) < MIN_KEY_LENGTH or key != key.strip():
            raise ConfigurationError(
                f'An API key for tenant {name!r} must be at least {MIN_KEY_LENGTH} random characters without '
                'surrounding whitespace; leave key=None to have one generated'
            )
        tenant = Tenant(id=_new_id('tn'), name=name, created_at=self._clock())
        try:
            self._execute(
                'INSERT INTO tenants (id, name, key_hash, created_at) VALUES (?, ?, ?, ?)',
                (tenant.id, name, hash_key(key), tenant.created_at),
            )
        except sqlite3.IntegrityError as exc:
            what = f'a tenant named {name!r}' if 'tenants.name' in str(exc) else 'a tenant with that API key'
            raise ConfigurationError(f'There is already {what}; choose another') from exc
        return tenant, key

    def sync_keys_file(self, key_hashes: dict[str, str]) -> None:
        """Make the tenants of the API keys file (name -> key hash) exactly ``key_hashes``: add the
        new ones, give changed keys their new hash, and remove the file's former tenants that it
        no longer lists. Tenants added with ``add_tenant`` are left alone."""
        with self._write() as conn:
            listed = {row['name'] for row in conn.execute('SELECT name FROM tenants WHERE from_keys_file = 1')}
            for name in listed - set(key_hashes):
                conn.execute('DELETE FROM tenants WHERE name = ?', (name,))
            for name, key_hash in key_hashes.items():
                check_name('tenant', name)
                try:
                    conn.execute(
                        'INSERT INTO tenants (id, name, key_hash, created_at, from_keys_file) VALUES (?, ?, ?, ?, 1) '
                        'ON CONFLICT (name) DO UPDATE SET key_hash = excluded.key_hash, from_keys_file = 1',
                        (_new_id('tn'), name, key_hash, self._clock()),
                    )
                except sqlite3.IntegrityError as exc:
                    message = f'the API keys file gives tenant {name!r} a key another tenant has'
                    raise ConfigurationError(message) from exc

    def tenant_for_key(self, key: str) -> Tenant | None:
        rows = self._query('SELECT id, name, created_at FROM tenants WHERE key_hash = ?', (hash_key(key),))
        return Tenant(**rows[0]) if rows else None

    def list_tenants(self) -> list[Tenant]:
        return [Tenant(**row) for row in self._query('SELECT id, name, created_at FROM tenants ORDER BY name')]

    def remove_tenant(self, name: str) -> bool:
        """Delete a tenant with its runs, checkpoint rows and futures; False if there was none.

        Files on disk are the caller's to remove.
        """
        return self._execute('DELETE FROM tenants WHERE name = ?', (name,)) > 0

    # -- runs -------------------------------------------------------------------------------------------

    def create_run(
        self,
        tenant_id: str,
        base_model: str,
        adapter_name: str,
        config: dict[str, Any],
        *,
        run_id: str | None = None,
        session_id: str | None = None,
    ) -> Run:
        """A new active run; ``run_id`` defaults to a fresh ``run-<hex>`` (Tinker names its own)."""
        check_name('adapter', adapter_name)
        now = self._clock()
        run = Run(run_id or _new_id('run'), tenant_id, base_model, adapter_name, dict(config), now, now, 'active')
        run = Run(**{**vars(run), 'session_id': session_id})
        try:
            self._execute(
                'INSERT INTO runs (id, tenant_id, base_model, adapter_name, config_json, created_at, '
                'last_request_at, status, session_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)',
                (
                    run.id,
                    tenant_id,
                    base_model,
                    adapter_name,
                    _dumps('run config', config),
                    now,
                    now,
                    run.status,
                    session_id,
                ),
            )
        except sqlite3.IntegrityError as exc:
            if 'runs.id' in str(exc):
                raise StateError(f'There is already a run {run.id!r}') from exc
            raise StateError(f'No tenant {tenant_id!r} to create a run for') from exc
        return run

    def get_run_by_id(self, run_id: str) -> Run | None:
        """A run whatever its tenant: for the server's own bookkeeping, never for a request."""
        rows = self._query('SELECT * FROM runs WHERE id = ?', (run_id,))
        return _run(rows[0]) if rows else None

    def get_run(self, tenant_id: str, run_id: str) -> Run | None:
        """The run if it exists and belongs to ``tenant_id`` (whatever its status), else None."""
        rows = self._query('SELECT * FROM runs WHERE id = ? AND tenant_id = ?', (run_id, tenant_id))
        return _run(rows[0]) if rows else None

    def list_runs(self, tenant_id: str, limit: int = 100, offset: int = 0) -> tuple[list[Run], int]:
        """One page of the tenant's runs that are not deleted, newest first, and how many there are in all."""
        where = "FROM runs WHERE tenant_id = ? AND status != 'deleted'"
        rows = self._query(
            f'SELECT * {where} ORDER BY created_at DESC, rowid DESC LIMIT ? OFFSET ?', (tenant_id, limit, offset)
        )
        total = self._query(f'SELECT COUNT(*) {where}', (tenant_id,))[0][0]
        return [_run(row) for row in rows], total

    def touch_run(self, run_id: str) -> None:
        """Record a request to the run now, so that it does not count as idle."""
        self._execute('UPDATE runs SET last_request_at = ? WHERE id = ?', (self._clock(), run_id))

    def set_run_status(self, run_id: str, status: str) -> None:
        if status not in RUN_STATUSES:
            raise one_of('run status', status, RUN_STATUSES)
        self._execute('UPDATE runs SET status = ? WHERE id = ?', (status, run_id))

    def set_run_config(self, run_id: str, config: dict[str, Any]) -> None:
        """Replace a run's configuration (the server appends the setup calls it must replay to
        bring a released adapter back)."""
        self._execute('UPDATE runs SET config_json = ? WHERE id = ?', (json.dumps(config), run_id))

    def active_runs(self, tenant_id: str | None = None) -> list[Run]:
        """Active runs (of one tenant, or of all), least recently used first."""
        if tenant_id is None:
            rows = self._query("SELECT * FROM runs WHERE status = 'active' ORDER BY last_request_at, rowid")
        else:
            sql = "SELECT * FROM runs WHERE status = 'active' AND tenant_id = ? ORDER BY last_request_at, rowid"
            rows = self._query(sql, (tenant_id,))
        return [_run(row) for row in rows]

    def record_restart(self, base_model: str, reason: str) -> None:
        """A model's worker processes were started again (one of them died)."""
        self._execute(
            'INSERT INTO model_restarts (base_model, reason, at) VALUES (?, ?, ?)', (base_model, reason, self._clock())
        )

    def restarts(self, base_model: str) -> list[tuple[str, float]]:
        """The restarts of a model's workers, oldest first: (reason, unix time)."""
        rows = self._query('SELECT reason, at FROM model_restarts WHERE base_model = ? ORDER BY id', (base_model,))
        return [(row['reason'], row['at']) for row in rows]

    def count_runs(self, status: str, *, base_model: str | None = None, tenant_id: str | None = None) -> int:
        """How many runs have ``status``, on ``base_model`` and of ``tenant_id`` when given."""
        where, params = ['status = ?'], [status]
        for column, value in (('base_model', base_model), ('tenant_id', tenant_id)):
            if value is not None:
                where.append(f'{column} = ?')
                params.append(value)
        return int(self._query(f'SELECT COUNT(*) FROM runs WHERE {" AND ".join(where)}', tuple(params))[0][0])

    def add_run_steps(self, run_id: str, steps: list[dict[str, float]]) -> None:
        """Record a run's optimizer steps (``StepLog`` entries: 'step' and its figures); a step
        recorded again (a run resumed from an earlier checkpoint) replaces the old one. Not
        fsynced: a crash may lose the last steps' figures, never the run."""
        now = self._clock()
        rows = [
            (run_id, int(entry['step']), now, json.dumps({k: v for k, v in entry.items() if k != 'step'}))
            for entry in steps
        ]
        with self._write(durable=False) as conn:
            sql = 'INSERT OR REPLACE INTO run_steps (run_id, step, at, figures_json) VALUES (?, ?, ?, ?)'
            conn.executemany(sql, rows)

    def run_steps(self, run_id: str, after: int = 0, limit: int = 1000) -> list[dict[str, float]]:
        """A run's recorded steps after step ``after``, oldest first: ``{'step', 'time', <figures>}``."""
        rows = self._query(
            'SELECT step, at, figures_json FROM run_steps WHERE run_id = ? AND step > ? ORDER BY step LIMIT ?',
            (run_id, after, limit),
        )
        return [{'step': row['step'], 'time': row['at'], **json.loads(row['figures_json'])} for row in rows]

    def idle_runs(self, older_than_s: float) -> list[Run]:
        """Active runs with no request in the last ``older_than_s`` seconds, longest idle first."""
        rows = self._query(
            "SELECT * FROM runs WHERE status = 'active' AND last_request_at < ? ORDER BY last_request_at",
            (self._clock() - older_than_s,),
        )
        return [_run(row) for row in rows]

    # -- checkpoints ------------------------------------------------------------------------------------

    def add_checkpoint(
        self,
        tenant_id: str,
        run_id: str,
        name: str,
        path: str,
        kind: str,
        size_bytes: int,
        *,
        expires_at: float | None = None,
    ) -> Checkpoint:
        """Record a saved checkpoint, replacing the run's earlier one of the same kind and name."""
        check_name('checkpoint', name)
        if kind not in CHECKPOINT_KINDS:
            raise one_of('checkpoint kind', kind, CHECKPOINT_KINDS)
        checkpoint = Checkpoint(
            _new_id('ckpt'), run_id, tenant_id, name, str(path), kind, size_bytes, self._clock(), False, expires_at
        )
        try:
            with self._write() as conn:
                conn.execute('DELETE FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?', (run_id, kind, name))
                conn.execute(
                    'INSERT INTO checkpoints (id, run_id, tenant_id, name, path, kind, size_bytes, created_at, '
                    'public, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)',
                    tuple(vars(checkpoint).values()),
                )
        except sqlite3.IntegrityError as exc:
            raise StateError(f'Tenant {tenant_id!r} has no run {run_id!r} to add checkpoint {name!r} to') from exc
        return checkpoint

    def list_checkpoints(self, tenant_id: str, run_id: str) -> list[Checkpoint]:
        rows = self._query(
            'SELECT * FROM checkpoints WHERE tenant_id = ? AND run_id = ? ORDER BY created_at, rowid',
            (tenant_id, run_id),
        )
        return [_checkpoint(row) for row in rows]

    def list_tenant_checkpoints(
        self, tenant_id: str, limit: int = 100, offset: int = 0
    ) -> tuple[list[Checkpoint], int]:
        """One page of every checkpoint of the tenant, newest first, and how many there are in all."""
        rows = self._query(
            'SELECT * FROM checkpoints WHERE tenant_id = ? ORDER BY created_at DESC, rowid DESC LIMIT ? OFFSET ?',
            (tenant_id, limit, offset),
        )
        total = self._query('SELECT COUNT(*) FROM checkpoints WHERE tenant_id = ?', (tenant_id,))[0][0]
        return [_checkpoint(row) for row in rows], total

    def get_checkpoint(self, tenant_id: str, run_id: str, name: str, kind: str = 'training') -> Checkpoint | None:
        rows = self._query(
            'SELECT * FROM checkpoints WHERE tenant_id = ? AND run_id = ? AND kind = ? AND name = ?',
            (tenant_id, run_id, kind, name),
        )
        return _checkpoint(rows[0]) if rows else None

    def get_checkpoint_by_id(self, checkpoint_id: str) -> Checkpoint | None:
        """The checkpoint of this store id, whoever owns it (for links the server signed)."""
        rows = self._query('SELECT * FROM checkpoints WHERE id = ?', (checkpoint_id,))
        return _checkpoint(rows[0]) if rows else None

    def get_readable_checkpoint(self, tenant_id: str, run_id: str, name: str, kind: str) -> Checkpoint | None:
        """A checkpoint the tenant may load: its own, or another tenant's published one."""
        rows = self._query(
            'SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ? AND (tenant_id = ? OR public = 1)',
            (run_id, kind, name, tenant_id),
        )
        return _checkpoint(rows[0]) if rows else None

    def delete_checkpoint(self, tenant_id: str, run_id: str, name: str, kind: str = 'training') -> bool:
        """Forget the checkpoint row (the caller deletes its files); False if the tenant had no such one."""
        sql = 'DELETE FROM checkpoints WHERE tenant_id = ? AND run_id = ? AND kind = ? AND name = ?'
        return self._execute(sql, (tenant_id, run_id, kind, name)) > 0

    def set_checkpoint_public(self, checkpoint_id: str, public: bool) -> None:
        self._execute('UPDATE checkpoints SET public = ? WHERE id = ?', (int(public), checkpoint_id))

    def set_checkpoint_expiry(self, checkpoint_id: str, expires_at: float | None) -> None:
        self._execute('UPDATE checkpoints SET expires_at = ? WHERE id = ?', (expires_at, checkpoint_id))

    def pop_expired_checkpoints(self) -> list[Checkpoint]:
        """Forget every checkpoint whose time is up and return them (the caller deletes their files)."""
        with self._write() as conn:
            now = self._clock()
            rows = conn.execute('SELECT * FROM checkpoints WHERE expires_at <= ?', (now,)).fetchall()
            conn.execute('DELETE FROM checkpoints WHERE expires_at <= ?', (now,))
        return [_checkpoint(row) for row in rows]

    # -- Tinker sessions --------------------------------------------------------------------------------

    def create_session(self, tenant_id: str, info: dict[str, Any]) -> Session:
        now = self._clock()
        session = Session(_new_id('sess'), tenant_id, dict(info), now, now, 'active')
        self._execute(
            'INSERT INTO sessions (id, tenant_id, info_json, created_at, last_heartbeat_at, status) '
            "VALUES (?, ?, ?, ?, ?, 'active')",
            (session.id, tenant_id, _dumps('session info', info), now, now),
        )
        return session

    def get_session(self, tenant_id: str, session_id: str) -> Session | None:
        rows = self._query('SELECT * FROM sessions WHERE id = ? AND tenant_id = ?', (session_id, tenant_id))
        return _session(rows[0]) if rows else None

    def list_sessions(self, tenant_id: str, limit: int = 100, offset: int = 0) -> list[Session]:
        rows = self._query(
            'SELECT * FROM sessions WHERE tenant_id = ? ORDER BY created_at DESC, rowid DESC LIMIT ? OFFSET ?',
            (tenant_id, limit, offset),
        )
        return [_session(row) for row in rows]

    def heartbeat(self, session_id: str) -> None:
        self._execute('UPDATE sessions SET last_heartbeat_at = ? WHERE id = ?', (self._clock(), session_id))

    def finish_session(self, session_id: str) -> None:
        self._execute("UPDATE sessions SET status = 'finished' WHERE id = ?", (session_id,))

    def session_runs(self, tenant_id: str, session_id: str) -> list[str]:
        rows = self._query(
            'SELECT id FROM runs WHERE tenant_id = ? AND session_id = ? ORDER BY created_at, rowid',
            (tenant_id, session_id),
        )
        return [row['id'] for row in rows]

    def create_sampling_session(
        self, tenant_id: str, sampling_id: str, session_id: str, base_model: str, model_path: str | None
    ) -> SamplingSession:
        """Record a sampling session named ``sampling_id``; the same id again returns the first one."""
        existing = self.get_sampling_session(tenant_id, sampling_id)
        if existing is not None:
            return existing
        record = SamplingSession(sampling_id, tenant_id, session_id, base_model, model_path, self._clock())
        try:
            self._execute(
                'INSERT INTO sampling_sessions (id, tenant_id, session_id, base_model, model_path, created_at) '
                'VALUES (?, ?, ?, ?, ?, ?)',
                tuple(vars(record).values()),
            )
        except sqlite3.IntegrityError as exc:
            raise StateError(f'sampling session {sampling_id!r} cannot be created: {exc}') from exc
        return record

    def get_sampling_session(self, tenant_id: str, sampling_id: str) -> SamplingSession | None:
        rows = self._query('SELECT * FROM sampling_sessions WHERE id = ? AND tenant_id = ?', (sampling_id, tenant_id))
        return SamplingSession(**rows[0]) if rows else None

    def session_samplers(self, tenant_id: str, session_id: str) -> list[str]:
        rows = self._query(
            'SELECT id FROM sampling_sessions WHERE tenant_id = ? AND session_id = ? ORDER BY created_at, rowid',
            (tenant_id, session_id),
        )
        return [row['id'] for row in rows]

    # -- futures ----------------------------------------------------------------------------------------

    def create_future(self, tenant_id: str, run_id: str | None, op: str) -> FutureRecord:
        future = FutureRecord(_new_id('fut'), tenant_id, run_id, op, 'pending', None, None, None, self._clock(), None)
        try:
            self._execute(
                "INSERT INTO futures (id, tenant_id, run_id, op, status, created_at) VALUES (?, ?, ?, ?, 'pending', ?)",
                (future.id, tenant_id, run_id, op, future.created_at),
            )
        except sqlite3.IntegrityError as exc:
            raise StateError(f'Tenant {tenant_id!r} has no run {run_id!r} to start {op!r} on') from exc
        return future

    def set_future_running(self, future_id: str) -> bool:
        """Move a pending future to running; False if it was not pending. Not synced to disk on its
        own: after a crash, ``fail_unfinished_futures`` fails a running future as it does a pending one."""
        sql = "UPDATE futures SET status = 'running' WHERE id = ? AND status = 'pending'"
        return self._execute(sql, (future_id,), durable=False) > 0

    def finish_future(self, future_id: str, result: Any) -> bool:
        """Store the JSON-encoded ``result`` of an unfinished future; False if it had already finished.

        A finished future never changes again, so a worker that completes after the future was failed
        (say by ``fail_unfinished_futures``) cannot overwrite what the client was told.
        """
        return self._finish(future_id, 'done', _dumps('future result', result), None, None)

    def fail_future(self, future_id: str, error: str, category: str) -> bool:
        """Mark an unfinished future failed, blaming ``category`` ('user' or 'server'); False if finished."""
        if category not in ERROR_CATEGORIES:
            raise one_of('error category', category, ERROR_CATEGORIES)
        return self._finish(future_id, 'failed', None, error, category)

    def _finish(
        self, future_id: str, status: str, result_json: str | None, error: str | None, category: str | None
    ) -> bool:
        sql = (
            'UPDATE futures SET status = ?, result_json = ?, error = ?, category = ?, finished_at = ? '
            "WHERE id = ? AND status IN ('pending', 'running')"
        )
        return self._execute(sql, (status, result_json, error, category, self._clock(), future_id)) > 0

    def get_future(self, tenant_id: str, future_id: str) -> FutureRecord | None:
        rows = self._query('SELECT * FROM futures WHERE id = ? AND tenant_id = ?', (future_id, tenant_id))
        return _future(rows[0]) if rows else None

    def fail_unfinished_futures(self, reason: str) -> int:
        """At server start: fail every pending or running future as the server's fault; return how many.

        Their work died with the previous process, so their clients would otherwise wait for ever.
        """
        sql = (
            "UPDATE futures SET status = 'failed', error = ?, category = 'server', finished_at = ? "
            "WHERE status IN ('pending', 'running')"
        )
        return self._execute(sql, (reason, self._clock()))


def _dumps(what: str, value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise DataError(
            f'The {what} must be JSON-serializable (dicts, lists, str, numbers, bool, None): {exc}'
        ) from exc


def _run(row: sqlite3.Row) -> Run:
    fields = dict(row)
    fields['config'] = json.loads(fields.pop('config_json'))
    return Run(**fields)


def _checkpoint(row: sqlite3.Row) -> Checkpoint:
    fields = dict(row)
    fields['public'] = bool(fields['public'])
    return Checkpoint(**fields)


def _session(row: sqlite3.Row) -> Session:
    fields = dict(row)
    fields['info'] = json.loads(fields.pop('info_json'))
    return Session(**fields)


def _future(row: sqlite3.Row) -> FutureRecord:
    fields = dict(row)
    result_json = fields.pop('result_json')
    fields['result'] = None if result_json is None else json.loads(result_json)
    return FutureRecord(**fields)
