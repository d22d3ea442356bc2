"""``Service``: the state every route of every API shares, built once per server by ``create_app``.

It holds the configuration, the store (SQLite), the scheduler (one worker thread), the model
host, the Prometheus metrics, which runs have an adapter on the model, and the Tinker API's own
state (``TinkerState``). Routes receive it typed; nothing is added to it after ``__init__``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import JsonValue

from twinkle.errors import CapacityError, NotFoundError, StateError, TwinkleError
from twinkle.model.checkpoint import recover_all
from twinkle.server.auth import read_keys_file
from twinkle.server.config import ServerConfig
from twinkle.server.host import ModelHost, is_mixable, request_tokens
from twinkle.server.limits import RateLimiter
from twinkle.server.remote_host import RemoteHost, build_host
from twinkle.server.scheduler import Batchable, Job, QueueFullError, Scheduler
from twinkle.server.store import Run, Store, Tenant
from twinkle.server.tinker.state import TinkerState
from twinkle.utils.logger import get_logger

logger = get_logger()
#: Seconds between two recordings of a run's last request time.
TOUCH_INTERVAL_S = 1.0
#: Where a released adapter's state is kept, beside the run's checkpoints.
RELEASE_STATE = 'released-state'


class Service:
    """What the routes share: config, store, scheduler, model host and metrics."""

    def __init__(self, config: ServerConfig, host: ModelHost | RemoteHost | None = None):
        self.config = config
        Path(config.data_dir).mkdir(parents=True, exist_ok=True)
        self.store = Store(config.db_path)
        if config.api_keys_file is not None:
            self.store.sync_keys_file(read_keys_file(config.api_keys_file))
        per_minute = config.limits.max_requests_per_minute
        self.limiter: RateLimiter | None = RateLimiter(per_minute) if per_minute is not None else None
        failed = self.store.fail_unfinished_futures('the server restarted before this request finished')
        if failed:
            logger.warning(f'{failed} requests were unfinished at the last shutdown; marked failed')
        recover_all(config.checkpoint_dir)  # checkpoint saves that a crash cut short in their swap
        for run in self.store.idle_runs(older_than_s=0.0):  # their adapters died with the last process
            self.store.set_run_status(run.id, 'released')
        self.host: ModelHost | RemoteHost = host or build_host(config)
        self.adapters: dict[str, str] = {}  # run id -> adapter name on the model
        self._touched: dict[str, float] = {}  # run id -> monotonic time of the last recorded request
        self._pinned: set[str] = set()  # runs the worker's current jobs use: not released to make room
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
            mix_wait_s=config.mix_wait_ms / 1000 if config.mixed_batches else 0.0,
        )
        self.tinker = TinkerState(config.tinker)

    # ---- jobs -----------------------------------------------------------------------------------
    async def submit_async(
        self,
        tenant: Tenant,
        run_id: str | None,
        operation: str,
        fn: Callable[[], object],
        batch: Batchable | None = None,
    ) -> Job:
        """``submit`` from a route: the future's row is written (and fsynced) off the event loop."""
        return await asyncio.to_thread(self.submit, tenant, run_id, operation, fn, batch)

    def submit(
        self,
        tenant: Tenant,
        run_id: str | None,
        operation: str,
        fn: Callable[[], object],
        batch: Batchable | None = None,
        internal: bool = False,
    ) -> Job:
        record = self.store.create_future(tenant.id, run_id, operation)
        return self.enqueue(tenant, record.id, operation, fn, batch, internal)

    def enqueue(
        self,
        tenant: Tenant,
        future_id: str,
        operation: str,
        fn: Callable[[], object],
        batch: Batchable | None = None,
        internal: bool = False,
    ) -> Job:
        """Queue ``fn`` as the job of the future ``future_id`` (already recorded); with
        ``batch`` it may share a pass with other tenants' jobs. An ``internal`` job (the server's
        own, such as releasing an idle adapter) is not held to the tenant's queue limit."""
        try:
            job = self.scheduler.submit(
                tenant.id, fn, job_id=future_id, batch=batch, operation=operation, internal=internal
            )
        except QueueFullError as e:
            self.store.fail_future(future_id, str(e), 'user')
            raise
        self.queued.set(self.scheduler.queued())
        return job

    def mixable(self, run: Run, operation: str, kwargs: dict[str, JsonValue]) -> Batchable | None:
        """How a native ``forward_backward`` / ``forward_only`` request can share a pass with
        other tenants', and a ``clip_grad_and_step`` their optimizer update (None for other
        operations, micro-batched ones, and the base model alone)."""
        if not self.config.mixed_batches or not is_mixable(operation, kwargs):
            return None
        stepping = operation == 'clip_grad_and_step'

        def run_many(payloads: list[tuple[Run, dict[str, JsonValue]]]) -> list[object]:
            requests = [(self.loaded(run), kwargs) for run, kwargs in payloads]
            if stepping:
                return self.host.call(ModelHost.run_steps, requests)
            return self.host.call(ModelHost.run_mixed, operation, requests)

        tokens = 0 if stepping else request_tokens(kwargs['inputs'])
        return Batchable(('native', operation), tokens, (run, kwargs), run_many)

    def adapter_name(self, run: Run) -> str:
        """The name of a run's adapter on the model: its run id, unique on the server (the store
        makes it), so what the model's errors name is what the tenant knows. A tenant reaches an
        adapter only through its own runs, so naming another tenant's run reaches nothing."""
        return run.id

    def _on_start(self, job: Job) -> None:
        self.store.set_future_running(job.id)

    def _on_idle(self) -> None:
        if self.host.call(ModelHost.release_free_memory):
            self.memory_releases.inc()

    def _on_finish(self, job: Job) -> None:
        self._pinned.clear()
        operation = job.operation
        if job.error is None:
            self.store.finish_future(job.id, job.result)
        else:
            category = 'user' if isinstance(job.error, TwinkleError) else 'server'
            message = f'{type(job.error).__name__}: {job.error}'
            if category == 'server':  # its text may name server paths: the tenant gets the request id
                logger.error(f'request {job.id} ({operation}) failed: {job.error!r}')
                message = f'{type(job.error).__name__}: the server failed; its log has the details of request {job.id}'
            self.store.fail_future(job.id, message, category)
        self.requests.labels(operation, job.status).inc()
        if job.started_at and job.finished_at:
            self.seconds.labels(operation).observe(job.finished_at - job.started_at)
            self.pass_jobs.labels(operation).observe(job.pass_size)
        self.queued.set(self.scheduler.queued())

    # ---- runs -----------------------------------------------------------------------------------
    async def adapter_of(self, tenant: Tenant, run_id: str) -> Run:
        """A run of this tenant that is on the model or can be brought back; 404 otherwise.
        Jobs then call ``loaded`` on the worker thread, where no release can slip in between."""
        run = self.store.get_run(tenant.id, run_id)
        if run is None or run.status == 'deleted':
            raise NotFoundError(f'training run {run_id!r} not found')
        if run_id not in self.adapters and not self.release_state(run).is_dir():
            raise StateError(
                f'training run {run_id!r} is not loaded on the model (status {run.status!r}) and left no state '
                'to restore: create a run and load one of its checkpoints with load(path, load_optimizer=True)'
            )
        await asyncio.to_thread(self.touch, run_id)
        return run

    def loaded(self, run: Run) -> str:
        """The run's adapter on the model, restored first if it was released (worker thread)."""
        if run.id not in self.adapters:
            self.restore(self._stored_run(run.id))
        self._pinned.add(run.id)
        return self.adapters[run.id]

    def _stored_run(self, run_id: str) -> Run:
        """The run as the store has it now (its latest config and status)."""
        run = self.store.get_run_by_id(run_id)
        if run is None:
            raise NotFoundError(f'training run {run_id!r} not found')
        return run

    def touch(self, run_id: str) -> None:
        """Record the run's last request; at most once a second, as each write syncs the disk."""
        now = time.monotonic()
        if now - self._touched.get(run_id, -TOUCH_INTERVAL_S) >= TOUCH_INTERVAL_S:
            self._touched[run_id] = now
            self.store.touch_run(run_id)

    # ---- releasing idle adapters ----------------------------------------------------------------
    def remember_setup(self, run_id: str, operation: str, kwargs: dict[str, JsonValue]) -> None:
        """Record a configuration call, to replay when the adapter is brought back."""
        config = dict(self._stored_run(run_id).config)
        config['setup'] = [*config.get('setup', []), {'operation': operation, 'kwargs': kwargs}]
        self.store.set_run_config(run_id, config)

    def release_state(self, run: Run) -> Path:
        return self.config.checkpoint_dir / run.tenant_id / run.id / RELEASE_STATE

    def release(self, run: Run) -> bool:
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

    def restore(self, run: Run) -> None:
        """Bring a released run back: its adapter, its setup calls replayed, then its saved
        weights, optimizer, scheduler and step counters."""
        adapter, config, path = self.adapter_name(run), run.config, self.release_state(run)
        if not path.is_dir():
            raise StateError(
                f'training run {run.id!r} is not on the model and left no state to restore (the server stopped '
                'without saving it): load one of its checkpoints into a new run'
            )
        self.make_room(run)
        self.host.add_adapter(adapter, config.get('lora', {}), config.get('gradient_accumulation_steps', 1))
        try:
            for call in config.get('setup', []):
                self.host.run(adapter, call['operation'], dict(call['kwargs']))
            self.host.restore_state(adapter, path, f'the saved state of training run {run.id!r}')
        except BaseException:
            self.host.remove_adapter(adapter)
            raise
        self.adapters[run.id] = adapter
        self.store.set_run_status(run.id, 'active')

    def release_all(self, timeout: float = 600.0) -> None:
        for run_id in list(self.adapters):
            run = self._stored_run(run_id)
            tenant = Tenant(id=run.tenant_id, name='', created_at=0.0)
            self.submit(tenant, run_id, 'release', partial(self.release, run), internal=True)
        self.scheduler.drain(timeout)

    def release_idle(self) -> list[Job]:
        """Queue the release of every run idle longer than ``idle_release_s``."""
        if self.config.idle_release_s is None:
            return []
        jobs = []
        for run in self.store.idle_runs(self.config.idle_release_s):
            if run.id in self.adapters:
                tenant = Tenant(id=run.tenant_id, name='', created_at=0.0)
                jobs.append(self.submit(tenant, run.id, 'release', partial(self.release, run), internal=True))
        return jobs

    # ---- room on the model -----------------------------------------------------------------------
    def make_room(self, run: Run) -> None:
        """Before ``run``'s adapter is added (worker thread): a tenant holding its
        ``max_adapters_per_tenant`` adapters gives up its least recently used one, and a model
        holding ``max_adapters`` the least recently used of all; a released adapter comes back
        on its next request, unchanged. An adapter waiting for an optimizer step, or used by the
        current jobs, stays: if every candidate does, ``CapacityError`` (429) says what frees one."""
        limits = self.config.limits
        own = self._held(run.tenant_id, but=run.id)
        if len(own) >= limits.max_adapters_per_tenant and not self._release_first(own):
            raise CapacityError(
                f'you hold {len(own)} adapters on the model, the limit of max_adapters_per_tenant='
                f'{limits.max_adapters_per_tenant}, and each holds gradients waiting for an optimizer step: once '
                'one of them steps, it makes room for this one',
                retry_after_s=5.0,
            )
        everyone = self._held(None, but=run.id)
        if len(everyone) >= limits.max_adapters and not self._release_first(everyone):
            raise CapacityError(
                f'the server holds its limit of {limits.max_adapters} adapters (max_adapters), each waiting for an '
                'optimizer step; one makes room after its step',
                retry_after_s=5.0,
            )

    def _held(self, tenant_id: str | None, but: str | None = None) -> list[Run]:
        """Runs (of a tenant, or of all) with an adapter on the model, least recently used first."""
        return [run for run in self.store.active_runs(tenant_id) if run.id in self.adapters and run.id != but]

    def _release_first(self, runs: list[Run]) -> bool:
        """Release the first of ``runs`` that can go; False if none could."""
        return any(run.id not in self._pinned and self.release(run) for run in runs)

    def checkpoint_dir(self, tenant: Tenant, run_id: str) -> Path:
        return self.config.checkpoint_dir / tenant.id / run_id


__all__ = ['RELEASE_STATE', 'Service']
