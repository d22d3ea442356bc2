"""What every route of every API depends on: the tenant a request's API key names."""

from __future__ import annotations

import hmac
import re
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Header, Request

from twinkle.errors import NotFoundError, UnauthorizedError
from twinkle.server.auth import TENANT_KEY, hash_key, key_from_headers
from twinkle.server.store import Tenant
from twinkle.wire import MAX_QUEUE_WAIT_S, QUEUE_HEADER

if TYPE_CHECKING:  # a gateway imports this module (``printable_path``), without the models a Service holds
    from twinkle.server.service import Service

#: What no id or name holds: the C0 control characters and DEL.
_CONTROL = re.compile('[\x00-\x1f\x7f]')


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


def printable_path(request: Request) -> None:
    """Refuse a path parameter holding a control character (U+0000 to U+001F, U+007F) with a 404
    naming it, before any route looks it up. No id or name the server makes or accepts holds one
    (ids are ``<prefix>-<hex>``, names ``check_name``'s characters, model ids hub ids or paths),
    and the store and the filesystem cannot all take them: PostgreSQL's text refuses a NUL (a 500
    from the driver otherwise), a path a NUL. Every route of the app depends on it (``create_app``).

    >>> from starlette.requests import Request
    >>> printable_path(Request({'type': 'http', 'path_params': {'run_id': 'run-1\\x00'}}))
    Traceback (most recent call last):
    twinkle.errors.NotFoundError: run_id 'run-1\\x00' names nothing here: no id or name holds a control character
    """
    for name, value in request.path_params.items():
        if isinstance(value, str) and _CONTROL.search(value):
            raise NotFoundError(f'{name} {value!r} names nothing here: no id or name holds a control character')
