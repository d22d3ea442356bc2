"""What the Tinker routers share: how a request is read, accepted as a future and answered, and
the lookups every route makes (a tenant's models, sessions, checkpoints, the base model).

Every route is under ``/api/v1`` and reads its body once, as the SDK's own request type (strict:
an unknown field is a 422). A body that is not JSON, or is nested deeper than ``MAX_JSON_DEPTH``,
is a 400; a body that fails validation is a 422 whose ``detail`` is one sentence naming the first
bad fields and how many there are. Other errors are the exception tree's, answered by ``twinkle.server.api.errors``.

Compute requests are accepted at once as futures that ``retrieve_future`` long-polls. A training
client's requests start in ``seq_id`` order (:mod:`.sequencer`), and a retried ``(model_id,
seq_id)`` gets the request id it got the first time. A Tinker model is a run of the native API
(``model_id`` is its run id) and a Tinker key is a tenant's key.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
from collections.abc import Callable, Coroutine

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import JsonValue

from twinkle.errors import (
    BusyError,
    DataError,
    NotFoundError,
    QueueFullError,
    RequestTimeoutError,
    SessionExpiredError,
    TwinkleError,
    UnauthorizedError,
)
from twinkle.server.api.deps import key_holder
from twinkle.server.api.errors import ErrorBody, error_responses, problems_sentence
from twinkle.server.api.tinker.state import TinkerState
from twinkle.server.execution.groups.model_group import ModelGroup
from twinkle.server.execution.scheduling.scheduler import Batchable
from twinkle.server.execution.tinker.codec import ForwardBackwardCall
from twinkle.server.metering import Meter
from twinkle.server.service import Service
from twinkle.server.store import Checkpoint, Run, Session, Tenant, parse_checkpoint_path

PREFIX = '/api/v1'
#: A JSON object, as routes answer and futures store it.
JsonObject = dict[str, JsonValue]
PROTO = 'application/x-protobuf'
#: A future result that is protobuf bytes is stored as ``{PROTO_KEY: base64}``.
PROTO_KEY = 'protobuf_base64'
#: Request ids kept for answering retries of (model, seq_id); a retry comes within seconds.
REMEMBERED_REQUESTS = 100_000
#: Deepest nesting of lists and objects a body may have: the SDK's requests need 5 levels, and a
#: deeper body (user metadata nested hundreds deep) would fail later, when it is stored or sent back.
MAX_JSON_DEPTH = 32
#: How the Tinker routes may fail, for the OpenAPI schema (every body is an ``ErrorBody``).
ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    **error_responses(400, 401, 404, 410, 429),
    422: {'model': ErrorBody, 'description': 'The body is not the type the route takes; detail names each field'},
}


class TinkerRoute(APIRoute):
    """A Tinker route: the API key is checked before the body is read (a missing or unknown key
    is a 401, whatever the body); the JSON body is then parsed once and checked for depth before
    FastAPI validates it as the route's request type; a validation failure is a 422 in one sentence."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[object, None, Response]]:
        handler = super().get_route_handler()
        body_type = self.body_field.field_info.annotation if self.body_field is not None else None
        name = getattr(body_type, '__name__', 'the request')

        async def handle(request: Request) -> Response:
            body: JsonValue = None
            if body_type is not None:
                key_holder(request)  # every Tinker route with a body needs a key (its Who)
                body = await read_json(request, name)  # FastAPI reuses what Request.json() parsed
            try:
                return await handler(request)
            except RequestValidationError as error:
                skip_refused_turn(request, body)
                return invalid_request(name, error)
            except (BusyError, UnauthorizedError, RequestTimeoutError):
                raise  # the SDK sends these again with the same seq_id
            except TwinkleError:
                skip_refused_turn(request, body)
                raise

        return handle


