"""Saved checkpoints: the rows that name a run's weight folders on disk, who may load them, and until when."""

from __future__ import annotations

from twinkle.errors import DataError, StateError, one_of
from twinkle.server.store.database import Aggregate, Row, check_name, insert, new_id
from twinkle.wire import TINKER_SCHEME, TWINKLE_SCHEME, CheckpointFields

CHECKPOINT_KINDS = ('training', 'sampler', 'external')
#: The folder of each kind in a tinker:// path.
TINKER_FOLDERS = {'training': 'weights', 'sampler': 'sampler_weights', 'external': 'external_weights'}
#: The folder of each kind in a twinkle:// path.
TWINKLE_FOLDERS = {'training': 'checkpoints', 'sampler': 'sampler_weights', 'external': 'external_weights'}
#: Folders of a run's directory that hold something else than a checkpoint of that name.
RESERVED_CHECKPOINT_NAMES = ('released-state', 'sampler_weights', 'external_weights')


def check_checkpoint_name(name: object) -> str:
    """A safe checkpoint name (``check_name``) that is not one of the run directory's own folders."""
    name = check_name('checkpoint', name)
    if name in RESERVED_CHECKPOINT_NAMES:
        raise DataError(f'checkpoint name {name!r} is reserved; use another than {list(RESERVED_CHECKPOINT_NAMES)}')
    return name


class Checkpoint(CheckpointFields, frozen=True):
    """A checkpoint as the store keeps it: the wire's ``CheckpointFields`` and where its files are."""

    #: Where the files are on the server's disk; never shown to clients, who use ``twinkle_path``.
    path: str

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


