"""The service's durable state, one aggregate per attribute of ``Store``: in one SQLite file (the embedded
default), or in a PostgreSQL database that several gateways share (``Store('postgresql://...')``).

``store.tenants`` (tenants and their API keys), ``store.runs``, ``store.checkpoints``, ``store.sessions`` (Tinker
sessions and their sampling sessions), ``store.futures``, ``store.history`` (each run's steps, each model's
restarts), ``store.sequences`` (Tinker's sampled sequences kept for ``stable_reinforce``), ``store.usage`` (what
each tenant used, per hour) and ``store.states`` (the kept state each run continues from, and what it lost)
share one connection and its lock (``database.py``); the schema and its migrations are ``schema.py``, run once
when the store opens.

Every write is its own transaction, committed with ``synchronous=FULL`` in WAL mode before the method
returns, so a row the server has acknowledged survives a ``kill -9`` (and a power cut); the exceptions,
a future's writes and a run's step figures, survive a ``kill -9`` too (a WAL commit is in the file once
it returns) and are synced by the next durable write (``futures.py``, ``history.py``). Every read is
scoped by tenant: another tenant's run, checkpoint or future reads as None, exactly like one that does
not exist, so the server answers 404 for both and leaks nothing.

>>> import tempfile, os
>>> store = Store(os.path.join(tempfile.mkdtemp(), 'twinkle.db'))
>>> tenant, key = store.tenants.add('alice')
>>> store.tenants.for_key(key) == tenant
True
>>> run = store.runs.create(tenant.id, 'Qwen/Qwen3-0.6B', 'default', {'r': 8})
>>> store.runs.get(tenant.id, run.id).config
{'r': 8}
>>> store.close()
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

from twinkle.server.store.checkpoints import (
    CHECKPOINT_KINDS,
    RESERVED_CHECKPOINT_NAMES,
    TINKER_FOLDERS,
    TWINKLE_FOLDERS,
    Checkpoint,
    Checkpoints,
    check_checkpoint_name,
)
from twinkle.server.store.database import Database, SqliteDatabase, check_name
from twinkle.server.store.futures import (
    ERROR_CATEGORIES,
    FUTURE_STATUSES,
    FutureRecord,
    Futures,
    KnownRequest,
    RequestKey,
)
from twinkle.server.store.history import History
from twinkle.server.store.postgres import CONNECT_TIMEOUT_S, PostgresDatabase, is_postgres_url
from twinkle.server.store.runs import RUN_STATUSES, Run, Runs
from twinkle.server.store.schema import SCHEMA_VERSION, migrate
from twinkle.server.store.sequences import SEQUENCE_TTL_S, SampledRecord, SampledSequences
from twinkle.server.store.sessions import SamplingSession, Session, Sessions
from twinkle.server.store.states import KeptState, LostRequest, States
from twinkle.server.store.tenants import Tenant, Tenants
from twinkle.server.store.usage import HOUR_S, USAGE_KINDS, Usage, UsageRow
from twinkle.wire import parse_checkpoint_path, parse_twinkle_path  # checkpoint paths are the wire's


class Store:
    """The SQLite file at ``location`` (a path), or the PostgreSQL database it names (a
    ``postgresql://`` URL), migrated to ``SCHEMA_VERSION``, and its aggregates; safe to share across
    threads. ``clock`` gives the time stamps (unix seconds); tests pass a fake one.
    ``connect_timeout_s``: how long PostgreSQL may take to answer at start."""

    def __init__(
        self,
        location: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.time,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.db: Database
        if is_postgres_url(location):
            self.db = PostgresDatabase(str(location), clock=clock, connect_timeout_s=connect_timeout_s)
        else:
            self.db = SqliteDatabase(location, clock=clock)
        try:
            migrate(self.db)
        except BaseException:
            self.db.close()
            raise
        #: Where the store is: a path, or a URL without its password.
        self.where = self.db.where
        self.tenants = Tenants(self.db)
        self.runs = Runs(self.db)
        self.checkpoints = Checkpoints(self.db)
        self.sessions = Sessions(self.db)
        self.futures = Futures(self.db)
        self.history = History(self.db)
        self.sequences = SampledSequences(self.db)
        self.usage = Usage(self.db)
        self.states = States(self.db)

    def transaction(self) -> contextlib.AbstractContextManager[object]:
        """One transaction over every aggregate: the writes made inside it on this thread commit
        together when the block ends, or none does (``Database.write``). A checkpoint's row and the
        future of the save that wrote it are one commit (``ModelGroup.record_checkpoint``)."""
        return self.db.write()

    def close(self) -> None:
        """Close the connection (checkpointing the WAL into the main file); later calls raise StateError."""
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    'CHECKPOINT_KINDS',
    'ERROR_CATEGORIES',
    'FUTURE_STATUSES',
    'HOUR_S',
    'RESERVED_CHECKPOINT_NAMES',
    'RUN_STATUSES',
    'SCHEMA_VERSION',
    'SEQUENCE_TTL_S',
    'TINKER_FOLDERS',
    'TWINKLE_FOLDERS',
    'USAGE_KINDS',
    'Checkpoint',
    'Checkpoints',
    'FutureRecord',
    'Futures',
    'History',
    'KeptState',
    'KnownRequest',
    'LostRequest',
    'RequestKey',
    'Run',
    'Runs',
    'SampledRecord',
    'SampledSequences',
    'SamplingSession',
    'Session',
    'Sessions',
    'States',
    'Store',
    'Tenant',
    'Tenants',
    'Usage',
    'UsageRow',
    'check_checkpoint_name',
    'check_name',
    'parse_checkpoint_path',
    'parse_twinkle_path',
]
