"""The native API under ``/twinkle/v1``: runs, their operations, checkpoints and futures.

Every request body is a model of ``twinkle.wire``, validated once by FastAPI at its route (a 422
that names the field otherwise); the host then checks what needs the model (component names,
token ids in the vocabulary, lengths). Each operation of ``twinkle.wire.OPERATIONS`` is its own
route, ``POST /twinkle/v1/runs/{run_id}/ops/{name}``, with its own schema in ``/openapi.json``.
A compute request is answered at once with a future id (202); ``GET /twinkle/v1/futures/{id}``
returns its state, waiting up to ``wait`` seconds for it to finish without holding the event
loop. A compute request sent with ``?wait=`` is answered when its future settles or the wait ends,
with the future in the answer: a short request then costs one round trip, not two. A tenant sees
only its own runs, checkpoints and futures: anything else is a 404. Each body may be MessagePack
instead of JSON, and compute requests and future polls are answered in it when asked
(``twinkle.server.api.binary``).

A compute request sent with an ``Idempotency-Key`` header runs once per tenant and key: the same
request sent again with it (its gateway died while it waited, a load balancer or the client retried)
is answered the first one's future, waited for as its ``?wait=`` asks, and runs nothing. The key is
recorded with the future in one write (``store/futures.py``), so it holds across gateways and for as
long as the future is kept; sent with another operation, run or body it is a 422 that says so.
"""

from __future__ import annotations

import asyncio
import inspect
import shutil
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Annotated, cast

from fastapi import APIRouter, Query, Request, Response
from pydantic import JsonValue

from twinkle.data_format import SamplingParams
from twinkle.errors import ConfigurationError, DataError, NotFoundError, UnknownNameError
from twinkle.server.api.binary import BinaryRoute, answer
from twinkle.server.api.deps import QueueWait, Who, is_admin, tenant_of
from twinkle.server.api.errors import error_responses
from twinkle.server.api.idempotency import IdempotencyKey, check_same, known_future, request_key
from twinkle.server.api.links import signed_links, weight_files
from twinkle.server.execution.groups.model_group import SampleCall, bare, sampling_tokens
from twinkle.server.execution.groups.sampler_group import SYNC_NAME, saved_weights, version_of
from twinkle.server.execution.hosts.model_host import request_tokens
from twinkle.server.execution.scheduling.scheduler import Job, wait_job
from twinkle.server.metering import Meter, usage_report
from twinkle.server.service import Service
from twinkle.server.store import (
    HOUR_S,
    Checkpoint,
    FutureRecord,
    KnownRequest,
    RequestKey,
    Run,
    Tenant,
    check_checkpoint_name,
    check_name,
)
from twinkle.wire import (
    OPERATIONS,
    CheckpointList,
    CreateRun,
    Deleted,
    FileLinks,
    FutureAccepted,
    FutureInfo,
    LoadRequest,
    Operation,
    RunHistory,
    RunInfo,
    RunList,
    RunRestore,
    RunStep,
    SampleWeights,
    SaveRequest,
    ServerInfo,
    UsageReport,
    parse_checkpoint_path,
    parse_twinkle_path,
)

PREFIX = '/twinkle/v1'
#: The end of a usage window, unix seconds (None: the hour now included).
Until = Annotated[float | None, Query(ge=0, allow_inf_nan=False)]
#: Operations whose rows are charged as tokens trained (a forward pass over them, with or without a backward).
TRAINING_OPERATIONS = ('forward_backward', 'forward_only')
#: SQLite integers are 64-bit; a larger page size or offset must be a 422, not an overflow.
SQLITE_INT_LIMIT = 2**63
#: Longest ``wait`` of a future poll, in seconds.
MAX_WAIT_S = 60.0
#: Most steps one history request returns.
MAX_HISTORY = 1000
Page = Annotated[int, Query(ge=0, lt=SQLITE_INT_LIMIT)]
#: Seconds a compute request's answer may wait for its future to settle (at most ``MAX_WAIT_S``).
Wait = Annotated[float, Query(ge=0, allow_inf_nan=False)]
#: The status of a queued compute request's answer.
ACCEPTED = 202


