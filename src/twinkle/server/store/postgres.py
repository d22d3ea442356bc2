"""The store on PostgreSQL: what several gateway processes share (``store: postgresql://...`` in the config).

One connection per process, as SQLite's, serving every thread one statement at a time; a write is its own
transaction, committed before the method returns (``synchronous_commit`` on: on disk, and on a synchronous
standby if the server has one), or without waiting for the flush for the writes SQLite also leaves unsynced
(``durable=False``: ``SET LOCAL synchronous_commit = off``). The aggregates' SQL is SQLite's: ``?`` becomes
``%s``, a bool parameter the integer SQLite would store, and each row reads by name, by position and as a
dict, as ``sqlite3.Row`` does.

The database unreachable is retried with back-off: at start for ``connect_timeout_s`` (then a clear
``StoreUnavailableError``), and later at the next statement once a connection broke. A statement whose
connection broke raises ``StoreUnavailableError`` (a 503 with ``Retry-After``): it was not acknowledged, so a
write the server had acknowledged is never lost, and one it had not is retried by the client.

psycopg 3 (``pip install 'twinkle-train[postgres]'``) is imported only here.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from twinkle.errors import DataError, MissingExtraError, StateError, StoreUnavailableError
from twinkle.server.config import POSTGRES_SCHEMES
from twinkle.server.store.database import Connection, Cursor, Database, SqlValue

#: Seconds a store waits at start for PostgreSQL to answer, retrying with back-off.
CONNECT_TIMEOUT_S = 30.0
#: The first and the longest pause between two tries to connect.
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.1, 2.0
#: The column PostgreSQL tables carry for SQLite's implicit ``rowid`` (the order rows were made in): sorted
#: on, never part of a record.
ROWID = 'rowid'
_PLACEHOLDER = re.compile(r"\?|%|'[^']*'")


def redacted(url: str) -> str:
    """A database URL without its password, for messages and logs.

    >>> redacted('postgresql://twinkle:s3cret@db.internal:5432/twinkle')
    'postgresql://twinkle:***@db.internal:5432/twinkle'
    """
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit('@', 1)[1]
    return urlunsplit(parts._replace(netloc=f'{parts.username}:***@{netloc}'))


@functools.lru_cache(maxsize=1024)  # the aggregates' statements: a few hundred texts at most
def to_pyformat(sql: str) -> str:
    """SQLite's statement with psycopg's placeholders: ``?`` outside quotes becomes ``%s``, ``%`` becomes ``%%``.

    >>> to_pyformat("SELECT * FROM runs WHERE id = ? AND status = 'a?%'")
    "SELECT * FROM runs WHERE id = %s AND status = 'a?%%'"
    """
    return _PLACEHOLDER.sub(lambda m: '%s' if m[0] == '?' else m[0].replace('%', '%%'), sql)


class PgRow:
    """A row read by name, by position, and as a dict (``keys``), as ``sqlite3.Row`` is."""

    __slots__ = ('_names', '_values')

    def __init__(self, names: dict[str, int], values: Sequence[Any]) -> None:  # Any: column values
        self._names, self._values = names, values

    def __getitem__(self, key: str | int) -> Any:  # Any: a column's value
        return self._values[key] if isinstance(key, int) else self._values[self._names[key]]

    def keys(self) -> list[str]:
        return [name for name in self._names if name != ROWID]


def _row_factory(cursor: Any) -> Callable[[Sequence[Any]], PgRow]:  # Any: psycopg's cursor and values
    names = {column.name: index for index, column in enumerate(cursor.description or ())}
    return lambda values: PgRow(names, values)


def _parameters(params: Sequence[SqlValue]) -> tuple[SqlValue, ...]:
    return tuple(int(value) if isinstance(value, bool) else value for value in params)


class _Adapter:
    """A psycopg connection that takes the aggregates' SQLite statements (``Connection``)."""

    def __init__(self, conn: Any) -> None:  # Any: psycopg.Connection, imported only when used
        self.conn = conn

    def execute(self, sql: str, parameters: Sequence[SqlValue] = (), /) -> Cursor:
        cursor: Cursor = self.conn.execute(to_pyformat(sql), _parameters(parameters))
        return cursor

    def executemany(self, sql: str, parameters: Iterable[Sequence[SqlValue]], /) -> Cursor:
        cursor = self.conn.cursor()
        cursor.executemany(to_pyformat(sql), [_parameters(row) for row in parameters])
        result: Cursor = cursor
        return result


