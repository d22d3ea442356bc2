"""Sampled sequences' stability information: what a ``stable_reinforce`` training request needs of
a sequence it trains on, recorded when the sequence was sampled with ``record_stability_info``.

Each row is one sampled sequence (its Tinker ``sequence_id``): the prompt it was sampled from, the
tokens the sampler drew and the sampler's log-probability of each. A row belongs to the tenant and
the Tinker session that sampled it, and is kept while it is used: it expires ``SEQUENCE_TTL_S`` (one
day) after it was recorded or last used by a training request, whichever is later. Expired rows are
deleted when the next sequences are recorded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel

from twinkle.server.store.database import Aggregate, Row

#: How long a recorded sequence is kept without a training request using it (Tinker: "expires after inactivity").
SEQUENCE_TTL_S = 24 * 3600.0


class SampledRecord(BaseModel, frozen=True):
    """One recorded sequence."""

    id: str
    tenant_id: str
    session_id: str
    prompt: list[int]
    tokens: list[int]
    #: The sampler's log-probability of each of ``tokens``.
    logprobs: list[float]
    created_at: float
    last_used_at: float

    def expired(self, now: float) -> bool:
        return now - self.last_used_at > SEQUENCE_TTL_S


class SampledSequences(Aggregate):
    """The sampled_sequences table; a tenant reads only its own rows."""

    def record(
        self,
        tenant_id: str,
        session_id: str,
        prompt: Sequence[int],
        sequences: Sequence[tuple[str, list[int], list[float]]],
    ) -> None:
        """Record ``(sequence_id, tokens, logprobs)`` of each sequence sampled from ``prompt``, in one
        commit, after deleting the rows that have expired."""
        now = self._db.clock()
        prompt_bytes = _ints(prompt)
        rows = [(sid, tenant_id, session_id, prompt_bytes, _ints(t), _floats(lp), now, now) for sid, t, lp in sequences]
        with self._db.write() as conn:
            conn.execute('DELETE FROM sampled_sequences WHERE last_used_at < ?', (now - SEQUENCE_TTL_S,))
            conn.executemany(
                'INSERT INTO sampled_sequences (id, tenant_id, session_id, prompt, tokens, logprobs, created_at, '
                'last_used_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET tenant_id = '
                'excluded.tenant_id, session_id = excluded.session_id, prompt = excluded.prompt, tokens = '
                'excluded.tokens, logprobs = excluded.logprobs, created_at = excluded.created_at, '
                'last_used_at = excluded.last_used_at',
                rows,
            )

    def get(self, tenant_id: str, sequence_ids: Sequence[str]) -> dict[str, SampledRecord]:
        """The tenant's rows of these ids (expired ones too: the caller says why it refuses them)."""
        unique = sorted(set(sequence_ids))
        found: dict[str, SampledRecord] = {}
        for start in range(0, len(unique), 500):  # SQLite's limit of bound parameters is far above 500
            chunk = unique[start : start + 500]
            marks = ', '.join('?' * len(chunk))
            rows = self._db.query(
                f'SELECT * FROM sampled_sequences WHERE tenant_id = ? AND id IN ({marks})', (tenant_id, *chunk)
            )
            found.update((row['id'], _record(row)) for row in rows)
        return found

    def touch(self, sequence_ids: Sequence[str]) -> None:
        """A training request used these rows: their day starts again."""
        unique = sorted(set(sequence_ids))
        now = self._db.clock()
        with self._db.write() as conn:
            conn.executemany('UPDATE sampled_sequences SET last_used_at = ? WHERE id = ?', [(now, i) for i in unique])

    def now(self) -> float:
        return self._db.clock()


def _ints(values: Sequence[int]) -> bytes:
    return np.asarray(values, dtype='<i8').tobytes()


def _floats(values: Sequence[float]) -> bytes:
    return np.asarray(values, dtype='<f4').tobytes()


def _record(row: Row) -> SampledRecord:
    fields = dict(row)
    for name in ('prompt', 'tokens'):
        fields[name] = np.frombuffer(fields[name], dtype='<i8').tolist()
    fields['logprobs'] = np.frombuffer(fields['logprobs'], dtype='<f4').tolist()
    return SampledRecord.model_validate(fields)


__all__ = ['SEQUENCE_TTL_S', 'SampledRecord', 'SampledSequences']
