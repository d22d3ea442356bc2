"""The HTTP API: FastAPI routes over the store (SQLite), the scheduler (one worker thread) and
the model host.

Every compute request is answered at once with a future id (202); ``GET /twinkle/v1/futures/{id}``
returns its state, waiting up to ``wait`` seconds for it to finish without holding the event
loop. A tenant sees only its own runs, checkpoints and futures: anything else is a 404, as if it
did not exist.
"""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from twinkle.errors import StateError, TwinkleError, UnknownNameError
from twinkle.server.auth import read_keys_file
from twinkle.server.config import ServerConfig
from twinkle.server.deps import Who
from twinkle.server.host import CapacityError, ModelHost, is_mixable, request_tokens
from twinkle.server.limits import RateLimitedError, RateLimiter
from twinkle.server.openai_api import openai_router
from twinkle.server.remote_host import build_host
from twinkle.server.scheduler import Batchable, Job, QueueFullError, Scheduler, wait_job
from twinkle.server.store import Store, Tenant, check_checkpoint_name, check_name, parse_twinkle_path
from twinkle.server.tinker.rest import expire_checkpoints_periodically, rest_router
from twinkle.server.tinker.routes import tinker_router
from twinkle.utils.logger import get_logger

logger = get_logger()
PREFIX = '/twinkle/v1'
#: Configuration operations: recorded per run and replayed when a released adapter comes back.
SETUP_OPERATIONS = ('set_optimizer', 'set_lr_scheduler', 'set_loss', 'set_template', 'set_processor', 'add_metric')
#: Seconds between two recordings of a run's last request time.
TOUCH_INTERVAL_S = 1.0
#: Where a released adapter's state is kept, beside the run's checkpoints.
RELEASE_STATE = 'released-state'
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


