"""The Tinker routes every client calls, training or sampling: the client's configuration, its
session and heartbeat, and ``retrieve_future``, which long-polls every request's result.

A session whose heartbeats stop for ``tinker.session_timeout_s`` expires (``expire_sessions``,
a chore of the app): its client is taken for gone, as Tinker's sessions expire. Its requests
that have not started are dropped, each future failed with a ``SessionExpiredError`` (those
waiting on a worker, and those waiting for their ``seq_id`` turn), so a killed client's queue does
not run on for minutes and fill its tenant's; a request already running finishes. Its later
requests, heartbeats included, are a 410.
"""

from __future__ import annotations

import asyncio
import base64
import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import JsonValue
from tinker import types

from twinkle.errors import NotFoundError, SessionExpiredError
from twinkle.server.api.deps import Who
from twinkle.server.api.errors import ErrorBody
from twinkle.server.api.tinker.base import PROTO, PROTO_KEY, JsonObject, TinkerAPI, router
from twinkle.server.execution.groups.model_group import bare
from twinkle.server.execution.scheduling.scheduler import wait_job
from twinkle.utils.logger import get_logger

logger = get_logger()

#: A heartbeat for a finished session: the SDK stops its heartbeat loop on a 410.
GONE: dict[int | str, dict[str, object]] = {
    410: {'model': ErrorBody, 'description': 'The session is finished; stop sending heartbeats'}
}
#: ``retrieve_future`` answers JSON, or protobuf bytes for forward, forward_backward and sample.
FUTURE_RESULTS: dict[int | str, dict[str, object]] = {
    200: {'content': {'application/json': {}, PROTO: {'schema': {'type': 'string', 'format': 'binary'}}}}
}


def session_router(api: TinkerAPI) -> APIRouter:
    """Configuration, sessions and futures of the Tinker API."""
    return router(api, _client_routes, _session_routes, _future_routes)


def _client_routes(routes: APIRouter, api: TinkerAPI) -> None:
    @routes.post('/client/config')
    async def client_config(who: Who) -> JsonObject:
        return {
            'pjwt_auth_enabled': False,
            'use_pyqwest_transport': False,
            'parallel_fwdbwd_chunks': True,
            'proto_compress_fwdbwd': False,
            'fwdbwd_max_chunk_len': api.settings.fwdbwd_max_chunk_len,
        }

    @routes.get('/healthz')
    async def healthz() -> dict[str, str]:
        return {'status': 'ok'}

    @routes.get('/get_server_capabilities')
    async def capabilities(who: Who) -> JsonObject:
        models: list[JsonValue] = [
            {'model_name': bare(g.name), 'trainable': True, 'sampleable': True, 'max_context_length': g.context}
            for g in api.service.groups.values()
        ]
        return {'supported_models': models}

    @routes.post('/telemetry')
    async def telemetry(who: Who) -> dict[str, str]:
        return {'status': 'accepted'}  # the server keeps its own metrics (/metrics)


def _session_routes(routes: APIRouter, api: TinkerAPI) -> None:
    store = api.service.store

    @routes.post('/create_session')
    async def create_session(body: types.CreateSessionRequest, who: Who) -> JsonObject:
        info = body.model_dump(mode='json', exclude={'type'})
        session = await asyncio.to_thread(store.sessions.create, who.id, info)
        return {'type': 'create_session', 'session_id': session.id}

    @routes.post('/session_heartbeat', responses=GONE, response_model=None)
    async def heartbeat(body: types.SessionHeartbeatRequest, who: Who) -> JsonObject | JSONResponse:
        session = api.live_session(who, body.session_id)  # an expired one's is a 410 too: the loop stops
        if session.status != 'active':
            gone = ErrorBody(detail=f'session {body.session_id!r} is finished', error='StateError')
            return JSONResponse(gone.model_dump(), status_code=410)
        await asyncio.to_thread(store.sessions.heartbeat, session.id)
        return {'type': 'session_heartbeat'}

    @routes.post('/sessions/{session_id}/finish')
    async def finish(session_id: str, who: Who) -> JsonObject:
        api.session_of(who, session_id)
        await asyncio.to_thread(store.sessions.finish, session_id)
        return {'session_id': session_id, 'status': 'finished'}


def _future_routes(routes: APIRouter, api: TinkerAPI) -> None:
    service = api.service

    @routes.post('/retrieve_future', responses=FUTURE_RESULTS, response_model=None)
    async def retrieve_future(body: types.FutureRetrieveRequest, who: Who) -> JsonValue | Response:
        """The request's result once it is done; ``try_again`` after ``retrieve_wait_s`` if not;
        ``{error, category}`` if it failed."""
        record = service.store.futures.get(who.id, body.request_id)
        if record is None:
            raise NotFoundError(f'request {body.request_id!r} not found')
        deadline = time.monotonic() + api.settings.retrieve_wait_s
        while not record.finished and time.monotonic() < deadline:
            job = service.job(record.id)
            if job is not None:
                await wait_job(job, max(0.0, deadline - time.monotonic()))
            else:
                await asyncio.sleep(0.05)  # waiting for its turn in the model's seq_id order
            record = service.store.futures.get(who.id, body.request_id) or record
        if not record.finished:
            return {'type': 'try_again', 'request_id': record.id, 'queue_state': 'active'}
        if record.status == 'failed':
            return {'error': record.error, 'category': record.category}
        if isinstance(record.result, dict) and PROTO_KEY in record.result:
            return Response(base64.b64decode(record.result[PROTO_KEY]), media_type=PROTO)
        result: JsonValue = record.result
        return result


async def expire_sessions_periodically(api: TinkerAPI) -> None:
    """``expire_sessions`` four times per ``session_timeout_s`` (at least every 5 s); never if
    sessions never expire."""
    timeout = api.settings.session_timeout_s
    if timeout is None:
        return
    started_at = api.service.store.db.clock()
    while True:
        await asyncio.sleep(min(timeout / 4, 5.0))
        try:
            await asyncio.to_thread(expire_sessions, api, started_at)
        except Exception:  # a failed sweep must not end the expiry
            logger.exception('expiring Tinker sessions failed; trying again at the next sweep')


def expire_sessions(api: TinkerAPI, started_at: float) -> int:
    """Mark the sessions with no heartbeat for ``session_timeout_s`` expired (none before the server
    ran that long since ``started_at``: the clients of the last process beat again once it is back)
    and drop the requests of every expired session that have not started: those on this server's
    workers (a session another process marked, on a shared store, too), and those waiting for their
    ``seq_id`` turn; how many were dropped."""
    timeout = api.settings.session_timeout_s
    if timeout is None:
        return 0
    service, store = api.service, api.service.store
    cutoff = store.db.clock() - timeout
    expired = store.sessions.expire(cutoff) if cutoff > started_at else []
    reason = (
        f'its Tinker session sent no heartbeat for {timeout:g} s (tinker.session_timeout_s), so the server '
        'took its client for gone and dropped the request before it started'
    )
    waiting = 0
    for session in expired:
        logger.warning(f'session {session.id!r} sent no heartbeat for {timeout:g} s: expired, its queue dropped')
        for run_id in store.sessions.runs(session.tenant_id, session.id):
            waiting += api.state.sequencer.drop(run_id, f'{SessionExpiredError.__name__}: {reason}')
    service.expired_requests.inc(waiting)
    return waiting + service.drop_sessions(store.sessions.expired(service.waiting_sessions()), reason)


__all__ = ['expire_sessions', 'expire_sessions_periodically', 'session_router']
