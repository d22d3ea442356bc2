"""Tinker sessions: what a Tinker client opens first, with the training runs and sampling sessions under it."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from pydantic import BaseModel

from twinkle.errors import StateError
from twinkle.server.store.database import Aggregate, Row, dumps, insert, new_id


class Session(BaseModel, frozen=True):
    id: str
    tenant_id: str
    #: What the client sent: tags, user_metadata, sdk_version (Any: JSON values, each read by name).
    info: dict[str, Any]
    created_at: float
    last_heartbeat_at: float
    #: 'active' or 'finished'.
    status: str
    #: When the server took the session's client for gone (no heartbeat for ``tinker.session_timeout_s``);
    #: None: it has not.
    expired_at: float | None = None


class SamplingSession(BaseModel, frozen=True):
    id: str
    tenant_id: str
    session_id: str
    base_model: str
    #: The tinker:// path of the sampler weights (None: the base model).
    model_path: str | None
    created_at: float


class Sessions(Aggregate):
    """The sessions and sampling_sessions tables; a tenant reads only its own."""

    def create(self, tenant_id: str, info: dict[str, Any]) -> Session:
        now = self._db.clock()
        session = Session(
            id=new_id('sess'),
            tenant_id=tenant_id,
            info=dict(info),
            created_at=now,
            last_heartbeat_at=now,
            status='active',
        )
        self._db.execute(
            'INSERT INTO sessions (id, tenant_id, info_json, created_at, last_heartbeat_at, status) '
            "VALUES (?, ?, ?, ?, ?, 'active')",
            (session.id, tenant_id, dumps('session info', info), now, now),
        )
        return session

    def get(self, tenant_id: str, session_id: str) -> Session | None:
        rows = self._db.query('SELECT * FROM sessions WHERE id = ? AND tenant_id = ?', (session_id, tenant_id))
        return _session(rows[0]) if rows else None

    def by_id(self, session_id: str) -> Session | None:
        """The session of this id, whoever's (for a signed link, which names no tenant)."""
        rows = self._db.query('SELECT * FROM sessions WHERE id = ?', (session_id,))
        return _session(rows[0]) if rows else None

    def page(self, tenant_id: str, limit: int = 100, offset: int = 0) -> list[Session]:
        """One page of the tenant's sessions, newest first."""
        rows = self._db.query(
            'SELECT * FROM sessions WHERE tenant_id = ? ORDER BY created_at DESC, rowid DESC LIMIT ? OFFSET ?',
            (tenant_id, limit, offset),
        )
        return [_session(row) for row in rows]

    def heartbeat(self, session_id: str) -> None:
        self._db.execute('UPDATE sessions SET last_heartbeat_at = ? WHERE id = ?', (self._db.clock(), session_id))

    def finish(self, session_id: str) -> None:
        self._db.execute("UPDATE sessions SET status = 'finished' WHERE id = ?", (session_id,))

    def expire(self, beaten_before: float) -> list[Session]:
        """Mark every active session whose last heartbeat came before ``beaten_before`` (unix
        seconds) expired, now; the sessions it marked."""
        with self._db.write() as conn:
            found = 'SELECT * FROM sessions WHERE status = ? AND expired_at IS NULL AND last_heartbeat_at < ?'
            rows = conn.execute(found, ('active', beaten_before)).fetchall()
            now = self._db.clock()
            if rows:
                conn.executemany('UPDATE sessions SET expired_at = ? WHERE id = ?', [(now, row['id']) for row in rows])
        return [_session(row).model_copy(update={'expired_at': now}) for row in rows]

    def expired(self, session_ids: Collection[str]) -> set[str]:
        """Those of ``session_ids`` that expired."""
        ids = sorted(session_ids)
        if not ids:
            return set()
        marks = ', '.join('?' * len(ids))
        rows = self._db.query(f'SELECT id FROM sessions WHERE expired_at IS NOT NULL AND id IN ({marks})', tuple(ids))
        return {str(row[0]) for row in rows}

    def runs(self, tenant_id: str, session_id: str) -> list[str]:
        """The ids of the training runs the session created, oldest first."""
        return self._db.ids(
            'SELECT id FROM runs WHERE tenant_id = ? AND session_id = ? ORDER BY created_at, rowid',
            (tenant_id, session_id),
        )

    def create_sampler(
        self, tenant_id: str, sampling_id: str, session_id: str, base_model: str, model_path: str | None
    ) -> SamplingSession:
        """Record a sampling session named ``sampling_id``; the same id again returns the first one."""
        existing = self.sampler(tenant_id, sampling_id)
        if existing is not None:
            return existing
        record = SamplingSession(
            created_at=self._db.clock(),
            id=sampling_id,
            tenant_id=tenant_id,
            session_id=session_id,
            base_model=base_model,
            model_path=model_path,
        )
        try:
            with self._db.write() as conn:
                insert(conn, 'sampling_sessions', record.model_dump())
        except self._db.integrity_error as exc:
            raise StateError(f'sampling session {sampling_id!r} cannot be created: {exc}') from exc
        return record

    def sampler(self, tenant_id: str, sampling_id: str) -> SamplingSession | None:
        """The tenant's sampling session of this id, or None."""
        rows = self._db.query(
            'SELECT * FROM sampling_sessions WHERE id = ? AND tenant_id = ?', (sampling_id, tenant_id)
        )
        return SamplingSession.model_validate(dict(rows[0])) if rows else None

    def samplers(self, tenant_id: str, session_id: str) -> list[str]:
        """The ids of the session's sampling sessions, oldest first."""
        return self._db.ids(
            'SELECT id FROM sampling_sessions WHERE tenant_id = ? AND session_id = ? ORDER BY created_at, rowid',
            (tenant_id, session_id),
        )


def _session(row: Row) -> Session:
    fields = dict(row)
    fields['info'] = json.loads(fields.pop('info_json'))
    return Session.model_validate(fields)
