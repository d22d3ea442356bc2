"""Idempotency keys: a compute request of the native API sent with ``Idempotency-Key: <key>`` runs once.

The key is recorded with the request's future, in the write that creates it (``store/futures.py``: one
future per tenant and key), so the same request sent again, through any gateway and for as long as the
future is kept, finds the first one's future (``known_future``) and is answered it, waited for as its
``?wait=`` asks, without running anything. What the request asks is hashed with the key (its operation,
its run and its body as validated, the same in JSON or in MessagePack): a key sent with another request
is a 422 that says so (``check_same``). A request refused before it ran (its tenant's queue full) frees
its key: the client's retry after the ``Retry-After`` is a new request.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import Header
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel

from twinkle.server.service import Service
from twinkle.server.store import FutureRecord, RequestKey, Tenant
from twinkle.wire import IDEMPOTENCY_HEADER

#: A compute request's key (a UUID, say): 1 to 255 visible ASCII characters.
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias=IDEMPOTENCY_HEADER,
        min_length=1,
        max_length=255,
        pattern=r'^[!-~]+$',
        description="Names this request: sent again with the same key, it is answered the first one's future",
    ),
]


def request_key(key: str | None, operation: str, run_id: str | None, body: BaseModel | None) -> RequestKey | None:
    """The request's key with the hash of what it asks: its operation, run and body (None without a key).

    >>> from twinkle.wire import SaveRequest
    >>> one, two = (request_key('k', 'save', 'run-1', SaveRequest(name=name)) for name in ('a', 'b'))
    >>> one == request_key('k', 'save', 'run-1', SaveRequest(name='a')), one == two, one.key == two.key
    (True, False, True)
    """
    if key is None:
        return None
    asked = hashlib.sha256(f'{operation}\n{run_id}\n'.encode())
    asked.update(body.model_dump_json().encode() if body is not None else b'')
    return RequestKey(key, asked.hexdigest())


def known_future(service: Service, who: Tenant, once: RequestKey | None) -> FutureRecord | None:
    """The future of the request the tenant sent with this key before (None: a new request); a 422 if
    that was another request."""
    record = service.store.futures.by_key(who.id, once.key) if once is not None else None
    if once is not None and record is not None:
        check_same(once, record)
    return record


def check_same(once: RequestKey, record: FutureRecord) -> None:
    """A 422 on the header unless ``record`` is the future of the request ``once`` describes."""
    if record.request_hash == once.request_hash:
        return
    where = f'on run {record.run_id!r}' if record.run_id else 'on no run'
    problem = (
        f'this key named another request before ({record.op} {where}, request {record.id!r}): the operation, '
        'the run or the body differ. A key names one request: send a new key with a new request'
    )
    raise RequestValidationError([{'loc': ('header', IDEMPOTENCY_HEADER), 'msg': problem, 'type': 'key_reused'}])


__all__ = ['IDEMPOTENCY_HEADER', 'IdempotencyKey', 'check_same', 'known_future', 'request_key']