def skip_refused_turn(request: Request, body: JsonValue) -> None:
    """A training request refused before it was accepted (a 400, 404 or 422 the SDK does not
    retry) still takes its ``seq_id``: the model's later requests go on instead of waiting for it
    until the gap times out and failing. Only for a model of the tenant's own."""
    if not isinstance(body, dict):
        return
    model_id, seq_id = body.get('model_id'), body.get('seq_id')
    if not isinstance(model_id, str) or not isinstance(seq_id, int) or isinstance(seq_id, bool):
        return
    api: TinkerAPI = request.app.state.tinker
    if api.service.store.runs.get(key_holder(request).id, model_id) is not None:
        api.state.sequencer.skip(model_id, seq_id)


def router(api: TinkerAPI, *groups: Callable[[APIRouter, TinkerAPI], None]) -> APIRouter:
    """A router of the Tinker API (its prefix, route class and error responses) with the routes
    each of ``groups`` adds."""
    routes = APIRouter(prefix=PREFIX, route_class=TinkerRoute, strict_content_type=False, responses=ERROR_RESPONSES)
    for add in groups:
        add(routes, api)
    return routes


async def read_json(request: Request, name: str) -> JsonValue:
    """The body as JSON; ``DataError`` (a 400) if it cannot be parsed or nests too deep."""
    try:
        data: JsonValue = await request.json()
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested deeper than the parser goes
        raise DataError(f'the body must be JSON for {name}') from None
    if _nesting_over(data, MAX_JSON_DEPTH):
        raise DataError(f'the body of {name} nests lists and objects deeper than {MAX_JSON_DEPTH} levels')
    return data


def invalid_request(name: str, error: RequestValidationError) -> JSONResponse:
    """A 422 whose ``detail`` names the first bad fields and how many more there are:
    ``invalid X: a.b: Field required; ... (and 12 more problems)``, small whatever was sent."""
    body = ErrorBody(detail=f'invalid {name}: {problems_sentence(error.errors())}', error=DataError.__name__)
    return JSONResponse(body.model_dump(), status_code=422)


