"""Metering: what each request used, charged when it finishes, and the reports priced from it.

A route gives ``Service.submit`` a ``Meter`` with what it knows when it accepts a request (the
tokens of a ``forward_backward``, a checkpoint to save); a sampling job adds its prompt and sampled
tokens as it answers (``Meter.sampled``). Every job of a tenant is charged its worker's seconds, a
shared pass's split evenly between its requests. The store keeps them per UTC hour
(``store/usage.py``); ``usage_report`` sums a window per tenant and run, with the stored bytes of
their checkpoints now, priced by the config's ``pricing`` (``Pricing``).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from pydantic import JsonValue

from twinkle.errors import DailyQuotaError, QuotaError
from twinkle.server.config import Pricing, Quotas
from twinkle.server.store import USAGE_KINDS, Store, Tenant

#: The usage kinds a ``tokens_per_day`` quota counts.
TOKEN_KINDS = ('training', 'sampling_prefill', 'sampling_sample')
DAY_S = 86_400.0
#: Bytes in the gigabyte storage is priced in, and hours in the month its price is for (Tinker's units).
GIGABYTE = 1e9
MONTH_HOURS = 720.0


@dataclass
class Meter:
    """What one request is charged once it succeeds (its worker seconds are charged either way)."""

    #: Tokens of a forward or forward_backward.
    training_tokens: int = 0
    #: Prompt tokens sampled from, once per prompt.
    prefill_tokens: int = 0
    #: Tokens sampled, over every sequence.
    sampled_tokens: int = 0
    #: Checkpoints saved.
    checkpoints: int = 0
    #: The Tinker session the request belongs to (None: the native API's).
    session_id: str | None = None

    def sampled(self, prompts: Iterable[int], sequences: Iterable[int]) -> None:
        """Add a sampling request's prompt lengths and its sequences' lengths."""
        self.prefill_tokens += sum(prompts)
        self.sampled_tokens += sum(sequences)

    def sampled_json(self, responses: Iterable[Mapping[str, Any]]) -> None:
        """Add what the native API's sampling answered: one response per prompt, each sequence's
        ``new_input_feature`` the prompt and its ``tokens``."""
        for response in responses:
            sequences = response['sequences']
            if sequences:
                first = sequences[0]
                self.prefill_tokens += len(first['new_input_feature']['input_ids']) - len(first['tokens'])
            self.sampled_tokens += sum(len(sequence['tokens']) for sequence in sequences)

    @property
    def tokens(self) -> int:
        """The tokens a daily quota counts, as known now."""
        return self.training_tokens + self.prefill_tokens + self.sampled_tokens

    def quantities(self) -> dict[str, float]:
        """The charge of a request that succeeded, by usage kind."""
        return {
            'training': self.training_tokens,
            'sampling_prefill': self.prefill_tokens,
            'sampling_sample': self.sampled_tokens,
            'checkpoint': self.checkpoints,
        }


class Ledger:
    """The tenants' quotas (``Quotas``) held against what they used and what they asked for:
    a request is admitted (``admit``) with the tokens of the requests of its tenant not finished
    yet counted, which its end ``settle`` s. Thread-safe: routes admit on the event loop, jobs
    settle on the workers."""

    def __init__(self, store: Store, quotas: Quotas, clock: Callable[[], float] = time.time):
        self.store, self.quotas, self.clock = store, quotas, clock
        self._pending: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def admit(self, tenant: Tenant, meter: Meter) -> None:
        """Take a request of ``tenant``'s (its ``meter.tokens`` pending until ``settle``), or raise:
        ``DailyQuotaError`` (a 429 until midnight UTC) when its tokens would pass ``tokens_per_day``,
        ``QuotaError`` (a 403) for a save when its checkpoints fill ``stored_bytes``."""
        quota = self.quotas.of(tenant.name)
        if quota.stored_bytes is not None and meter.checkpoints:
            kept = sum(size for _, size in self.store.checkpoints.stored(tenant.id).get(tenant.id, {}).values())
            if kept >= quota.stored_bytes:
                raise QuotaError(
                    f'tenant {tenant.name!r} keeps {kept:,} bytes of checkpoints, its stored_bytes quota of '
                    f'{quota.stored_bytes:,}: delete checkpoints to save more'
                )
        with self._lock:
            if quota.tokens_per_day is not None:
                now = self.clock()
                midnight = now // DAY_S * DAY_S
                used = self.store.usage.total(tenant.id, TOKEN_KINDS, midnight) + self._pending[tenant.id]
                if used + meter.tokens > quota.tokens_per_day:
                    resets = datetime.fromtimestamp(midnight + DAY_S, tz=timezone.utc).isoformat()
                    raise DailyQuotaError(
                        f'tenant {tenant.name!r} used {int(used):,} of its tokens_per_day quota of '
                        f'{quota.tokens_per_day:,} tokens, and this request holds {meter.tokens:,}; it resets at '
                        f'{resets}',
                        retry_after_s=midnight + DAY_S - now,
                    )
            self._pending[tenant.id] += meter.tokens

    def settle(self, tenant: Tenant, tokens: int) -> None:
        """A request admitted with ``tokens`` ended (or never ran): they are no longer pending."""
        if not tokens:
            return
        with self._lock:
            self._pending[tenant.id] -= tokens
            if not self._pending[tenant.id]:
                del self._pending[tenant.id]

    def admit_run(self, tenant: Tenant) -> None:
        """A new training run of ``tenant``'s, or ``QuotaError`` (a 403) when it holds its ``runs``."""
        limit = self.quotas.of(tenant.name).runs
        if limit is None:
            return
        held = sum(self.store.runs.count(status, tenant_id=tenant.id) for status in ('active', 'released'))
        if held >= limit:
            raise QuotaError(
                f'tenant {tenant.name!r} holds {held} training runs, its runs quota of {limit}: delete one '
                '(DELETE /twinkle/v1/runs/{run_id}) to make another'
            )

    def weight(self, tenant_name: str) -> float:
        """The tenant's share of a worker while tenants wait (``Quota.weight``)."""
        return self.quotas.of(tenant_name).weight