def native_router(service: Service) -> APIRouter:
    """The routes of the native API over ``service``."""
    router = APIRouter(
        prefix=PREFIX, tags=['native'], responses=error_responses(400, 401, 404, 409, 422, 429), route_class=BinaryRoute
    )
    # Routes are matched in order, twice a request: the ones every step calls come first.
    _future_routes(router, service)
    for name, spec in OPERATIONS.items():
        router.add_api_route(
            f'/runs/{{run_id}}/ops/{name}',
            _operation_endpoint(service, name, spec),
            methods=['POST'],
            status_code=ACCEPTED,
            response_model=FutureAccepted,
            name=name,
            summary=f'Queue {name} on the run',
        )
    _unknown_operation_route(router, service)
    _run_routes(router, service)
    _checkpoint_routes(router, service)
    _sample_route(router, service)
    _usage_route(router, service)
    return router


# ---- runs -------------------------------------------------------------------------------------------
def _run_routes(router: APIRouter, service: Service) -> None:
    config = service.config

    @router.get('/server', response_model=ServerInfo)
    async def server_info(who: Who) -> dict[str, JsonValue]:
        return {
            'base_model': bare(config.base_model),
            'base_models': list(service.model_names()),
            'limits': config.limits.model_dump(),
            'tenant': who.name,
        }

    @router.post('/runs', status_code=201, response_model=RunInfo)
    async def create_run(body: CreateRun, who: Who) -> dict[str, JsonValue]:
        check_name('adapter name', body.adapter_name)
        group = service.group_named(body.base_model)
        service.ledger.admit_run(who)  # a 403 past the tenant's runs quota
        group.check_lora(body.lora)
        run = service.store.runs.create(who.id, group.name, body.adapter_name, body.model_dump())

        def add() -> None:
            group.add_run(run, body.lora, gradient_accumulation_steps=body.gradient_accumulation_steps, seed=body.seed)

        try:
            job = service.submit(who, group, run.id, 'create_run', add)
        except Exception:  # refused (a full queue): the run goes, and the tenant's runs quota with it
            service.store.runs.forget(who.id, run.id)
            raise
        await wait_job(job, None)
        if job.error is not None:
            service.store.runs.set_status(run.id, 'deleted')
            raise job.error
        return _run_json(service, _own_run(service, who.id, run.id))

    @router.delete('/runs/{run_id}', response_model=Deleted)
    async def delete_run(run_id: str, who: Who) -> Deleted:
        """Delete a run: its adapter and the state the server kept for it go, its checkpoints stay
        (each deleted on its own), and it no longer counts against the tenant's ``runs`` quota."""
        run = _own_run(service, who.id, run_id)
        if run.status == 'deleted':
            raise NotFoundError(f'training run {run_id!r} not found')
        group = service.group_of(run)

        def delete() -> None:  # on the group's worker, one job at a time: a second delete finds the first's
            if _own_run(service, who.id, run_id).status == 'deleted':
                raise NotFoundError(f'training run {run_id!r} not found')
            group.delete_run(run)

        job = service.submit(who, group, run_id, 'delete_run', delete)
        await wait_job(job, None)
        if job.error is not None:
            raise job.error
        return Deleted(deleted=True)

    @router.get('/runs', response_model=RunList)
    async def list_runs(who: Who, limit: Page = 100, offset: Page = 0) -> dict[str, JsonValue]:
        runs, total = service.store.runs.page(who.id, limit=limit, offset=offset)
        return {'runs': [_run_json(service, r) for r in runs], 'total': total}

    @router.get('/runs/{run_id}', response_model=RunInfo)
    async def get_run(run_id: str, who: Who) -> dict[str, JsonValue]:
        return _run_json(service, _own_run(service, who.id, run_id))

    @router.get('/runs/{run_id}/history', response_model=RunHistory)
    async def run_history(
        run_id: str, who: Who, after: Page = 0, limit: Annotated[int, Query(ge=1, le=MAX_HISTORY)] = MAX_HISTORY
    ) -> RunHistory:
        """The run's figures at each optimizer step (of either API), after step ``after``."""
        _own_run(service, who.id, run_id)
        steps = await asyncio.to_thread(service.store.history.steps, run_id, after, limit)
        restores = [RunRestore.model_validate(restore) for restore in service.store.history.restores(run_id)]
        return RunHistory(run_id=run_id, steps=[RunStep.model_validate(step) for step in steps], restores=restores)