class Checkpoints(Aggregate):
    """The checkpoints table. A tenant reads its own checkpoints, and loads others' published ones
    (``readable``); ``by_id`` is for links the server signed, whoever owns the checkpoint."""

    def add(
        self,
        tenant_id: str,
        run_id: str,
        name: str,
        path: str,
        kind: str,
        size_bytes: int,
        *,
        expires_at: float | None = None,
        checkpoint_id: str | None = None,
    ) -> tuple[Checkpoint, Checkpoint | None]:
        """Record a saved checkpoint (``checkpoint_id``: a fresh one unless given) in one
        transaction with the removal of the run's earlier one of the same kind and name; the new
        row and the one it replaced (None: the name was free). The caller deletes the old files."""
        check_name('checkpoint', name)
        if kind not in CHECKPOINT_KINDS:
            raise one_of('checkpoint kind', kind, CHECKPOINT_KINDS)
        checkpoint = Checkpoint(
            id=checkpoint_id or new_id('ckpt'),
            run_id=run_id,
            tenant_id=tenant_id,
            name=name,
            kind=kind,
            size_bytes=size_bytes,
            created_at=self._db.clock(),
            public=False,
            expires_at=expires_at,
            path=str(path),
        )
        where = 'WHERE run_id = ? AND kind = ? AND name = ?'
        try:
            with self._db.write() as conn:
                old = conn.execute(f'SELECT * FROM checkpoints {where}', (run_id, kind, name)).fetchall()
                conn.execute(f'DELETE FROM checkpoints {where}', (run_id, kind, name))
                insert(conn, 'checkpoints', checkpoint.model_dump())
        except self._db.integrity_error as exc:
            raise StateError(f'Tenant {tenant_id!r} has no run {run_id!r} to add checkpoint {name!r} to') from exc
        return checkpoint, (_checkpoint(old[0]) if old else None)

    def paths(self) -> set[str]:
        """Where every recorded checkpoint's files are (what a server keeps at start)."""
        return {str(row['path']) for row in self._db.query('SELECT path FROM checkpoints')}

    def of_run(self, tenant_id: str, run_id: str) -> list[Checkpoint]:
        """The run's checkpoints, oldest first."""
        rows = self._db.query(
            'SELECT * FROM checkpoints WHERE tenant_id = ? AND run_id = ? ORDER BY created_at, rowid',
            (tenant_id, run_id),
        )
        return [_checkpoint(row) for row in rows]

    def stored(self, tenant_id: str | None = None) -> dict[str, dict[str, tuple[int, int]]]:
        """Checkpoints kept now and their bytes, by tenant and run: ``{tenant: {run: (count, bytes)}}``
        (``tenant_id`` None: every tenant)."""
        where, params = ('WHERE tenant_id = ?', (tenant_id,)) if tenant_id is not None else ('', ())
        rows = self._db.query(
            f'SELECT tenant_id, run_id, COUNT(*), SUM(size_bytes) FROM checkpoints {where} GROUP BY tenant_id, run_id',
            params,
        )
        stored: dict[str, dict[str, tuple[int, int]]] = {}
        for row in rows:
            stored.setdefault(row[0], {})[row[1]] = (int(row[2]), int(row[3] or 0))
        return stored

    def page(self, tenant_id: str, limit: int = 100, offset: int = 0) -> tuple[list[Checkpoint], int]:
        """One page of every checkpoint of the tenant, newest first, and how many there are in all."""
        rows = self._db.query(
            'SELECT * FROM checkpoints WHERE tenant_id = ? ORDER BY created_at DESC, rowid DESC LIMIT ? OFFSET ?',
            (tenant_id, limit, offset),
        )
        total = self._db.count('SELECT COUNT(*) FROM checkpoints WHERE tenant_id = ?', (tenant_id,))
        return [_checkpoint(row) for row in rows], total

    def get(self, tenant_id: str, run_id: str, name: str, kind: str = 'training') -> Checkpoint | None:
        rows = self._db.query(
            'SELECT * FROM checkpoints WHERE tenant_id = ? AND run_id = ? AND kind = ? AND name = ?',
            (tenant_id, run_id, kind, name),
        )
        return _checkpoint(rows[0]) if rows else None

    def by_id(self, checkpoint_id: str) -> Checkpoint | None:
        """The checkpoint of this store id, whoever owns it (for links the server signed)."""
        rows = self._db.query('SELECT * FROM checkpoints WHERE id = ?', (checkpoint_id,))
        return _checkpoint(rows[0]) if rows else None

    def readable(self, tenant_id: str, run_id: str, name: str, kind: str) -> Checkpoint | None:
        """A checkpoint the tenant may load: its own, or another tenant's published one."""
        rows = self._db.query(
            'SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ? AND (tenant_id = ? OR public = 1)',
            (run_id, kind, name, tenant_id),
        )
        return _checkpoint(rows[0]) if rows else None

    def delete(self, tenant_id: str, run_id: str, name: str, kind: str = 'training') -> bool:
        """Forget the checkpoint row (the caller deletes its files); False if the tenant had no such one."""
        sql = 'DELETE FROM checkpoints WHERE tenant_id = ? AND run_id = ? AND kind = ? AND name = ?'
        return self._db.execute(sql, (tenant_id, run_id, kind, name)) > 0

    def set_public(self, checkpoint_id: str, public: bool) -> None:
        self._db.execute('UPDATE checkpoints SET public = ? WHERE id = ?', (int(public), checkpoint_id))

    def set_expiry(self, checkpoint_id: str, expires_at: float | None) -> None:
        self._db.execute('UPDATE checkpoints SET expires_at = ? WHERE id = ?', (expires_at, checkpoint_id))

    def pop_expired(self) -> list[Checkpoint]:
        """Forget every checkpoint whose time is up and return them (the caller deletes their files)."""
        with self._db.write() as conn:
            now = self._db.clock()
            rows = conn.execute('SELECT * FROM checkpoints WHERE expires_at <= ?', (now,)).fetchall()
            conn.execute('DELETE FROM checkpoints WHERE expires_at <= ?', (now,))
        return [_checkpoint(row) for row in rows]


def _checkpoint(row: Row) -> Checkpoint:
    # SQLite has no bool: pydantic reads the column's 0 or 1 as the bool ``public`` is.
    return Checkpoint.model_validate(dict(row))