class PostgresDatabase(Database):
    """The PostgreSQL database at ``url`` (``postgresql://user:password@host:port/name``)."""

    dialect = 'postgresql'

    def __init__(
        self, url: str, *, clock: Callable[[], float] = time.time, connect_timeout_s: float = CONNECT_TIMEOUT_S
    ) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise MissingExtraError("a PostgreSQL store needs psycopg: pip install 'twinkle-train[postgres]'") from exc
        self._psycopg = psycopg
        self.integrity_error = psycopg.IntegrityError
        super().__init__(redacted(url), clock)
        self.url = url
        self._closed = False
        # After a broken connection: no new try before _next_try (monotonic), each failure doubling the pause.
        self._next_try, self._pause = 0.0, FIRST_BACKOFF_S
        self._adapter: _Adapter | None = self._connect(connect_timeout_s)

    def _open(self) -> _Adapter:
        conn = self._psycopg.connect(self.url, autocommit=True, row_factory=_row_factory, connect_timeout=5)
        return _Adapter(conn)

    def _connect(self, timeout_s: float) -> _Adapter:
        """At start: a connection, retried with back-off for ``timeout_s``; StoreUnavailableError after that."""
        deadline, pause = time.monotonic() + timeout_s, FIRST_BACKOFF_S
        while True:
            try:
                return self._open()
            except self._psycopg.OperationalError as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreUnavailableError(
                        f'cannot reach the PostgreSQL store at {self.where} '
                        f'(tried for {timeout_s:.0f} s): {_reason(exc)}'
                    ) from None
                time.sleep(min(pause, remaining))
                pause = min(2 * pause, MAX_BACKOFF_S)

    def _connection(self) -> Connection:
        """The open connection; once it broke, one try to connect again per back-off pause (a statement
        meanwhile is a StoreUnavailableError at once, never a wait under the lock)."""
        if self._closed:
            raise StateError('the store is closed: the server is stopping')
        if self._adapter is not None and not (self._adapter.conn.broken or self._adapter.conn.closed):
            return self._adapter
        self._adapter = None
        now = time.monotonic()
        if now < self._next_try:
            raise StoreUnavailableError(
                f'the PostgreSQL store does not answer; trying again in {self._next_try - now:.1f} s',
                retry_after_s=max(1.0, self._next_try - now),
            )
        try:
            self._adapter = self._open()
        except self._psycopg.OperationalError as exc:
            self._next_try, self._pause = now + self._pause, min(2 * self._pause, MAX_BACKOFF_S)
            raise StoreUnavailableError(f'the PostgreSQL store does not answer: {_reason(exc)}') from None
        self._pause = FIRST_BACKOFF_S
        return self._adapter

    @contextmanager
    def _transaction(self, conn: Connection, durable: bool) -> Iterator[None]:
        conn.execute('BEGIN')
        try:
            if not durable:  # committed to the server's memory and its WAL buffers; flushed within 3 x wal_writer_delay
                conn.execute('SET LOCAL synchronous_commit = off')
            yield
        except BaseException:
            self._rollback(conn)
            raise
        conn.execute('COMMIT')

    def _rollback(self, conn: Connection) -> None:
        with contextlib.suppress(self._psycopg.OperationalError):  # a broken connection: rolled back already
            conn.execute('ROLLBACK')

    def query(self, sql: str, params: Sequence[SqlValue] = ()) -> list[Any]:  # Any: PgRow, a Row
        with self._unavailable():
            return super().query(sql, params)

    @contextmanager
    def write(self, durable: bool = True) -> Iterator[Connection]:
        with self._unavailable(), super().write(durable) as conn:
            yield conn

    @contextmanager
    def _unavailable(self) -> Iterator[None]:
        """A broken connection as StoreUnavailableError: the statement was not acknowledged. A text holding
        NUL, which PostgreSQL cannot keep or compare (SQLite can), is a DataError: a name or an id a
        request sent (``/runs/x%00``), which no row can hold."""
        try:
            yield
        except self._psycopg.OperationalError as exc:
            if self._adapter is not None and not self._adapter.conn.broken:
                raise
            raise StoreUnavailableError(f'the PostgreSQL store stopped answering: {_reason(exc)[:200]}') from None
        except self._psycopg.DataError as exc:
            if 'NUL (0x00)' not in str(exc):
                raise
            raise DataError(
                'a name, an id or a text of the request holds a NUL character (0x00), which none can hold'
            ) from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._adapter is not None:
                self._adapter.conn.close()
                self._adapter = None


def _reason(exc: Exception) -> str:
    """The first line of a driver's message (psycopg's run over several), or the exception's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def is_postgres_url(location: object) -> bool:
    return isinstance(location, str) and location.startswith(POSTGRES_SCHEMES)
