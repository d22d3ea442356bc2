"""Futures: a queued request's status and, once it finished, its result or what went wrong and whose fault it was.

A future is written pending, moved to running, then finished once (done or failed); a finished future
never changes again, so a worker that completes late cannot overwrite what the client was told.

A future's own writes are committed without an fsync (``durable=False``): a WAL commit survives the
server's death (``kill -9``) all the same, and only an operating-system crash or a power cut may lose
the last ones, as it loses the model's state they describe; the next durable commit syncs them. Two
fsyncs on every request's path cost more than a small request itself. A save settles its future in
the durable transaction of its checkpoint's row (``Store.transaction``), which decides for both.

A request sent with an ``Idempotency-Key`` records the key in its future's row, in the same write: one future
per tenant and key, so the same request sent again (its gateway died during a wait, a load balancer retried)
finds the first one's future (``by_key``) rather than running again, and two sent at once make one future
(``create`` raises ``KnownRequest`` to the second). A key lives as long as its future does.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple

import pydantic_core
from pydantic import BaseModel

from twinkle.errors import StateError, one_of
from twinkle.server.store.database import Aggregate, Row, dumps, new_id

FUTURE_STATUSES = ('pending', 'running', 'done', 'failed')
ERROR_CATEGORIES = ('user', 'server')


class FutureRecord(BaseModel, frozen=True):
    id: str
    tenant_id: str
    run_id: str | None
    op: str
    status: str
    #: The JSON-decoded result of a 'done' future; None otherwise (Any: whatever JSON the operation answered).
    result: Any
    #: What went wrong, and whose fault it was ('user' or 'server'), for a 'failed' future.
    error: str | None
    category: str | None
    created_at: float
    finished_at: float | None
    #: When its job started on a worker (None: not yet, or never).
    started_at: float | None = None
    #: The Tinker session it belongs to (None: the native API's).
    session_id: str | None = None
    #: The client's ``Idempotency-Key`` of the request (None: it sent none, or the key was released).
    idempotency_key: str | None = None
    #: The hash of what the request asked (its operation, run and body), against which a key sent again is checked.
    request_hash: str | None = None

    @property
    def finished(self) -> bool:
        return self.status in ('done', 'failed')


class RequestKey(NamedTuple):
    """A request's ``Idempotency-Key`` and the hash of what it asks (``request_hash``)."""

    key: str
    request_hash: str


class KnownRequest(Exception):
    """``Futures.create`` recorded nothing: the tenant's ``Idempotency-Key`` names ``record`` already."""

    def __init__(self, record: FutureRecord):
        super().__init__(f'the Idempotency-Key of request {record.id!r} was sent again')
        self.record = record