# ---- operations ---------------------------------------------------------------------------------------
def _operation_endpoint(
    service: Service, name: str, spec: type[Operation]
) -> Callable[[str, Operation, Tenant, Request, float, float, str | None], Awaitable[FutureAccepted | Response]]:
    """The endpoint of operation ``name``, its body typed as ``spec`` for FastAPI and the schema."""

    async def operation(
        run_id: str,
        body: Operation,
        who: Who,
        request: Request,
        wait: Wait = 0.0,
        queue: QueueWait = 0.0,
        key: IdempotencyKey = None,
    ) -> FutureAccepted | Response:
        once = request_key(key, name, run_id, body)
        if (known := await _known(service, who, once, wait, request)) is not None:
            return known
        run = await service.adapter_of(who, run_id)
        group = service.group_of(run)
        kwargs = body.arguments()
        # names, token ids, sizes, images: a 4xx now, not a failed future (off the event loop: images take seconds)
        await asyncio.to_thread(group.validate, name, kwargs)
        if name == 'calculate_loss' and group.config.ranks > 1:
            raise ConfigurationError(
                'calculate_loss is not taken by a model on several ranks (each rank holds a share of the rows of '
                'a forward_only); use the loss forward_backward returns, or a server of one rank per model'
            )

        if name == 'sample' and group.sampler is not None:  # on the sampler group, the run's last sync
            sampler = group.sampler
            if not kwargs.get('base_model', False):
                sampler.weights_of(run)  # a 409 now if the run has none yet
            meter = Meter()

            def sampled(responses: list[dict[str, JsonValue]]) -> JsonValue:
                meter.sampled_json(responses)
                return cast(JsonValue, responses)

            params = cast('dict[str, JsonValue] | None', kwargs.get('sampling_params'))
            tokens = sampling_tokens(
                cast('list[dict[str, JsonValue]]', kwargs['inputs']), SamplingParams.from_dict(params)
            )
            sample, batch = group.sampling_job(partial(sampler.sample_call, run, kwargs), sampled, tokens)
            queued = service.queue(who, group, run_id, name, sample, batch, meter=meter, wait_s=queue, request_key=once)
            return await _accepted(service, who, queued, wait, request, once)

        meter = Meter(training_tokens=request_tokens(kwargs['inputs']) if name in TRAINING_OPERATIONS else 0)

        def compute() -> JsonValue:
            result: JsonValue = group.run(run, name, kwargs)
            if name == 'sample':
                meter.sampled_json(cast(list[dict[str, JsonValue]], result))
            if spec.setup:
                service.remember_setup(run_id, name, kwargs)
            return result

        batch = group.mixable(run, name, kwargs)
        queued = service.queue(who, group, run_id, name, compute, batch, meter=meter, wait_s=queue, request_key=once)
        return await _accepted(service, who, queued, wait, request, once)

    signature = inspect.signature(operation)
    body = signature.parameters['body'].replace(annotation=spec)
    # FastAPI reads the body's model from the signature; functions have no declared __signature__
    operation.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[body if p.name == 'body' else p for p in signature.parameters.values()]
    )
    operation.__name__ = name
    return operation


def _unknown_operation_route(router: APIRouter, service: Service) -> None:
    @router.post('/runs/{run_id}/ops/{operation}', include_in_schema=False)
    async def unknown_operation(run_id: str, operation: str, who: Who) -> None:
        await service.adapter_of(who, run_id)  # another tenant's run is a 404 whatever the operation
        raise UnknownNameError('operation', operation, OPERATIONS)


