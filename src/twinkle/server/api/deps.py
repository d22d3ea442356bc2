"""What every route of every API depends on: the tenant a request's API key names."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Header, Request

from twinkle.errors import UnauthorizedError
from twinkle.server.auth import TENANT_KEY, hash_key, key_from_headers
from twinkle.server.service import Service
from twinkle.server.store import Tenant
from twinkle.wire import MAX_QUEUE_WAIT_S, QUEUE_HEADER


def key_holder(request: Request) -> Tenant:
    """The tenant whose API key the request carries (``Authorization: Bearer <key>`` or
    ``X-API-Key: <key>``); 401 without a known one. A route may call it before it reads the body.

    The key is looked up once per request: what ``HttpLimits`` or an earlier call found is kept in
    the request's scope (``TENANT_KEY``). Only within one request: a key removed while the server
    runs (``twinkle-server keys remove``, from another process) is refused from the next request on."""
    key = key_from_headers(request.headers)
    if not key:
        raise UnauthorizedError('missing API key: send "Authorization: Bearer <key>" or "X-API-Key: <key>"')
    if TENANT_KEY in request.scope:
        found: Tenant | None = request.scope[TENANT_KEY]
    else:
        service: Service = request.app.state.service
        found = request.scope[TENANT_KEY] = service.store.tenants.for_key(key)
    if found is None:
        raise UnauthorizedError('unknown API key')
    return found


async def tenant_of(request: Request) -> Tenant:
    """The tenant whose API key the request carries (see ``key_holder``); 401 without a known
    one; 429 over the tenant's request rate."""
    found = key_holder(request)
    service: Service = request.app.state.service
    if service.limiter is not None:
        service.limiter.acquire(found.id, found.name)
    return found


Who = Annotated[Tenant, Depends(tenant_of)]
#: Seconds a compute request may wait for room in its tenant's full queue before it is refused
#: with a 429 (``X-Twinkle-Queue``; 0, the default: refused at once).
QueueWait = Annotated[float, Header(alias=QUEUE_HEADER, ge=0, le=MAX_QUEUE_WAIT_S, allow_inf_nan=False)]


def is_admin(service: Service, request: Request) -> bool:
    """Whether the request carries the server's admin key."""
    configured, key = service.config.admin_api_key, key_from_headers(request.headers)
    if configured is None or not key:
        return False
    hashed = configured.lower().startswith('sha256:')
    expected = configured[len('sha256:') :].lower() if hashed else hash_key(configured)
    return hmac.compare_digest(hash_key(key).encode(), expected.encode('utf-8', 'replace'))
