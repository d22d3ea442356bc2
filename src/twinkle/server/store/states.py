"""Kept states: the one saved state each run continues from once its adapter is off the model, and what
it lost.

The server keeps a run's whole state (weights, optimizer, counters, the gradients waiting for a step) in
a folder of its own each time (``state@<id>``, in host memory or on disk: ``run_files``); the row here
names the folder that counts. Writing the folder and then this row is how a state is committed: a step's
row is written in the transaction that settles the step's future, so a step the client was told of is
in the state its run comes back from, and a step it was not told of is not (a crash before the commit
leaves the previous row, and the new folder is swept at the next start).

``lost`` is what a run brought back from its state found acknowledged after it: the requests the
server answered whose effect died with a model worker. It is kept until the run's next request is
failed with it (``Runs`` are told once), and ``lost_through`` is the time up to which requests were
looked at, so none is reported twice.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from twinkle.server.store.database import Aggregate


class LostRequest(BaseModel, frozen=True):
    """A request the server answered whose effect a run lost: its future's id and operation."""

    id: str
    op: str


class KeptState(BaseModel, frozen=True):
    """The committed kept state of a run: its folder's name, when it was committed (unix seconds), and
    the lost requests its run has not been told of yet."""

    run_id: str
    #: None: the run has lost requests to be told of, and no kept state.
    folder: str | None
    at: float
    lost: list[LostRequest] = []
    lost_through: float = 0.0


class States(Aggregate):
    """The run_states table: a row per run that has a kept state."""

    def commit(self, run_id: str, folder: str) -> str | None:
        """Name ``folder`` the run's kept state, now (in the open transaction, if any); the folder
        it named before (None: none), which its caller deletes once this commits."""
        with self._db.write() as conn:
            row = conn.execute('SELECT folder FROM run_states WHERE run_id = ?', (run_id,)).fetchone()
            conn.execute(
                'INSERT INTO run_states (run_id, folder, at) VALUES (?, ?, ?) '
                'ON CONFLICT (run_id) DO UPDATE SET folder = excluded.folder, at = excluded.at',
                (run_id, folder, self._db.clock()),
            )
        return None if row is None else str(row[0])

    def get(self, run_id: str) -> KeptState | None:
        rows = self._db.query('SELECT * FROM run_states WHERE run_id = ?', (run_id,))
        if not rows:
            return None
        row = dict(rows[0])
        lost = [LostRequest.model_validate(item) for item in json.loads(row.pop('lost_json') or '[]')]
        return KeptState(**row, lost=lost)

    def folders(self) -> dict[str, str]:
        """Run id -> the folder of its kept state, for every run that has one (the sweep at start)."""
        rows = self._db.query('SELECT run_id, folder FROM run_states WHERE folder IS NOT NULL')
        return {str(row[0]): str(row[1]) for row in rows}

    def add_lost(self, run_id: str, lost: list[LostRequest], through: float) -> list[LostRequest]:
        """Add ``lost`` to what the run has not been told of, having looked at requests up to ``through``;
        everything it has not been told of now."""
        with self._db.write() as conn:
            row = conn.execute('SELECT lost_json FROM run_states WHERE run_id = ?', (run_id,)).fetchone()
            known = [LostRequest.model_validate(item) for item in json.loads((row and row[0]) or '[]')]
            kept = [*known, *(request for request in lost if request not in known)]
            text = json.dumps([request.model_dump() for request in kept]) if kept else None
            conn.execute(
                'INSERT INTO run_states (run_id, folder, at, lost_json, lost_through) VALUES (?, NULL, ?, ?, ?) '
                'ON CONFLICT (run_id) DO UPDATE SET lost_json = excluded.lost_json, '
                'lost_through = excluded.lost_through',
                (run_id, self._db.clock(), text, through),
            )
        return kept

    def told(self, run_id: str) -> None:
        """The run's client was told of its lost requests (a request failed with them)."""
        self._db.execute('UPDATE run_states SET lost_json = NULL WHERE run_id = ?', (run_id,))

    def forget(self, run_id: str) -> None:
        """The run was deleted: it has no kept state."""
        self._db.execute('DELETE FROM run_states WHERE run_id = ?', (run_id,))


__all__ = ['KeptState', 'LostRequest', 'States']
