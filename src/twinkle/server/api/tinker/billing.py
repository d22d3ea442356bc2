"""Tinker's billing routes, answered from the service's metering (``twinkle.server.metering``):
what ``tinker billing usage`` and ``tinker billing checkpoint-storage`` ask for.

A tenant is the SDK's organization and its one user. Usage comes per UTC hour, kind (tokens
trained, prompt tokens, sampled tokens, checkpoints saved), base model and session, priced by the
server's ``pricing``: estimates at the configured rates, never an invoice (``cost_data_through`` is
null). The worker seconds twinkle also meters have no Tinker event; storage comes as the current
checkpoint storage only (the store keeps what is stored now, not its history hour by hour).
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from datetime import datetime, timedelta, timezone

from fastapi import APIRouter
from pydantic import AwareDatetime, JsonValue

from twinkle.errors import DataError
from twinkle.server.api.deps import Who
from twinkle.server.api.tinker.base import JsonObject, TinkerAPI, router
from twinkle.server.metering import GIGABYTE, rate, storage_cost_per_month
from twinkle.server.service import Service
from twinkle.server.store import HOUR_S, Tenant

#: The longest window one request may ask for, as Tinker's.
MAX_WINDOW = timedelta(days=14)
#: The Tinker events of the metered kinds (worker seconds have none).
EVENT_TYPES = ('training', 'sampling_prefill', 'sampling_sample', 'checkpoint')


def billing_router(api: TinkerAPI) -> APIRouter:
    """``GET /api/v1/billing/usage/events`` and ``GET /api/v1/billing/usage/checkpoints/current``."""
    service, routes = api.service, router(api)

    @routes.get('/billing/usage/events')
    async def usage_events(starting_on: AwareDatetime, ending_before: AwareDatetime, who: Who) -> JsonObject:
        """The tenant's hourly usage in ``[starting_on, ending_before)``: RFC 3339 times on UTC
        hour boundaries, at most 14 days apart, the start not in the future (else a 400)."""
        since, until = _window(starting_on, ending_before)
        return await asyncio.to_thread(_events, service, who, since, until)

    @routes.get('/billing/usage/checkpoints/current')
    async def checkpoint_storage(who: Who, project_id: str | None = None) -> JsonObject:
        price = service.config.pricing.storage_per_gigabyte_month
        if project_id is not None:  # this server has no projects: no checkpoint is in one
            return {'effective_rate_usd_per_gigabyte_month': price, 'data': []}
        runs = (await asyncio.to_thread(service.store.checkpoints.stored, who.id)).get(who.id, {})
        count, size = sum(c for c, _ in runs.values()), sum(s for _, s in runs.values())
        item: JsonObject = {
            'project_id': None,
            'org_user_urn': who.name,
            'user_name': who.name,
            'checkpoint_count': count,
            'size_bytes': size,
            'size_gigabytes': size / GIGABYTE,
            'estimated_monthly_cost_usd': storage_cost_per_month(service.config.pricing, size),
        }
        return {'effective_rate_usd_per_gigabyte_month': price, 'data': [item] if count else []}

    return routes


def _window(start: datetime, end: datetime) -> tuple[float, float]:
    """The window as unix seconds; ``DataError`` (a 400) unless both times are on UTC hour
    boundaries, the start not in the future, the end after it and at most 14 days later."""
    for name, when in (('starting_on', start), ('ending_before', end)):
        if when.timestamp() % HOUR_S:
            raise DataError(f'{name} {when.isoformat()} must be on a UTC hour boundary (minutes and seconds 0)')
    if start > datetime.now(timezone.utc):
        raise DataError(f'starting_on {start.isoformat()} is in the future')
    if not start < end <= start + MAX_WINDOW:
        raise DataError(
            f'ending_before {end.isoformat()} must be after starting_on {start.isoformat()} and at most 14 days later'
        )
    return start.timestamp(), end.timestamp()


def _events(service: Service, who: Tenant, since: float, until: float) -> JsonObject:
    """The tenant's usage in the window as Tinker's ``BillingUsageResponse``."""
    buckets: dict[tuple[float, str, str, str | None], float] = defaultdict(float)
    for row in service.store.usage.hours(who.id, since, until):
        if row.kind in EVENT_TYPES:
            buckets[row.hour, row.kind, row.base_model, row.session_id] += row.quantity
    ordered = sorted(buckets.items(), key=lambda item: (item[0][0], -item[1]))  # by hour, then the most first
    events: list[JsonValue] = [_event(service, who, *key, quantity) for key, quantity in ordered]
    sessions: JsonObject = {}
    for session_id in sorted({session for _, _, _, session in buckets if session is not None}):
        session = service.store.sessions.get(who.id, session_id)
        metadata = session.info.get('user_metadata') if session is not None else None
        strings: JsonObject = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
        sessions[session_id] = {'user_metadata': strings or None}
    return {'data': events, 'sessions': sessions, 'cost_data_through': None}


def _event(
    service: Service, who: Tenant, hour: float, kind: str, base_model: str, session_id: str | None, quantity: float
) -> JsonObject:
    unit = rate(service.config.pricing, kind)
    info: JsonObject = {'type': kind}
    if kind == 'checkpoint':
        info['count'] = int(quantity)
    else:
        info['token_count'] = int(quantity)
    if kind == 'sampling_prefill':
        info['cached'] = False
    tokens = kind != 'checkpoint'
    return {
        'bucket_start': _iso(hour),
        'bucket_end': _iso(hour + HOUR_S),
        'base_model': base_model,
        'user_id': who.name,
        'user_name': who.name,
        'session_id': session_id,
        'project_id': None,
        'estimated_cost_usd': quantity * unit if unit is not None and tokens else None,
        'effective_rate_usd_per_million_tokens': unit * 1e6 if unit is not None and tokens else None,
        'effective_rate_usd_per_gigabyte_month': None,
        'event_info': info,
    }


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()


__all__ = ['billing_router']