class Futures(Aggregate):
    """The futures table; a tenant reads only its own futures."""

    def create(
        self,
        tenant_id: str,
        run_id: str | None,
        op: str,
        session_id: str | None = None,
        request_key: RequestKey | None = None,
    ) -> FutureRecord:
        """A pending future of ``op`` on the tenant's run (None: on no run), in a Tinker session or none;
        with ``request_key``, the one future of that key (``KnownRequest`` if the tenant's key has one)."""
        future = FutureRecord(
            id=new_id('fut'),
            tenant_id=tenant_id,
            run_id=run_id,
            op=op,
            status='pending',
            result=None,
            error=None,
            category=None,
            created_at=self._db.clock(),
            finished_at=None,
            session_id=session_id,
            idempotency_key=request_key.key if request_key else None,
            request_hash=request_key.request_hash if request_key else None,
        )
        try:
            self._db.execute(
                'INSERT INTO futures (id, tenant_id, run_id, op, status, created_at, session_id, idempotency_key, '
                "request_hash) VALUES (?, ?, ?, ?, 'pending', ?, ?, ?, ?)",
                (future.id, tenant_id, run_id, op, future.created_at, session_id, *(request_key or (None, None))),
                durable=False,
            )
        except self._db.integrity_error as exc:
            known = self.by_key(tenant_id, request_key.key) if request_key else None
            if known is not None:  # the same key, sent at the same time to another gateway: that one's future
                raise KnownRequest(known) from None
            raise StateError(f'Tenant {tenant_id!r} has no run {run_id!r} to start {op!r} on') from exc
        return future

    def by_key(self, tenant_id: str, key: str) -> FutureRecord | None:
        """The tenant's future of the request sent with ``Idempotency-Key: key`` (None: none was)."""
        rows = self._db.query('SELECT * FROM futures WHERE tenant_id = ? AND idempotency_key = ?', (tenant_id, key))
        return _future(rows[0]) if rows else None

    def release_key(self, future_id: str) -> None:
        """Free a future's ``Idempotency-Key``: a request refused before it ran (a full queue), whose retry
        with the same key is a new request."""
        self._db.execute('UPDATE futures SET idempotency_key = NULL WHERE id = ?', (future_id,), durable=False)

    def set_running(self, future_id: str) -> bool:
        """Move a pending future to running; False if it was not pending. After a crash,
        ``fail_unfinished`` fails a running future as it does a pending one."""
        sql = "UPDATE futures SET status = 'running', started_at = ? WHERE id = ? AND status = 'pending'"
        return self._db.execute(sql, (self._db.clock(), future_id), durable=False) > 0

    def finish(self, future_id: str, result: Any) -> bool:  # Any: the operation's JSON answer
        """Store the JSON-encoded ``result`` of an unfinished future; False if it had already finished.

        A finished future never changes again, so a worker that completes after the future was failed
        (say by ``fail_unfinished``) cannot overwrite what the client was told.
        """
        return self._finish(future_id, 'done', dumps('future result', result), None, None)

    def fail(self, future_id: str, error: str, category: str) -> bool:
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
        values = (status, result_json, error, category, self._db.clock(), future_id)
        return self._db.execute(sql, values, durable=False) > 0

    def get(self, tenant_id: str, future_id: str) -> FutureRecord | None:
        rows = self._db.query('SELECT * FROM futures WHERE id = ? AND tenant_id = ?', (future_id, tenant_id))
        return _future(rows[0]) if rows else None

    def first_of(self, tenant_id: str, run_id: str, op: str) -> FutureRecord | None:
        """The tenant's oldest future of ``op`` on ``run_id`` (None: none): what a retried
        ``create_model`` is answered with, whatever the server forgot since."""
        rows = self._db.query(
            'SELECT * FROM futures WHERE tenant_id = ? AND run_id = ? AND op = ? ORDER BY created_at, rowid LIMIT 1',
            (tenant_id, run_id, op),
        )
        return _future(rows[0]) if rows else None

    def of_session(self, session_id: str) -> list[FutureRecord]:
        """The futures of a Tinker session, oldest first (its results left out: a trace reads the times)."""
        rows = self._db.query(
            'SELECT id, tenant_id, run_id, op, status, NULL AS result_json, error, category, created_at, finished_at, '
            'started_at, session_id FROM futures WHERE session_id = ? ORDER BY created_at, rowid',
            (session_id,),
        )
        return [_future(row) for row in rows]

    def answered_since(self, run_id: str, since: float, ops: Collection[str]) -> list[tuple[str, str, float]]:
        """The run's futures of ``ops`` that started after ``since`` (unix seconds) and are done: the
        requests the server answered after that time, in the order they ran (``started_at`` is the worker's
        clock, as ``since`` is; ``created_at`` may be a gateway's), as (id, op, started_at)."""
        if not ops:
            return []
        marks = ', '.join('?' * len(ops))
        rows = self._db.query(
            'SELECT id, op, started_at FROM futures '
            f"WHERE run_id = ? AND started_at > ? AND status = 'done' AND op IN ({marks}) ORDER BY started_at, rowid",
            (run_id, since, *sorted(ops)),
        )
        return [(str(row[0]), str(row[1]), float(row[2])) for row in rows]

    def fail_unfinished(self, reason: str) -> int:
        """At server start: fail every pending or running future as the server's fault; return how many.

        Their work died with the previous process, so their clients would otherwise wait for ever.
        """
        sql = (
            "UPDATE futures SET status = 'failed', error = ?, category = 'server', finished_at = ? "
            "WHERE status IN ('pending', 'running')"
        )
        return self._db.execute(sql, (reason, self._db.clock()))


def _future(row: Row) -> FutureRecord:
    fields = dict(row)
    result_json = fields.pop('result_json')
    fields['result'] = None if result_json is None else pydantic_core.from_json(result_json)  # a tenth of json's
    return FutureRecord.model_validate(fields)
