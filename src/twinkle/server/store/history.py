"""What happened over time: a run's figures at each optimizer step, and the restarts of a model's workers."""

from __future__ import annotations

import json

from twinkle.server.store.database import Aggregate


class History(Aggregate):
    """The run_steps and model_restarts tables: written as things happen, read by the dashboard and the
    runs' history routes. Steps are not scoped by tenant here: the routes check the run is the caller's."""

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
            sql = 'INSERT OR REPLACE INTO run_steps (run_id, step, at, figures_json) VALUES (?, ?, ?, ?)'
            conn.executemany(sql, rows)

    def steps(self, run_id: str, after: int = 0, limit: int = 1000) -> list[dict[str, float]]:
        """A run's recorded steps after step ``after``, oldest first: ``{'step', 'time', <figures>}``."""
        rows = self._db.query(
            'SELECT step, at, figures_json FROM run_steps WHERE run_id = ? AND step > ? ORDER BY step LIMIT ?',
            (run_id, after, limit),
        )
        return [{'step': row['step'], 'time': row['at'], **json.loads(row['figures_json'])} for row in rows]

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
