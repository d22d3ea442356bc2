"""The database every aggregate of the store shares: SQLite (one file, the embedded default) or PostgreSQL
(``postgres.py``, for several gateways), behind one interface with its lock, its transactions and its fsyncs.

SQLite: autocommit mode, WAL, ``synchronous=FULL``: a write is its own transaction, fsynced before it returns.
A write that need not be (``durable=False``) goes through a second connection set to ``synchronous=NORMAL``,
rather than switching the one connection's setting twice a write.
The aggregates write one SQL for both: ``?`` placeholders, ``INSERT ... ON CONFLICT``, and ``rowid`` as the
order rows were made in (SQLite's own column; a ``BIGSERIAL`` column of that name in PostgreSQL). Also here,
what the aggregates share besides: fresh ids, JSON columns, the names a row may give a folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeAlias

import pydantic_core

from twinkle.errors import DataError, StateError

#: What a statement's parameter may be (a bool is stored as the integer 0 or 1, as SQLite does).
SqlValue: TypeAlias = str | int | float | bytes | None

_NAME = re.compile(r'[A-Za-z0-9][A-Za-z0-9._-]{0,63}')


class Row(Protocol):
    """A row as both backends give it: by column name, by position, and ``dict(row)``."""

    def __getitem__(self, key: str | int, /) -> Any: ...  # Any: a column's value, typed by the aggregate
    def keys(self) -> Iterable[str]: ...


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...
    def fetchall(self) -> list[Any]: ...  # Any: Row, as each backend's row factory makes them
    def fetchone(self) -> Any: ...


class Connection(Protocol):
    """What a transaction of ``Database.write`` yields: SQLite's connection, or PostgreSQL's behind an adapter."""

    def execute(self, sql: str, parameters: Sequence[SqlValue] = (), /) -> Cursor: ...
    def executemany(self, sql: str, parameters: Iterable[Sequence[SqlValue]], /) -> Cursor: ...


class Database:
    """One connection that serves every thread, one statement at a time, with reentrant write transactions.

    ``clock`` gives the time stamps (unix seconds); tests pass a fake one. ``where`` names the database in
    messages (a path, or a URL without its password); ``integrity_error`` is the driver's exception for a
    broken constraint (a duplicate key, a missing foreign row)."""

    dialect: ClassVar[str]
    integrity_error: type[Exception]

    def __init__(self, where: str, clock: Callable[[], float]) -> None:
        self.where = where
        self.clock = clock
        # Reentrant: a write inside another write of the same thread joins its transaction (``write``).
        self._lock = threading.RLock()
        self._depth = 0  # writes open on the thread holding the lock: 1 for the transaction, more when joined
        self._joined: Connection  # the connection of the open transaction, while _depth > 0

    @contextmanager
    def write(self, durable: bool = True) -> Iterator[Connection]:
        """One write transaction, holding the lock; committed (and fsynced) when the block ends.

        A write the same thread opens inside it joins it: the aggregates' writes in a ``Store.transaction``
        commit together, or (one raising) none does. ``durable=False`` commits without the fsync: for a row
        a crash may lose because the restart undoes it anyway. The next durable commit syncs it with its own."""
        with self._lock:
            if self._depth:  # inside this thread's open transaction: it commits with it
                self._depth += 1
                try:
                    yield self._joined
                finally:
                    self._depth -= 1
                return
            conn = self._writer(durable)
            with self._transaction(conn, durable):
                self._depth, self._joined = 1, conn
                try:
                    yield conn
                finally:
                    self._depth = 0

    def _connection(self) -> Connection:
        raise NotImplementedError

    def _writer(self, durable: bool) -> Connection:
        """The connection a new transaction of this kind writes on."""
        return self._connection()

    def _transaction(self, conn: Connection, durable: bool) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError

    def query(self, sql: str, params: Sequence[SqlValue] = ()) -> list[Row]:
        """The rows of one reading statement (untyped: each aggregate makes its records of them)."""
        with self._lock:
            rows: list[Row] = self._connection().execute(sql, params).fetchall()
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
        raise NotImplementedError


class SqliteDatabase(Database):
    """The SQLite file at ``path``. SQLite writes one transaction at a time anyway, and the service's rows
    are few and small."""

    dialect = 'sqlite'
    integrity_error = sqlite3.IntegrityError

    def __init__(self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        super().__init__(str(self.path), clock)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn: sqlite3.Connection | None = None
        self._fast: sqlite3.Connection | None = None  # synchronous=NORMAL: commits in the WAL, fsynced later
        try:
            self._conn = self._open_connection('FULL')  # every commit fsynced before it returns
            self._fast = self._open_connection('NORMAL')
        except BaseException:
            self.close()
            raise

    def _open_connection(self, synchronous: str) -> sqlite3.Connection:
        # Autocommit mode: transactions are opened explicitly in write(), never implicitly by the driver.
        conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        try:
            conn.row_factory = sqlite3.Row
            conn.execute('PRAGMA journal_mode=WAL')
            conn.execute(f'PRAGMA synchronous={synchronous}')
            conn.execute('PRAGMA foreign_keys=ON')
        except BaseException:
            conn.close()
            raise
        return conn

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StateError('the store is closed: the server is stopping')  # a tenant may read this: no path
        return self._conn

    def _writer(self, durable: bool) -> sqlite3.Connection:
        conn = self._connection()
        return conn if durable or self._fast is None else self._fast

    @contextmanager
    def _transaction(self, conn: Connection, durable: bool) -> Iterator[None]:
        conn.execute('BEGIN IMMEDIATE')
        try:
            yield
        except BaseException:
            conn.execute('ROLLBACK')
            raise
        conn.execute('COMMIT')

    def close(self) -> None:
        """Close the connections (the last checkpoints the WAL into the main file); later calls raise StateError."""
        with self._lock:
            for conn in (self._fast, self._conn):
                if conn is not None:
                    conn.close()
            self._fast = self._conn = None


def violates(exc: Exception, table: str, column: str) -> bool:
    """Whether integrity error ``exc`` is a duplicate of ``table.column``: SQLite says ``UNIQUE constraint
    failed: table.column``, PostgreSQL names the constraint (``table_..._key``) and the key (``Key (column)=``)."""
    text = str(exc)
    return f'{table}.{column}' in text or (f'"{table}_' in text and f'Key ({column})=' in text)


class Aggregate:
    """One aggregate of the store: its tables, read and written only through its methods, over the shared
    database (so that every aggregate writes under the same lock, in the same kind of transaction)."""

    def __init__(self, db: Database) -> None:
        self._db = db


def insert(conn: Connection, table: str, row: Mapping[str, SqlValue]) -> None:
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
