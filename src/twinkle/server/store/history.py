"""What happened over time: a run's figures at each optimizer step, the times a run came back with less
than it had, and the restarts of a model's workers."""

from __future__ import annotations

import json
from typing import TypedDict

from twinkle.server.store.database import Aggregate, Row


class Restore(TypedDict):
    """A run brought back with less than it had (``History.record_restore``)."""

    time: float
    step: int
    checkpoint: str | None
    fresh_optimizer: bool
    lost_steps: int


class History(Aggregate):
    """The run_steps, run_restores and model_restarts tables: written as things happen, read by the dashboard
    and the runs' routes. Not scoped by tenant here: the routes check the run is the caller's."""

    def add_steps(self, run_id: str, steps: list[dict[str, float]]) -> None:
        """Record a run's optimizer steps (``StepLog`` entries: 'step' and its figures); a step
        recorded again (a run resumed from an earlier checkpoint) replaces the old one. Not
        fsynced: a crash may lose the last steps' figures, never the run."""
        now = self._db.clock()
        rows = [
            (run_id, int(entry['step']), now, json.dumps({k: v for k, v in entry.items() if k != 'step'}))
            for entry in steps
        ]
        with self._db.write(durable=False) as conn:
            sql = (
                'INSERT INTO run_steps (run_id, step, at, figures_json) VALUES (?, ?, ?, ?) '
                'ON CONFLICT (run_id, step) DO UPDATE SET at = excluded.at, figures_json = excluded.figures_json'
            )
            conn.executemany(sql, rows)

    def steps(self, run_id: str, after: int = 0, limit: int = 1000) -> list[dict[str, float]]:
        """A run's recorded steps after step ``after``, oldest first: ``{'step', 'time', <figures>}``."""
        rows = self._db.query(
            'SELECT step, at, figures_json FROM run_steps WHERE run_id = ? AND step > ? ORDER BY step LIMIT ?',
            (run_id, after, limit),
        )
        return [{'step': row['step'], 'time': row['at'], **json.loads(row['figures_json'])} for row in rows]

    def record_restore(self, run_id: str, step: int, checkpoint: str | None, fresh_optimizer: bool) -> Restore | None:
        """A run came back at optimizer step ``step`` (from ``checkpoint``, a ``twinkle://`` path, or None:
        the server's own saved state), its optimizer afresh or not. Its recorded steps after ``step`` never
        happened to it now: they are forgotten (its next steps record them again). When that lost any, or
        the optimizer is fresh, the restore is recorded and returned (None: it came back as it was)."""
        with self._db.write() as conn:
            after = 'FROM run_steps WHERE run_id = ? AND step > ?'
            lost = int(conn.execute(f'SELECT COUNT(*) {after}', (run_id, step)).fetchone()[0])
            if not lost and not fresh_optimizer:
                return None
            conn.execute(f'DELETE {after}', (run_id, step))
            restore: Restore = {
                'time': self._db.clock(), 'step': step, 'checkpoint': checkpoint, 'fresh_optimizer': fresh_optimizer,
                'lost_steps': lost,
            }  # fmt: skip
            columns = 'run_id, at, step, checkpoint, fresh_optimizer, lost_steps'
            values = (run_id, restore['time'], step, checkpoint, int(fresh_optimizer), lost)
            conn.execute(f'INSERT INTO run_restores ({columns}) VALUES (?, ?, ?, ?, ?, ?)', values)
        return restore

    def restores(self, run_id: str) -> list[Restore]:
        """The times a run came back with less than it had, oldest first."""
        rows = self._db.query('SELECT * FROM run_restores WHERE run_id = ? ORDER BY id', (run_id,))
        return [_restore(row) for row in rows]

    def last_restore(self, run_id: str) -> Restore | None:
        rows = self._db.query('SELECT * FROM run_restores WHERE run_id = ? ORDER BY id DESC LIMIT 1', (run_id,))
        return _restore(rows[0]) if rows else None

    def record_restart(self, base_model: str, reason: str) -> None:
        """A model's worker processes were started again (one of them died)."""
        self._db.execute(
            'INSERT INTO model_restarts (base_model, reason, at) VALUES (?, ?, ?)',
            (base_model, reason, self._db.clock()),
        )

    def restarts(self, base_model: str) -> list[tuple[str, float]]:
        """The restarts of a model's workers, oldest first: (reason, unix time)."""
        rows = self._db.query('SELECT reason, at FROM model_restarts WHERE base_model = ? ORDER BY id', (base_model,))
        return [(str(row['reason']), float(row['at'])) for row in rows]


def _restore(row: Row) -> Restore:
    return {
        'time': float(row['at']), 'step': int(row['step']), 'checkpoint': row['checkpoint'],
        'fresh_optimizer': bool(row['fresh_optimizer']), 'lost_steps': int(row['lost_steps']),
    }  # fmt: skip
