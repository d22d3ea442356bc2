"""The HTTP API: FastAPI routes over the store (SQLite), the scheduler (one worker thread) and
the model host.

Every compute request is answered at once with a future id (202); ``GET /twinkle/v1/futures/{id}``
returns its state, waiting up to ``wait`` seconds for it to finish without holding the event
loop. A tenant sees only its own runs, checkpoints and futures: anything else is a 404, as if it
did not exist.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Query
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from twinkle.errors import ConfigurationError, NotFoundError
from twinkle.server.config import ServerConfig
from twinkle.server.deps import Who
from twinkle.server.errors import install_error_handlers
from twinkle.server.host import ModelHost
from twinkle.server.http_limits import HttpLimits
from twinkle.server.openai_api import openai_router
from twinkle.server.remote_host import RemoteHost
from twinkle.server.scheduler import wait_job
from twinkle.server.state import Service
from twinkle.server.store import check_checkpoint_name, check_name, parse_twinkle_path
from twinkle.server.tinker.rest import expire_checkpoints_periodically, rest_router
from twinkle.server.tinker.sampling import sampling_router
from twinkle.server.tinker.session import session_router
from twinkle.server.tinker.training import training_router
from twinkle.utils.logger import get_logger

logger = get_logger()
PREFIX = '/twinkle/v1'
#: Configuration operations: recorded per run and replayed when a released adapter comes back.
SETUP_OPERATIONS = ('set_optimizer', 'set_lr_scheduler', 'set_loss', 'set_template', 'set_processor', 'add_metric')
#: SQLite integers are 64-bit; a larger page size or offset must be a 422, not an overflow.
SQLITE_INT_LIMIT = 2**63


class CreateRun(BaseModel):
    model_config = ConfigDict(extra='forbid')

    adapter_name: str = 'default'
    lora: dict[str, Any] = Field(default_factory=dict)
    gradient_accumulation_steps: int = Field(1, gt=0)
    base_model: str | None = None
    #: Draw the adapter's initial weights from this seed (reproducible runs); torch takes 64 bits.
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)


class SaveRequest(BaseModel):
    model_config = ConfigDict(extra='forbid')

    name: str
    save_optimizer: bool = False


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra='forbid')

    path: str
    load_optimizer: bool = False


def create_app(config: ServerConfig, host: ModelHost | RemoteHost | None = None) -> FastAPI:
    """The FastAPI application; ``uvicorn.run(create_app(config))`` serves it."""
    service = Service(config, host)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.scheduler.start()
        chores = [
            asyncio.create_task(_release_periodically(service)),
            asyncio.create_task(_expire_gaps(service)),
            asyncio.create_task(expire_checkpoints_periodically(service)),
        ]
        yield
        for chore in chores:
            chore.cancel()
        service.release_all()  # a graceful stop keeps every adapter's state; a restart brings them back
        for job in service.scheduler.stop(wait=True):
            service.store.fail_future(job.id, 'the server stopped before this request ran', 'server')
        service.store.close()
        if hasattr(service.host, 'shutdown'):
            service.host.shutdown()  # a model worker in a Ray actor goes with its server

    app = FastAPI(title='twinkle training service', version='1', lifespan=lifespan)
    app.state.service = service
    install_error_handlers(app)
    app.add_middleware(HttpLimits, limits=config.limits, tenant_for_key=service.store.tenant_for_key)
    app.include_router(session_router(service))
    app.include_router(training_router(service))
    app.include_router(sampling_router(service))
    app.include_router(openai_router(service))
    app.include_router(rest_router(service))

    @app.get('/healthz')
    async def healthz() -> dict[str, str]:
        return {'status': 'ok'}

    @app.get('/metrics')
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(f'{PREFIX}/server')
    async def server_info(who: Who) -> dict[str, Any]:
        return {'base_model': config.base_model, 'limits': config.limits.model_dump(), 'tenant': who.name}

    @app.post(f'{PREFIX}/runs', status_code=201)
    async def create_run(body: CreateRun, who: Who) -> dict[str, Any]:
        check_name('adapter name', body.adapter_name)
        service.host.check_adapter(body.lora)
        if body.base_model is not None and body.base_model != config.base_model:
            raise ConfigurationError(f'this server hosts {config.base_model!r}; got base_model {body.base_model!r}')
        run = service.store.create_run(who.id, config.base_model, body.adapter_name, body.model_dump())
        adapter = service.adapter_name(run)

        def add() -> None:
            service.host.add_adapter(adapter, body.lora, body.gradient_accumulation_steps, body.seed)
            service.adapters[run.id] = adapter

        job = await service.submit_async(who, run.id, 'create_run', add)
        await wait_job(job, None)
        if job.error is not None:
            service.store.set_run_status(run.id, 'deleted')
            raise job.error
        return _run_json(service.store.get_run(who.id, run.id))

    @app.get(f'{PREFIX}/runs')
    async def list_runs(
        who: Who,
        limit: Annotated[int, Query(ge=0, lt=SQLITE_INT_LIMIT)] = 100,
        offset: Annotated[int, Query(ge=0, lt=SQLITE_INT_LIMIT)] = 0,
    ) -> dict[str, Any]:
        runs, total = service.store.list_runs(who.id, limit=limit, offset=offset)
        return {'runs': [_run_json(r) for r in runs], 'total': total}

    @app.get(f'{PREFIX}/runs/{{run_id}}')
    async def get_run(run_id: str, who: Who) -> dict[str, Any]:
        run = service.store.get_run(who.id, run_id)
        if run is None:
            raise NotFoundError(f'training run {run_id!r} not found')
        return _run_json(run)

    @app.post(f'{PREFIX}/runs/{{run_id}}/ops/{{operation}}', status_code=202)
    async def operation(run_id: str, operation: str, kwargs: dict[str, Any], who: Who) -> dict[str, str]:
        run = await service.adapter_of(who, run_id)
        service.host.validate(operation, kwargs)  # bad names, token ids, sizes: a 4xx now, not a failed future

        def compute() -> Any:
            result = service.host.run(service.loaded(run), operation, kwargs)
            if operation in SETUP_OPERATIONS:
                service.remember_setup(run_id, operation, kwargs)
            return result

        batch = service.mixable(run, operation, kwargs)
        return {'future_id': (await service.submit_async(who, run_id, operation, compute, batch)).id}

    @app.post(f'{PREFIX}/runs/{{run_id}}/save', status_code=202)
    async def save(run_id: str, body: SaveRequest, who: Who) -> dict[str, str]:
        run = await service.adapter_of(who, run_id)
        check_checkpoint_name(body.name)
        directory = service.checkpoint_dir(who, run_id)

        def write() -> str:
            path = Path(service.host.save(service.loaded(run), directory, body.name, body.save_optimizer))
            size = sum(f.stat().st_size for f in path.rglob('*') if f.is_file())
            checkpoint = service.store.add_checkpoint(who.id, run_id, body.name, str(path), 'training', size)
            return checkpoint.twinkle_path

        return {'future_id': (await service.submit_async(who, run_id, 'save', write)).id}

    @app.post(f'{PREFIX}/runs/{{run_id}}/load', status_code=202)
    async def load(run_id: str, body: LoadRequest, who: Who) -> dict[str, str]:
        run = await service.adapter_of(who, run_id)
        source_run, name = parse_twinkle_path(body.path)
        checkpoint = service.store.get_checkpoint(who.id, source_run, name)
        if checkpoint is None:
            raise NotFoundError(f'checkpoint {body.path!r} not found')

        def read() -> str:
            service.host.load(service.loaded(run), Path(checkpoint.path), body.load_optimizer)
            return checkpoint.twinkle_path

        return {'future_id': (await service.submit_async(who, run_id, 'load', read)).id}

    @app.get(f'{PREFIX}/runs/{{run_id}}/checkpoints')
    async def list_checkpoints(run_id: str, who: Who) -> dict[str, Any]:
        if service.store.get_run(who.id, run_id) is None:
            raise NotFoundError(f'training run {run_id!r} not found')
        return {'checkpoints': [_checkpoint_json(c) for c in service.store.list_checkpoints(who.id, run_id)]}

    @app.delete(f'{PREFIX}/runs/{{run_id}}/checkpoints/{{name}}')
    async def delete_checkpoint(run_id: str, name: str, who: Who) -> dict[str, bool]:
        checkpoint = service.store.get_checkpoint(who.id, run_id, name)
        if checkpoint is None:
            raise NotFoundError(f'checkpoint {name!r} of run {run_id!r} not found')
        service.store.delete_checkpoint(who.id, run_id, name)
        _remove_tree(Path(checkpoint.path))
        return {'deleted': True}

    @app.get(f'{PREFIX}/futures/{{future_id}}')
    async def get_future(future_id: str, who: Who, wait: float = 0.0) -> dict[str, Any]:
        record = service.store.get_future(who.id, future_id)
        if record is None:
            raise NotFoundError(f'request {future_id!r} not found')
        job = service.scheduler.get(future_id)
        if job is not None and wait > 0:
            await wait_job(job, min(wait, 60.0))
            record = service.store.get_future(who.id, future_id)
        return asdict(record)

    return app


async def _release_periodically(service: Service) -> None:
    idle = service.config.idle_release_s
    if idle is None:
        return
    while True:
        await asyncio.sleep(min(max(idle / 4, 0.05), 30.0))
        service.release_idle()


async def _expire_gaps(service: Service) -> None:
    """Fail Tinker requests that wait for a seq_id that never came."""
    while True:
        await asyncio.sleep(min(service.config.tinker.seq_gap_timeout_s / 4, 5.0))
        service.tinker.sequencer.expire()


def _run_json(run: Any) -> dict[str, Any]:
    data = asdict(run)
    data['training_run_id'] = run.id
    return data


def _checkpoint_json(checkpoint: Any) -> dict[str, Any]:
    data = asdict(checkpoint)
    data.pop('path', None)  # server paths stay on the server
    data['twinkle_path'] = checkpoint.twinkle_path
    return data


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


__all__ = ['Service', 'create_app']