def rate(pricing: Pricing, kind: str) -> float | None:
    """The price of one unit of ``kind`` (a token, a second, a checkpoint); None: not priced."""
    per_unit = {
        'training': (pricing.training_per_million_tokens, 1e6),
        'sampling_prefill': (pricing.sampling_prefill_per_million_tokens, 1e6),
        'sampling_sample': (pricing.sampling_sample_per_million_tokens, 1e6),
        'compute_seconds': (pricing.compute_per_hour, 3600.0),
        'checkpoint': (pricing.per_checkpoint, 1.0),
    }
    price, units = per_unit[kind]
    return None if price is None else price / units


def storage_cost_per_month(pricing: Pricing, size_bytes: int) -> float | None:
    """A month's price of keeping ``size_bytes``; None: storage is not priced."""
    price = pricing.storage_per_gigabyte_month
    return None if price is None else price * size_bytes / GIGABYTE


def usage_report(store: Store, pricing: Pricing, tenant_id: str | None, since: float, until: float) -> JsonValue:
    """Each tenant's usage in the hours starting in ``[since, until)``, per run and in total, with
    its checkpoints' stored bytes now and the costs (``tenant_id`` None: every tenant)."""
    names = {tenant.id: tenant.name for tenant in store.tenants.all()}
    runs: dict[str, dict[tuple[str | None, str], dict[str, float]]] = defaultdict(dict)
    for row in store.usage.hours(tenant_id, since, until):
        figures = runs[row.tenant_id].setdefault((row.run_id, row.base_model), dict.fromkeys(USAGE_KINDS, 0.0))
        figures[row.kind] += row.quantity
    stored = store.checkpoints.stored(tenant_id)
    tenants = sorted(set(runs) | set(stored) | ({tenant_id} if tenant_id is not None else set()))
    return {
        'since': since,
        'until': until,
        'tenants': [_tenant_report(names.get(t, t), runs[t], stored.get(t, {}), pricing) for t in tenants],
    }


def _tenant_report(
    name: str,
    runs: Mapping[tuple[str | None, str], Mapping[str, float]],
    stored: Mapping[str, tuple[int, int]],
    pricing: Pricing,
) -> dict[str, JsonValue]:
    rows: list[JsonValue] = []
    total = dict.fromkeys(USAGE_KINDS, 0.0)
    for (run_id, base_model), figures in sorted(runs.items(), key=lambda item: (item[0][0] or '', item[0][1])):
        count, size = stored.get(run_id or '', (0, 0))
        rows.append({'run_id': run_id, 'base_model': base_model, **_priced(figures, count, size, pricing)})
        for kind in USAGE_KINDS:
            total[kind] += figures[kind]
    used = {run_id for run_id, _ in runs}
    for run_id, (count, size) in sorted(stored.items()):  # runs with checkpoints but no usage in the window
        if run_id not in used:
            unused = _priced(dict.fromkeys(USAGE_KINDS, 0.0), count, size, pricing)
            rows.append({'run_id': run_id, 'base_model': None, **unused})
    count = sum(c for c, _ in stored.values())
    size = sum(s for _, s in stored.values())
    return {'tenant': name, 'runs': rows, 'total': _priced(total, count, size, pricing)}


def _priced(figures: Mapping[str, float], checkpoints: int, size: int, pricing: Pricing) -> dict[str, JsonValue]:
    """The figures under their report names, the stored checkpoints, and the cost (None if a used kind is unpriced)."""
    costs = [(amount, rate(pricing, kind)) for kind, amount in figures.items() if amount]
    storage = storage_cost_per_month(pricing, size) if size else 0.0
    priced = all(price is not None for _, price in costs) and storage is not None
    return {
        'tokens_trained': int(figures['training']),
        'prompt_tokens_sampled': int(figures['sampling_prefill']),
        'tokens_sampled': int(figures['sampling_sample']),
        'compute_seconds': round(figures['compute_seconds'], 6),
        'checkpoints_saved': int(figures['checkpoint']),
        'checkpoints_stored': checkpoints,
        'bytes_stored': size,
        'cost_usd': round(sum(amount * (price or 0.0) for amount, price in costs), 9) if priced else None,
        'storage_usd_per_month': storage,
    }