def _nesting_over(value: JsonValue, limit: int) -> bool:
    """Whether lists and objects in ``value`` nest deeper than ``limit`` (level by level, no recursion)."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        level = [
            child
            for item in level
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


class TinkerAPI:
    """The Tinker routes' view of the service: accepting requests as futures, and the lookups."""

    def __init__(self, service: Service, state: TinkerState):
        self.service, self.state = service, state
        self.settings = state.settings

    # ---- requests -------------------------------------------------------------------------------
    async def accept(
        self,
        who: Tenant,
        group: ModelGroup,
        run_id: str | None,
        seq_id: int | None,
        operation: str,
        fn: Callable[[], object],
        batch: Batchable | None = None,
        meter: Meter | None = None,
    ) -> str:
        """Record a future for ``fn`` and start it on ``group``'s worker in its model's turn;
        the future's id. With ``batch`` it may share a pass with other tenants' requests; ``meter``
        is what it is charged (``Service.submit``)."""
        service, requests = self.service, self.state.requests
        key = (who.id, run_id or '', seq_id) if seq_id is not None else None
        if key is not None and key in requests:
            return requests[key]  # a retry of a request already accepted
        if meter is not None and meter.session_id is not None:
            self.live_session(who, meter.session_id)  # a 410 once its client was taken for gone
        if run_id is not None:
            await service.touch(run_id)  # an active run is not idle
        # No await from here to the queue: a request the checks let in finds the room they found.
        self.check_room(who, group)
        meter = meter or Meter()
        service.ledger.admit(who, meter)  # a 429 or 403 now
        session_id = meter.session_id
        record = service.store.futures.create(who.id, run_id, operation, session_id)  # no fsync: on the loop
        if key is not None:
            requests[key] = record.id
            if len(requests) > REMEMBERED_REQUESTS:
                requests.popitem(last=False)

        def start() -> None:
            with contextlib.suppress(QueueFullError):  # enqueue failed the future with the reason
                service.submit(who, group, run_id, operation, fn, batch, future_id=record.id, meter=meter)

        def fail(message: str) -> None:  # its turn never came: it never reaches submit
            service.ledger.settle(who, meter.tokens)
            service.store.futures.fail(record.id, message, 'user')

        if run_id is None:
            start()  # sampling: no model order to keep
        else:
            self.state.sequencer.add(run_id, seq_id, start, fail)
        return record.id

    def check_room(self, who: Tenant, group: ModelGroup) -> None:
        """``QueueFullError`` (a 429 the SDK retries) when the tenant's queue on ``group`` is full:
        per model, as the native API's queue limit."""
        limit = self.service.config.limits.max_queued_per_tenant
        if group.queued(who.id) >= limit:
            raise QueueFullError(who.name, limit, retry_after_s=2.0)

    def mixable(self, group: ModelGroup, run: Run, call: ForwardBackwardCall) -> Batchable | None:
        """How a ``forward_backward`` (or ``forward``) call can share a pass with other models':
        the group's batch, its outputs answered as the route answers one."""
        batch = group.tinker_mixable(run, call)
        if batch is None:
            return None
        run_many = batch.run_many

        def answered(payloads: list[tuple[Run, ForwardBackwardCall]]) -> list[dict[str, str] | Exception]:
            return [o if isinstance(o, Exception) else proto_result(o) for o in run_many(payloads)]

        return dataclasses.replace(batch, run_many=answered)

    # ---- lookups --------------------------------------------------------------------------------
    def run_of(self, who: Tenant, model_id: str) -> Run:
        run = self.service.store.runs.get(who.id, model_id)
        if run is None or run.status == 'deleted':
            raise NotFoundError(f'model {model_id!r} not found')
        return run

    def session_of(self, who: Tenant, session_id: str) -> Session:
        session = self.service.store.sessions.get(who.id, session_id)
        if session is None:
            raise NotFoundError(f'session {session_id!r} not found')
        return session

    def live_session(self, who: Tenant, session_id: str) -> Session:
        """The tenant's session, while its client is not taken for gone: 404 if there is none,
        ``SessionExpiredError`` (a 410) once it sent no heartbeat for ``session_timeout_s``."""
        session = self.session_of(who, session_id)
        if session.expired_at is not None:
            raise SessionExpiredError(
                f'session {session_id!r} expired: it sent no heartbeat for tinker.session_timeout_s='
                f'{self.settings.session_timeout_s} s, so its requests that had not started were dropped; '
                'a new ServiceClient opens a new session'
            )
        return session

    def model_group(self, name: str | None) -> ModelGroup:
        """The group of the hosted base model ``name`` names (its id, with or without ``ms://``
        or ``hf://``, or its local path); 404 otherwise. A Tinker request always names one."""
        if name is None:
            raise DataError(f'name a base_model; this server hosts {self.service.model_names()}')
        return self.service.group_named(name)

    def checkpoint(self, who: Tenant, path: str, kinds: tuple[str, ...]) -> Checkpoint:
        """The checkpoint a ``tinker://`` path names, if this tenant may read it; else 404 (a path
        no checkpoint can have too, saying what one looks like)."""
        try:
            run_id, kind, name = parse_checkpoint_path(path)
        except DataError as malformed:
            raise NotFoundError(f'checkpoint not found: {malformed}') from None
        found = self.service.store.checkpoints.readable(who.id, run_id, name, kind)
        if found is None or kind not in kinds:
            raise NotFoundError(f'checkpoint {path!r} not found')
        return found


def proto_result(output: bytes) -> dict[str, str]:
    """A protobuf result as a future stores it (JSON)."""
    return {PROTO_KEY: base64.b64encode(output).decode()}


__all__ = ['PREFIX', 'PROTO', 'PROTO_KEY', 'JsonObject', 'TinkerAPI', 'TinkerRoute', 'proto_result', 'router']
