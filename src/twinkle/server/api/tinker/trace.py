"""A Tinker session's requests as a Perfetto trace: what ``tinker session export-trace`` downloads.

``GET /api/v1/sessions/{id}/trace_export`` answers ``ready`` at once with a signed link (``links``);
the link's route builds the trace from the session's futures as it is fetched, so it shows every
request up to then. Each training run has a track, and sampling one: a request is a slice from its
arrival to its answer, named by its operation, with a ``running`` slice inside from when a worker took
it; requests that waited at the same time take lanes of their own. Open it in https://ui.perfetto.dev.
The trace is written with Perfetto's own builder and messages (the ``perfetto`` package).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent
from perfetto.trace_builder.proto_builder import TraceProtoBuilder

from twinkle.errors import NotFoundError
from twinkle.server.api import links
from twinkle.server.api.deps import Who
from twinkle.server.api.tinker.base import JsonObject, TinkerAPI, router
from twinkle.server.service import Service
from twinkle.server.store import FutureRecord, Session

#: The one sequence of the trace's events (Perfetto keys its interning and ordering by it).
SEQUENCE = 1
#: Where a trace's signed link points, under ``/api/v1``.
TRACE_ROUTE = '/session_traces'
NS = 1_000_000_000


def trace_router(api: TinkerAPI) -> APIRouter:
    """The export the SDK polls, and the route of the link it answers with."""
    service, routes = api.service, router(api)

    @routes.get('/sessions/{session_id}/trace_export')
    async def trace_export(session_id: str, who: Who, request: Request) -> JsonObject:
        if await asyncio.to_thread(service.store.sessions.get, who.id, session_id) is None:
            raise NotFoundError(f'session {session_id!r} not found')
        return {'status': 'ready', 'url': links.signed_link(service, request, TRACE_ROUTE, session_id)}

    @routes.get(TRACE_ROUTE + '/{session_id}', response_model=None)
    async def trace_file(session_id: str, expires: int, signature: str) -> Response:
        links.check_signature(service, TRACE_ROUTE, session_id, expires, signature, 'ask for a new one (trace_export)')
        data = await asyncio.to_thread(_trace_of, service, session_id)
        headers = {'Content-Disposition': f'attachment; filename="{session_id}.pftrace"'}
        return Response(data, media_type='application/octet-stream', headers=headers)

    return routes


def _trace_of(service: Service, session_id: str) -> bytes:
    session = service.store.sessions.by_id(session_id)
    if session is None:
        raise NotFoundError(f'session {session_id!r} no longer exists')
    return session_trace(session, service.store.futures.of_session(session_id), time.time())


def session_trace(session: Session, futures: list[FutureRecord], now: float) -> bytes:
    """The session's requests as a Perfetto trace (``Trace`` protobuf bytes); a request not
    answered yet ends at ``now``."""
    builder = TraceProtoBuilder()
    uuids = itertools.count(1)
    root = next(uuids)
    _track(builder, root, f'session {session.id}', None)
    tracks: dict[tuple[str, int], int] = {}
    events: list[tuple[float, int, int, FutureRecord | None]] = []  # (time, order, track, begun request)
    for (group, lane), requests in _lanes(futures, now):
        if (group, lane) not in tracks:
            tracks[group, lane] = next(uuids)
            name = group if lane == 0 else f'{group} ({lane + 1})'
            _track(builder, tracks[group, lane], name, root)
        track = tracks[group, lane]
        for future in requests:
            end = _end(future, now)
            events.append((future.created_at, 2, track, future))  # ordered: ends, then begins, at one time
            if future.started_at is not None:
                events.append((future.started_at, 3, track, None))
                events.append((end, 0, track, None))
            events.append((end, 1, track, None))
    for at, order, track, begun in sorted(events, key=lambda event: (event[0], event[1])):
        packet = builder.add_packet()
        packet.timestamp = int(at * NS)
        packet.trusted_packet_sequence_id = SEQUENCE
        event = packet.track_event
        event.track_uuid = track
        if order < 2:
            event.type = TrackEvent.TYPE_SLICE_END
            continue
        event.type = TrackEvent.TYPE_SLICE_BEGIN
        event.name = begun.op if begun is not None else 'running'
        if begun is not None:
            for name, value in (('request_id', begun.id), ('status', begun.status), ('error', begun.error)):
                if value is not None:
                    annotation = event.debug_annotations.add()
                    annotation.name, annotation.string_value = name, value
    data: bytes = builder.serialize()
    return data


def _track(builder: TraceProtoBuilder, uuid: int, name: str, parent: int | None) -> None:
    descriptor = builder.add_packet().track_descriptor
    descriptor.uuid, descriptor.name = uuid, name
    if parent is not None:
        descriptor.parent_uuid = parent


def _end(future: FutureRecord, now: float) -> float:
    return future.finished_at if future.finished_at is not None else max(now, future.started_at or future.created_at)


def _lanes(futures: list[FutureRecord], now: float) -> Iterator[tuple[tuple[str, int], list[FutureRecord]]]:
    """The requests of each run (and of sampling) in lanes where none overlaps the one before:
    a slice of a track must end before the next begins."""
    groups: dict[str, list[list[FutureRecord]]] = {}
    for future in sorted(futures, key=lambda f: f.created_at):
        lanes = groups.setdefault(future.run_id or 'sampling', [])
        free = next((lane for lane in lanes if _end(lane[-1], now) <= future.created_at), None)
        if free is None:
            lanes.append(free := [])
        free.append(future)
    for group, lanes in groups.items():
        for index, lane in enumerate(lanes):
            yield (group, index), lane


__all__ = ['TRACE_ROUTE', 'session_trace', 'trace_router']