class Service:
    """What the routes share: config, store, scheduler, model host and metrics."""

    def __init__(self, config: ServerConfig, host: ModelHost | None = None):
        self.config = config
        Path(config.data_dir).mkdir(parents=True, exist_ok=True)
        self.store = Store(config.db_path)
        if config.api_keys_file is not None:
            self.store.sync_keys_file(read_keys_file(config.api_keys_file))
        per_minute = config.limits.max_requests_per_minute
        self.limiter = RateLimiter(per_minute) if per_minute is not None else None
        failed = self.store.fail_unfinished_futures('the server restarted before this request finished')
        if failed:
            logger.warning(f'{failed} requests were unfinished at the last shutdown; marked failed')
        for run in self.store.idle_runs(older_than_s=0.0):  # their adapters died with the last process
            self.store.set_run_status(run.id, 'released')
        self.host = host or build_host(config)
        self.adapters: dict[str, str] = {}  # run id -> adapter name on the model
        self._touched: dict[str, float] = {}  # run id -> monotonic time of the last recorded request
        self.registry = CollectorRegistry()
        self.requests = Counter('twinkle_requests', 'Compute requests', ['operation', 'status'], registry=self.registry)
        self.seconds = Histogram('twinkle_request_seconds', 'Compute time', ['operation'], registry=self.registry)
        self.queued = Gauge('twinkle_queued_requests', 'Requests waiting', registry=self.registry)
        self.pass_jobs = Histogram(
            'twinkle_pass_jobs',
            'Requests in the pass that ran each request (1: alone; more: a pass shared by tenants)',
            ['operation'],
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.memory_releases = Counter(
            'twinkle_memory_releases', 'Times the idle model process gave freed memory back', registry=self.registry
        )
        self.scheduler = Scheduler(
            max_queued_per_tenant=config.limits.max_queued_per_tenant,
            on_start=self._on_start,
            on_finish=self._on_finish,
            max_tokens_per_pass=config.limits.max_tokens_per_pass,
            on_idle=None if config.release_memory_after_idle_s is None else self._on_idle,
            idle_after_s=config.release_memory_after_idle_s or 2.0,
        )

    # ---- jobs -----------------------------------------------------------------------------------
    async def submit_async(
        self, tenant: Tenant, run_id: str | None, operation: str, fn: Any, batch: Batchable | None = None
    ) -> Job:
        """``submit`` from a route: the future's row is written (and fsynced) off the event loop."""
        return await asyncio.to_thread(self.submit, tenant, run_id, operation, fn, batch)

    def submit(
        self, tenant: Tenant, run_id: str | None, operation: str, fn: Any, batch: Batchable | None = None
    ) -> Job:
        record = self.store.create_future(tenant.id, run_id, operation)
        return self.enqueue(tenant, record.id, operation, fn, batch)

    def enqueue(self, tenant: Tenant, future_id: str, operation: str, fn: Any, batch: Batchable | None = None) -> Job:
        """Queue ``fn`` as the job of the future ``future_id`` (already recorded); with
        ``batch`` it may share a pass with other tenants' jobs."""
        try:
            job = self.scheduler.submit(tenant.id, fn, job_id=future_id, batch=batch)
        except QueueFullError as e:
            self.store.fail_future(future_id, str(e), 'user')
            raise
        job.operation = operation  # type: ignore[attr-defined]
        self.queued.set(self.scheduler.queued())
        return job

    def mixable(self, run: Any, operation: str, kwargs: dict[str, Any]) -> Batchable | None:
        """How a native ``forward_backward`` / ``forward_only`` request can share a pass with
        other tenants' (None for other operations, micro-batched ones, and the base model alone)."""
        if not self.config.mixed_batches or not is_mixable(operation, kwargs):
            return None

        def run_many(payloads: list[tuple[Any, dict[str, Any]]]) -> list[Any]:
            requests = [(self.loaded(run), kwargs) for run, kwargs in payloads]
            return self.host.call(ModelHost.run_mixed, operation, requests)

        return Batchable(('native', operation), request_tokens(kwargs['inputs']), (run, kwargs), run_many)

    def adapter_name(self, run: Any) -> str:
        """The name of a run's adapter on the model: never shown to tenants, unique per run."""
        return f'{run.tenant_id}--{run.id}'.replace(':', '-')

    def _on_start(self, job: Job) -> None:
        self.store.set_future_running(job.id)

    def _on_idle(self) -> None:
        if self.host.call(ModelHost.release_free_memory):
            self.memory_releases.inc()

    def _on_finish(self, job: Job) -> None:
        operation = getattr(job, 'operation', 'unknown')
        if job.error is None:
            self.store.finish_future(job.id, job.result)
        else:
            category = 'user' if isinstance(job.error, TwinkleError) else 'server'
            if category == 'server':
                logger.error(f'request {job.id} ({operation}) failed: {job.error!r}')
            self.store.fail_future(job.id, f'{type(job.error).__name__}: {job.error}', category)
        self.requests.labels(operation, job.status).inc()
        if job.started_at and job.finished_at:
            self.seconds.labels(operation).observe(job.finished_at - job.started_at)
            self.pass_jobs.labels(operation).observe(job.pass_size)
        self.queued.set(self.scheduler.queued())

    # ---- runs -----------------------------------------------------------------------------------
    async def adapter_of(self, tenant: Tenant, run_id: str) -> Any:
        """A run of this tenant that is on the model or can be brought back; 404 otherwise.
        Jobs then call ``loaded`` on the worker thread, where no release can slip in between."""
        run = self.store.get_run(tenant.id, run_id)
        if run is None or run.status == 'deleted':
            raise HTTPException(404, f'training run {run_id!r} not found')
        if run_id not in self.adapters and not self.release_state(run).is_dir():
            raise StateError(
                f'training run {run_id!r} is not loaded on the model (status {run.status!r}) and left no state '
                'to restore: create a run and load one of its checkpoints with load(path, load_optimizer=True)'
            )
        await asyncio.to_thread(self.touch, run_id)
        return run

    def loaded(self, run: Any) -> str:
        """The run's adapter on the model, restored first if it was released (worker thread)."""
        if run.id not in self.adapters:
            self.restore(self.store.get_run_by_id(run.id))
        return self.adapters[run.id]

    def touch(self, run_id: str) -> None:
        """Record the run's last request; at most once a second, as each write syncs the disk."""
        now = time.monotonic()
        if now - self._touched.get(run_id, -TOUCH_INTERVAL_S) >= TOUCH_INTERVAL_S:
            self._touched[run_id] = now
            self.store.touch_run(run_id)

    # ---- releasing idle adapters ----------------------------------------------------------------
    def remember_setup(self, run_id: str, operation: str, kwargs: dict[str, Any]) -> None:
        """Record a configuration call, to replay when the adapter is brought back."""
        run = self.store.get_run_by_id(run_id)
        config = dict(run.config)
        config['setup'] = [*config.get('setup', []), {'operation': operation, 'kwargs': kwargs}]
        self.store.set_run_config(run_id, config)

    def release_state(self, run: Any) -> Path:
        return self.config.checkpoint_dir / run.tenant_id / run.id / RELEASE_STATE

    def release(self, run: Any) -> bool:
        """Save a run's adapter with its optimizer and counters, then take it off the model.
        Runs on the worker thread. Skipped while gradients wait for an optimizer step."""
        adapter = self.adapters.get(run.id)
        if adapter is None:
            return False
        if self.host.has_pending_gradients(adapter):
            return False  # gradients are waiting for a step: releasing now would lose them
        path = self.release_state(run)
        self.host.save(adapter, path.parent, path.name, save_optimizer=True)
        self.host.remove_adapter(adapter)
        del self.adapters[run.id]
        self.store.set_run_status(run.id, 'released')
        return True

    def restore(self, run: Any) -> None:
        """Bring a released run back: its adapter, its setup calls replayed, then its saved
        weights, optimizer, scheduler and step counters."""
        adapter, config, path = self.adapter_name(run), run.config, self.release_state(run)
        if not path.is_dir():
            raise StateError(
                f'training run {run.id!r} is not on the model and left no state to restore (the server stopped '
                'without saving it): load one of its checkpoints into a new run'
            )
        self.host.add_adapter(adapter, config.get('lora', {}), config.get('gradient_accumulation_steps', 1))
        try:
            for call in config.get('setup', []):
                self.host.run(adapter, call['operation'], dict(call['kwargs']))
            self.host.restore_state(adapter, path)
        except BaseException:
            self.host.remove_adapter(adapter)
            raise
        self.adapters[run.id] = adapter
        self.store.set_run_status(run.id, 'active')

    def release_all(self, timeout: float = 600.0) -> None:
        for run_id in list(self.adapters):
            run = self.store.get_run_by_id(run_id)
            tenant = Tenant(id=run.tenant_id, name='', created_at=0.0)
            self.submit(tenant, run_id, 'release', lambda r=run: self.release(r))
        self.scheduler.drain(timeout)

    def release_idle(self) -> list[Job]:
        """Queue the release of every run idle longer than ``idle_release_s``."""
        if self.config.idle_release_s is None:
            return []
        jobs = []
        for run in self.store.idle_runs(self.config.idle_release_s):
            if run.id in self.adapters:
                tenant = Tenant(id=run.tenant_id, name='', created_at=0.0)
                jobs.append(self.submit(tenant, run.id, 'release', lambda r=run: self.release(r)))
        return jobs

    def checkpoint_dir(self, tenant: Tenant, run_id: str) -> Path:
        return self.config.checkpoint_dir / tenant.id / run_id


def create_app(config: ServerConfig, host: ModelHost | None = None) -> FastAPI:
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
    _error_handlers(app)
    app.include_router(tinker_router(service))
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
            raise HTTPException(400, f'this server hosts {config.base_model!r}; got base_model {body.base_model!r}')
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
            raise HTTPException(404, f'training run {run_id!r} not found')
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
            raise HTTPException(404, f'checkpoint {body.path!r} not found')

        def read() -> str:
            service.host.load(service.loaded(run), Path(checkpoint.path), body.load_optimizer)
            return checkpoint.twinkle_path

        return {'future_id': (await service.submit_async(who, run_id, 'load', read)).id}

    @app.get(f'{PREFIX}/runs/{{run_id}}/checkpoints')
    async def list_checkpoints(run_id: str, who: Who) -> dict[str, Any]:
        if service.store.get_run(who.id, run_id) is None:
            raise HTTPException(404, f'training run {run_id!r} not found')
        return {'checkpoints': [_checkpoint_json(c) for c in service.store.list_checkpoints(who.id, run_id)]}

    @app.delete(f'{PREFIX}/runs/{{run_id}}/checkpoints/{{name}}')
    async def delete_checkpoint(run_id: str, name: str, who: Who) -> dict[str, bool]:
        checkpoint = service.store.get_checkpoint(who.id, run_id, name)
        if checkpoint is None:
            raise HTTPException(404, f'checkpoint {name!r} of run {run_id!r} not found')
        service.store.delete_checkpoint(who.id, run_id, name)
        _remove_tree(Path(checkpoint.path))
        return {'deleted': True}

    @app.get(f'{PREFIX}/futures/{{future_id}}')
    async def get_future(future_id: str, who: Who, wait: float = 0.0) -> dict[str, Any]:
        record = service.store.get_future(who.id, future_id)
        if record is None:
            raise HTTPException(404, f'request {future_id!r} not found')
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


def _error_handlers(app: FastAPI) -> None:
    statuses: list[tuple[type[BaseException], int]] = [
        (QueueFullError, 429),
        (RateLimitedError, 429),
        (CapacityError, 429),
        (UnknownNameError, 400),
        (StateError, 409),
        (TwinkleError, 400),
    ]

    async def handle(request: Request, error: Exception) -> JSONResponse:
        status = next(code for kind, code in statuses if isinstance(error, kind))
        headers = {}
        if status == 429:
            retry = getattr(error, 'retry_after_s', 5.0)
            headers['Retry-After'] = str(max(1, round(retry)))
        return JSONResponse({'detail': str(error), 'error': type(error).__name__}, status_code=status, headers=headers)

    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the bad input, and fails (500) on NaN, infinity or non-UTF-8 bytes.
        return JSONResponse({'detail': jsonable_encoder(_jsonable(error.errors()))}, status_code=422)

    app.add_exception_handler(TwinkleError, handle)
    app.add_exception_handler(RequestValidationError, invalid_request)


def _jsonable(value: Any) -> Any:
    """``value`` as JSON can carry it: NaN and infinities as strings, bytes decoded leniently."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, bytes):
        return value.decode('utf-8', errors='replace')
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return value


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
