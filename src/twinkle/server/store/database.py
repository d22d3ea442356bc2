"""The one SQLite connection every aggregate of the store shares, with its lock, its transactions and its fsyncs.

Autocommit mode, WAL, ``synchronous=FULL``: a write is its own transaction, fsynced before it returns. Also
here, what the aggregates share besides: fresh ids, JSON columns, the names a row may give a folder.
"""

from __future__ import annotations

import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeAlias

import pydantic_core

from twinkle.errors import DataError, StateError

#: What a statement's parameter may be (SQLite stores a bool as the integer 0 or 1).
SqlValue: TypeAlias = str | int | float | bytes | None

_NAME = re.compile(r'[A-Za-z0-9][A-Za-z0-9._-]{0,63}')


class Database:
    """The SQLite file at ``path`` behind one connection that serves every thread, one statement at a time.

    SQLite writes one transaction at a time anyway, and the service's rows are few and small. ``clock``
    gives the time stamps (unix seconds); tests pass a fake one.
    """

    def __init__(self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        # Reentrant: a write inside another write of the same thread joins its transaction (``write``).
        self._lock = threading.RLock()
        self._depth = 0  # writes open on the thread holding the lock: 1 for the transaction, more when joined
        # Autocommit mode: transactions are opened explicitly in write(), never implicitly by the driver.
        self._conn: sqlite3.Connection | None = sqlite3.connect(
            self.path, timeout=30.0, isolation_level=None, check_same_thread=False
        )
        try:
            self._conn.row_factory = sqlite3.Row
            self._conn.execute('PRAGMA journal_mode=WAL')
            # FULL: every commit is fsynced before it returns, so an acknowledged row survives a crash.
            self._conn.execute('PRAGMA synchronous=FULL')
            self._conn.execute('PRAGMA foreign_keys=ON')
        except BaseException:
            self.close()
            raise

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StateError('the store is closed: the server is stopping')  # a tenant may read this: no path
        return self._conn

    @contextmanager
    def write(self, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction, holding the lock; committed (and fsynced) when the block ends.

        A write the same thread opens inside it joins it: the aggregates' writes in a ``Store.transaction``
        commit together, or (one raising) none does. ``durable=False`` commits without the fsync
        (``synchronous=NORMAL``): for a row a crash may lose because the restart undoes it anyway. The
        next durable commit syncs it with its own."""
        with self._lock:
            conn = self._connection()
            if self._depth:  # inside this thread's open transaction: it commits with it
                self._depth += 1
                try:
                    yield conn
                finally:
                    self._depth -= 1
                return
            if not durable:
                conn.execute('PRAGMA synchronous=NORMAL')
            try:
                conn.execute('BEGIN IMMEDIATE')
                self._depth = 1
                try:
                    yield conn
                except BaseException:
                    conn.execute('ROLLBACK')
                    raise
                finally:
                    self._depth = 0
                conn.execute('COMMIT')
            finally:
                if not durable:
                    conn.execute('PRAGMA synchronous=FULL')

    def query(self, sql: str, params: Sequence[SqlValue] = ()) -> list[sqlite3.Row]:
        """The rows of one reading statement (untyped: each aggregate makes its records of them)."""
        with self._lock:
            rows: list[sqlite3.Row] = self._connection().execute(sql, params).fetchall()
            return rows

    def count(self, sql: str, params: Sequence[SqlValue] = ()) -> int:
        """The number a ``SELECT COUNT(*) ...`` answers."""
        return int(self.query(sql, params)[0][0])

    def ids(self, sql: str, params: Sequence[SqlValue] = ()) -> list[str]:
        """The first column of each row a ``SELECT id ...`` answers."""
        return [str(row[0]) for row in self.query(sql, params)]

    def execute(self, sql: str, params: Sequence[SqlValue] = (), durable: bool = True) -> int:
        """Run one writing statement in its own transaction; return how many rows it changed."""
        with self.write(durable) as conn:
            return conn.execute(sql, params).rowcount

    def close(self) -> None:
        """Close the connection (checkpointing the WAL into the main file); later calls raise StateError."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


class Aggregate:
    """One aggregate of the store: its tables, read and written only through its methods, over the shared
    database (so that every aggregate writes under the same lock, in the same kind of transaction)."""

    def __init__(self, db: Database) -> None:
        self._db = db


def insert(conn: sqlite3.Connection, table: str, row: Mapping[str, SqlValue]) -> None:
    """Insert ``row`` (column -> value) into ``table``, inside a transaction of ``Database.write``. The table
    and the columns are the store's own names (a record's fields), never a request's."""
    sql = f'INSERT INTO {table} ({", ".join(row)}) VALUES ({", ".join("?" * len(row))})'
    conn.execute(sql, tuple(row.values()))


def new_id(prefix: str) -> str:
    """A fresh row id, ``<prefix>-<12 hex digits>``: random, so ids say nothing about other tenants' rows."""
    return f'{prefix}-{secrets.token_hex(6)}'


def dumps(what: str, value: Any) -> str:  # Any: a JSON value the client sent (a config, a result)
    """``value`` as the text of a JSON column; DataError naming ``what`` if it is not JSON. pydantic's
    writer, with NaN and infinities as Python's ``json`` writes them: a result of thousands of floats
    costs a tenth of ``json.dumps``."""
    try:
        return pydantic_core.to_json(value, inf_nan_mode='constants').decode()
    except (TypeError, ValueError) as exc:
        raise DataError(
            f'The {what} must be JSON-serializable (dicts, lists, str, numbers, bool, None): {exc}'
        ) from exc


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
