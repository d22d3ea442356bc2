"""What each tenant used: quantities summed per UTC hour, the metering's one table.

A request's usage is added when it finishes (``Usage.add``), without an fsync: a crash may lose the last
ones, as it loses the futures that answered them. Reads sum a window of hours, by run or by hour.

>>> import tempfile, os
>>> from twinkle.server.store import Store
>>> store = Store(os.path.join(tempfile.mkdtemp(), 'twinkle.db'), clock=lambda: 7300.0)
>>> tenant, _ = store.tenants.add('alice')
>>> store.usage.add(tenant.id, 'run-1', None, 'tiny-qwen3', {'training': 40, 'compute_seconds': 0.5})
>>> store.usage.add(tenant.id, 'run-1', None, 'tiny-qwen3', {'training': 2})
>>> [(row.hour, row.kind, row.quantity) for row in store.usage.hours(tenant.id, 0, 10_800)]
[(7200.0, 'compute_seconds', 0.5), (7200.0, 'training', 42.0)]
>>> store.close()
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel

from twinkle.errors import one_of
from twinkle.server.store.database import Aggregate, SqlValue

#: What is metered: tokens trained (forward and forward_backward), prompt tokens and sampled tokens
#: (sampling), seconds of the model's worker, and checkpoints saved.
USAGE_KINDS = ('training', 'sampling_prefill', 'sampling_sample', 'compute_seconds', 'checkpoint')
HOUR_S = 3600.0


class UsageRow(BaseModel, frozen=True):
    """A quantity of one kind in one UTC hour (``hour``: its start, unix seconds), of one tenant's run
    (``run_id`` None: sampling without a run) in a Tinker session (``session_id``) on ``base_model``."""

    tenant_id: str
    run_id: str | None
    session_id: str | None
    base_model: str
    kind: str
    hour: float
    quantity: float


class Usage(Aggregate):
    """The usage table. Reads take a tenant (None: every tenant, for the admin)."""

    def add(
        self,
        tenant_id: str,
        run_id: str | None,
        session_id: str | None,
        base_model: str,
        quantities: Mapping[str, float],
    ) -> None:
        """Add ``quantities`` (kind -> amount; zeros skipped) to the current hour's rows."""
        for kind in quantities:
            if kind not in USAGE_KINDS:
                raise one_of('usage kind', kind, USAGE_KINDS)
        hour = self._db.clock() // HOUR_S * HOUR_S
        rows = [
            (tenant_id, run_id or '', session_id or '', base_model, kind, hour, float(amount))
            for kind, amount in quantities.items()
            if amount
        ]
        if not rows:
            return
        with self._db.write(durable=False) as conn:
            conn.executemany(
                'INSERT INTO usage (tenant_id, run_id, session_id, base_model, kind, hour, quantity) '
                'VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant_id, hour, run_id, session_id, base_model, kind) '
                'DO UPDATE SET quantity = usage.quantity + excluded.quantity',
                rows,
            )

    def total(self, tenant_id: str, kinds: tuple[str, ...], since: float) -> float:
        """The tenant's usage of ``kinds`` in the hours from the one ``since`` falls in."""
        marks = ', '.join('?' * len(kinds))
        rows = self._db.query(
            f'SELECT SUM(quantity) FROM usage WHERE tenant_id = ? AND hour >= ? AND kind IN ({marks})',
            (tenant_id, since // HOUR_S * HOUR_S, *kinds),
        )
        return float(rows[0][0] or 0.0)

    def hours(self, tenant_id: str | None, since: float, until: float) -> list[UsageRow]:
        """The rows of the hours that start in ``[since, until)``, oldest first (``tenant_id`` None: all)."""
        params: list[SqlValue] = [since, until]
        where = 'hour >= ? AND hour < ?'
        if tenant_id is not None:
            where, params = f'tenant_id = ? AND {where}', [tenant_id, *params]
        rows = self._db.query(
            'SELECT tenant_id, run_id, session_id, base_model, kind, hour, quantity FROM usage '
            f'WHERE {where} ORDER BY hour, tenant_id, run_id, session_id, base_model, kind',
            params,
        )
        return [
            UsageRow(
                tenant_id=row['tenant_id'],
                run_id=row['run_id'] or None,
                session_id=row['session_id'] or None,
                base_model=row['base_model'],
                kind=row['kind'],
                hour=row['hour'],
                quantity=row['quantity'],
            )
            for row in rows
        ]