# ---- checkpoints ----------------------------------------------------------------------------------
def _checkpoint_routes(router: APIRouter, service: Service) -> None:
    store = service.store

    @router.post('/runs/{run_id}/save', status_code=ACCEPTED, response_model=FutureAccepted)
    async def save(
        run_id: str,
        body: SaveRequest,
        who: Who,
        request: Request,
        wait: Wait = 0.0,
        queue: QueueWait = 0.0,
        key: IdempotencyKey = None,
    ) -> FutureAccepted | Response:
        once = request_key(key, 'save', run_id, body)
        if (known := await _known(service, who, once, wait, request)) is not None:
            return known
        run = await service.adapter_of(who, run_id)
        check_checkpoint_name(body.name)
        group = service.group_of(run)

        def write() -> JsonValue:
            def answer(checkpoint: Checkpoint) -> str:
                return checkpoint.twinkle_path

            return group.save_checkpoint(run, 'training', body.name, answer, save_optimizer=body.save_optimizer)

        saved = Meter(checkpoints=1)
        queued = service.queue(who, group, run_id, 'save', write, meter=saved, wait_s=queue, request_key=once)
        return await _accepted(service, who, queued, wait, request, once)

    @router.post('/runs/{run_id}/load', status_code=ACCEPTED, response_model=FutureAccepted)
    async def load(
        run_id: str,
        body: LoadRequest,
        who: Who,
        request: Request,
        wait: Wait = 0.0,
        queue: QueueWait = 0.0,
        key: IdempotencyKey = None,
    ) -> FutureAccepted | Response:
        once = request_key(key, 'load', run_id, body)
        if (known := await _known(service, who, once, wait, request)) is not None:
            return known
        run = await service.adapter_of(who, run_id)
        source_run, name = parse_twinkle_path(body.path)
        checkpoint = _own_checkpoint(service, who, source_run, name, body.path)
        group = service.group_of(run)
        service.check_trained_on(checkpoint, group, body.path)

        def read() -> str:
            now = _own_checkpoint(service, who, source_run, name, body.path)  # a save may have replaced it since
            group.load(run, Path(now.path), body.load_optimizer, body.path)
            return now.twinkle_path

        queued = service.queue(who, group, run_id, 'load', read, wait_s=queue, request_key=once)
        return await _accepted(service, who, queued, wait, request, once)

    @router.post('/runs/{run_id}/sync_sampler', status_code=ACCEPTED, response_model=FutureAccepted)
    async def sync_sampler(
        run_id: str, who: Who, request: Request, wait: Wait = 0.0, queue: QueueWait = 0.0, key: IdempotencyKey = None
    ) -> FutureAccepted | Response:
        """Save the run's adapter weights for sampling (no optimizer): what its samples come from
        on a server with a sampler group. The future's result: ``{path, weight_version}``."""
        once = request_key(key, 'sync_sampler', run_id, None)
        if (known := await _known(service, who, once, wait, request)) is not None:
            return known
        run = await service.adapter_of(who, run_id)
        group = service.group_of(run)

        def write() -> JsonValue:
            def answer(checkpoint: Checkpoint) -> dict[str, JsonValue]:
                return {'path': checkpoint.twinkle_path, 'weight_version': version_of(Path(checkpoint.path))}

            return group.save_checkpoint(run, 'sampler', SYNC_NAME, answer, save_optimizer=False)

        saved = Meter(checkpoints=1)
        queued = service.queue(who, group, run_id, 'sync_sampler', write, meter=saved, wait_s=queue, request_key=once)
        return await _accepted(service, who, queued, wait, request, once)

    @router.get('/runs/{run_id}/checkpoints', response_model=CheckpointList)
    async def list_checkpoints(run_id: str, who: Who) -> dict[str, JsonValue]:
        _own_run(service, who.id, run_id)
        return {'checkpoints': [_checkpoint_json(c) for c in store.checkpoints.of_run(who.id, run_id)]}

    @router.post('/runs/{run_id}/checkpoints/{name}/links', response_model=FileLinks)
    async def checkpoint_links(run_id: str, name: str, who: Who, request: Request) -> FileLinks:
        """Links to the checkpoint's weight files (not its optimizer state) that work without a key
        for an hour: what ``download_checkpoint``, ``export`` and ``upload_to_hub`` fetch."""
        checkpoint = store.checkpoints.get(who.id, run_id, name)  # a name no save took: not found
        if checkpoint is None:
            raise NotFoundError(f'checkpoint {name!r} of run {run_id!r} not found')
        urls, expires = signed_links(service, checkpoint, request, weight_files(checkpoint))
        return FileLinks(urls={file: str(url) for file, url in urls.items()}, expires=expires)

    @router.delete('/runs/{run_id}/checkpoints/{name}', response_model=Deleted)
    async def delete_checkpoint(run_id: str, name: str, who: Who) -> Deleted:
        checkpoint = store.checkpoints.get(who.id, run_id, name)
        if checkpoint is None:
            raise NotFoundError(f'checkpoint {name!r} of run {run_id!r} not found')
        store.checkpoints.delete(who.id, run_id, name)
        shutil.rmtree(checkpoint.path, ignore_errors=True)
        return Deleted(deleted=True)


