"""Training runs: a tenant's adapter on one base model, the configuration it was made with, and its status."""

from __future__ import annotations

import json
from typing import Any

from twinkle.errors import StateError, one_of
from twinkle.server.store.database import Aggregate, Row, check_name, dumps, new_id, violates
from twinkle.wire import RunFields

RUN_STATUSES = ('active', 'released', 'deleted')


class Run(RunFields, frozen=True):
    """A run as the store keeps it; its fields are the wire's ``RunFields``, what a client is told of it."""

    # Any: the JSON the client sent, with the setup calls the server appends to replay (each read by name).
    config: dict[str, Any]


class Runs(Aggregate):
    """The runs table. A tenant's read finds only its own runs; ``by_id`` and the lists without a tenant are
    for the server's own bookkeeping (idle release, making room, quotas), never for a request."""

    def create(
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
        now = self._db.clock()
        run = Run(
            id=run_id or new_id('run'),
            tenant_id=tenant_id,
            base_model=base_model,
            adapter_name=adapter_name,
            config=dict(config),
            created_at=now,
            last_request_at=now,
            status='active',
            session_id=session_id,
        )
        try:
            self._db.execute(
                'INSERT INTO runs (id, tenant_id, base_model, adapter_name, config_json, created_at, '
                'last_request_at, status, session_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)',
                (
                    run.id,
                    tenant_id,
                    base_model,
                    adapter_name,
                    dumps('run config', config),
                    now,
                    now,
                    run.status,
                    session_id,
                ),
            )
        except self._db.integrity_error as exc:
            if violates(exc, 'runs', 'id'):
                raise StateError(f'There is already a run {run.id!r}') from exc
            raise StateError(f'No tenant {tenant_id!r} to create a run for') from exc
        return run

    def by_id(self, run_id: str) -> Run | None:
        """A run whatever its tenant: for the server's own bookkeeping, never for a request."""
        rows = self._db.query('SELECT * FROM runs WHERE id = ?', (run_id,))
        return _run(rows[0]) if rows else None

    def get(self, tenant_id: str, run_id: str) -> Run | None:
        """The run if it exists and belongs to ``tenant_id`` (whatever its status), else None."""
        rows = self._db.query('SELECT * FROM runs WHERE id = ? AND tenant_id = ?', (run_id, tenant_id))
        return _run(rows[0]) if rows else None

    def page(self, tenant_id: str, limit: int = 100, offset: int = 0) -> tuple[list[Run], int]:
        """One page of the tenant's runs that are not deleted, newest first, and how many there are in all."""
        where = "FROM runs WHERE tenant_id = ? AND status != 'deleted'"
        rows = self._db.query(
            f'SELECT * {where} ORDER BY created_at DESC, rowid DESC LIMIT ? OFFSET ?', (tenant_id, limit, offset)
        )
        return [_run(row) for row in rows], self._db.count(f'SELECT COUNT(*) {where}', (tenant_id,))

    def touch(self, run_id: str) -> None:
        """Record a request to the run now, so that it does not count as idle."""
        self._db.execute('UPDATE runs SET last_request_at = ? WHERE id = ?', (self._db.clock(), run_id))

    def forget(self, tenant_id: str, run_id: str) -> bool:
        """Remove a run whose create the server refused (a full queue, a quota), as if it had never
        been made: its id is free for the client's retry, and the refused request's failed future,
        if one was recorded, goes with it. False if there was no such run."""
        return self._db.execute('DELETE FROM runs WHERE id = ? AND tenant_id = ?', (run_id, tenant_id)) > 0

    def set_status(self, run_id: str, status: str) -> None:
        if status not in RUN_STATUSES:
            raise one_of('run status', status, RUN_STATUSES)
        self._db.execute('UPDATE runs SET status = ? WHERE id = ?', (status, run_id))

    def set_config(self, run_id: str, config: dict[str, Any]) -> None:
        """Replace a run's configuration (the server appends the setup calls it must replay to
        bring a released adapter back)."""
        self._db.execute('UPDATE runs SET config_json = ? WHERE id = ?', (json.dumps(config), run_id))

    def active(self, tenant_id: str | None = None) -> list[Run]:
        """Active runs (of one tenant, or of all), least recently used first."""
        if tenant_id is None:
            rows = self._db.query("SELECT * FROM runs WHERE status = 'active' ORDER BY last_request_at, rowid")
        else:
            sql = "SELECT * FROM runs WHERE status = 'active' AND tenant_id = ? ORDER BY last_request_at, rowid"
            rows = self._db.query(sql, (tenant_id,))
        return [_run(row) for row in rows]

    def idle(self, older_than_s: float) -> list[Run]:
        """Active runs with no request in the last ``older_than_s`` seconds, longest idle first."""
        rows = self._db.query(
            "SELECT * FROM runs WHERE status = 'active' AND last_request_at < ? ORDER BY last_request_at",
            (self._db.clock() - older_than_s,),
        )
        return [_run(row) for row in rows]

    def count(self, status: str, *, base_model: str | None = None, tenant_id: str | None = None) -> int:
        """How many runs have ``status``, on ``base_model`` and of ``tenant_id`` when given."""
        where, params = ['status = ?'], [status]
        for column, value in (('base_model', base_model), ('tenant_id', tenant_id)):
            if value is not None:
                where.append(f'{column} = ?')
                params.append(value)
        sql = f'SELECT COUNT(*) FROM runs WHERE {" AND ".join(where)}'
        return self._db.count(sql, tuple(params))


def _run(row: Row) -> Run:
    fields = dict(row)
    fields['config'] = json.loads(fields.pop('config_json'))
    return Run.model_validate(fields)