# ---- usage ------------------------------------------------------------------------------------------
def _usage_route(router: APIRouter, service: Service) -> None:
    @router.get('/usage', response_model=UsageReport)
    async def usage(
        request: Request, since: Annotated[float, Query(ge=0, allow_inf_nan=False)] = 0.0, until: Until = None
    ) -> JsonValue:
        """What was used in the UTC hours that start in ``[since, until)`` (unix seconds; ``until``
        by default the hour now), per run and in total, with the checkpoints stored now and the
        costs by the server's prices. A tenant's key sees its own; the admin key every tenant's."""
        tenant_id = None if is_admin(service, request) else (await tenant_of(request)).id  # a tenant's rate counts
        end = until if until is not None else time.time() + HOUR_S
        return await asyncio.to_thread(usage_report, service.store, service.config.pricing, tenant_id, since, end)


# ---- sampling without a run -----------------------------------------------------------------------
def _sample_route(router: APIRouter, service: Service) -> None:
    @router.post('/sample', status_code=ACCEPTED, response_model=FutureAccepted)
    async def sample(
        body: SampleWeights,
        who: Who,
        request: Request,
        wait: Wait = 0.0,
        queue: QueueWait = 0.0,
        key: IdempotencyKey = None,
    ) -> FutureAccepted | Response:
        """Sample the base model, or a saved checkpoint's weights, without a training run."""
        once = request_key(key, 'sample', None, body)
        if (known := await _known(service, who, once, wait, request)) is not None:
            return known
        group, path = service.group_named(body.base_model), body.model_path
        checkpoint: Checkpoint | None = None  # None: the base model
        if path is not None:
            try:
                source_path = parse_checkpoint_path(path)
            except DataError as malformed:  # a path no checkpoint can have, saying what one looks like
                raise NotFoundError(f'checkpoint not found: {malformed}') from None
            checkpoint = _sampling_source(service, who, source_path, path)
            source = service.store.runs.by_id(checkpoint.run_id)
            if body.base_model is None and source is not None:
                group = service.hosting(source.base_model, f'checkpoint {path!r}')
            service.check_trained_on(checkpoint, group, path)
        inputs = [prompt.model_dump(exclude_none=True) for prompt in body.inputs]
        # a 4xx now, not a failed future (off the event loop: images take seconds to decode)
        await asyncio.to_thread(group.check_sample_request, inputs, body.sampling_params)

        meter = Meter()

        def call() -> SampleCall:
            folder = service.folder_now(who, checkpoint, path) if checkpoint is not None and path else None
            return 'sample_weights', (inputs, body.sampling_params, saved_weights(folder, path))

        def sampled(responses: list[dict[str, JsonValue]]) -> object:
            meter.sampled_json(responses)
            return responses

        tokens = sampling_tokens(inputs, SamplingParams.from_dict(body.sampling_params))
        run, batch = group.sampling_job(call, sampled, tokens)
        queued = service.queue(who, group, None, 'sample', run, batch, meter=meter, wait_s=queue, request_key=once)
        return await _accepted(service, who, queued, wait, request, once)


# ---- futures --------------------------------------------------------------------------------------
async def _accepted(
    service: Service, who: Tenant, queued: Awaitable[Job], wait: float, request: Request, once: RequestKey | None
) -> FutureAccepted | Response:
    """The answer to a compute request once ``queued``: its future's id, and with ``wait`` > 0 the future
    itself as it stands once it settled or ``wait`` seconds (at most ``MAX_WAIT_S``) passed; in MessagePack
    if the request accepts it. Its key sent at the same moment through another gateway: that one's future."""
    try:
        job = await queued
    except KnownRequest as known:
        if once is None:
            raise
        check_same(once, known.record)
        return await _replay(service, who, known.record, wait, request)
    if wait <= 0:
        return answer(request, FutureAccepted(future_id=job.id), ACCEPTED)
    record = await _waited(service, who, job, wait)
    future = None if record is None else _future_info(record)
    return answer(request, FutureAccepted(future_id=job.id, future=future), ACCEPTED)


async def _known(
    service: Service, who: Tenant, once: RequestKey | None, wait: float, request: Request
) -> FutureAccepted | Response | None:
    """The answer to a request whose key the tenant sent before (``_replay``); None for a new request."""
    record = known_future(service, who, once)
    return None if record is None else await _replay(service, who, record, wait, request)


async def _replay(
    service: Service, who: Tenant, record: FutureRecord, wait: float, request: Request
) -> FutureAccepted | Response:
    """The first request's answer to the same request sent again with its key: its future, waited for as
    ``wait`` asks; nothing runs again."""
    job = service.job(record.id)
    if wait > 0 and job is not None and not record.finished:
        record = await _waited(service, who, job, wait) or record
    future = _future_info(record) if wait > 0 else None
    return answer(request, FutureAccepted(future_id=record.id, future=future), ACCEPTED)


async def _waited(service: Service, who: Tenant, job: Job, wait: float) -> FutureRecord | None:
    """The tenant's future of ``job`` once the job settled or ``wait`` seconds (at most ``MAX_WAIT_S``) passed."""
    await wait_job(job, min(wait, MAX_WAIT_S))
    return service.store.futures.get(who.id, job.id)


def _future_routes(router: APIRouter, service: Service) -> None:
    @router.get('/futures/{future_id}', response_model=FutureInfo)
    async def get_future(future_id: str, who: Who, request: Request, wait: Wait = 0.0) -> FutureInfo | Response:
        record = service.store.futures.get(who.id, future_id)
        if record is None:
            raise NotFoundError(f'request {future_id!r} not found')
        if not record.finished and wait > 0:  # a finished future never changes: nothing to wait for or read again
            job = service.job(future_id)
            if job is not None:
                record = await _waited(service, who, job, wait) or record
        return answer(request, _future_info(record))


def _future_info(record: FutureRecord) -> FutureInfo:
    """The store's future as the wire's, its fields taken as they are: the store wrote them, and a
    result of thousands of logprobs costs milliseconds to dump and validate again."""
    return FutureInfo.model_construct(**dict(record))


def _own_run(service: Service, tenant_id: str, run_id: str) -> Run:
    run = service.store.runs.get(tenant_id, run_id)
    if run is None:
        raise NotFoundError(f'training run {run_id!r} not found')
    return run


def _own_checkpoint(service: Service, who: Tenant, run_id: str, name: str, shown_as: str) -> Checkpoint:
    checkpoint = service.store.checkpoints.get(who.id, run_id, name)
    if checkpoint is None:
        raise NotFoundError(f'checkpoint {shown_as!r} not found')
    return checkpoint


def _sampling_source(service: Service, who: Tenant, source: tuple[str, str, str], shown_as: str) -> Checkpoint:
    """The checkpoint ``(run id, kind, name)`` if the tenant may sample it (its own, or a published
    one); exports are for download."""
    run_id, kind, name = source
    checkpoint = service.store.checkpoints.readable(who.id, run_id, name, kind)
    if checkpoint is None or kind == 'external':
        raise NotFoundError(f'checkpoint {shown_as!r} not found')
    return checkpoint


def _run_json(service: Service, run: Run) -> dict[str, JsonValue]:
    """A run as ``RunInfo``: its record, and the last time it came back with less than it had."""
    restored = service.store.history.last_restore(run.id)
    return {**run.model_dump(), 'training_run_id': run.id, 'restored_from': cast(JsonValue, restored)}


def _checkpoint_json(checkpoint: Checkpoint) -> dict[str, JsonValue]:
    data = checkpoint.model_dump()
    data.pop('path', None)  # server paths stay on the server
    return {**data, 'twinkle_path': checkpoint.twinkle_path}


__all__ = ['PREFIX', 'native_router']
