"""``Service``: the state every route of every API shares, built once per server by ``create_app``.

It holds the configuration, the store (SQLite), the hosted base models (``ModelGroup`` s: each
its host, its scheduler and the adapters on it), the Prometheus metrics, and the Tinker API's
own state (``TinkerState``). Routes receive it typed; nothing is added to it after ``__init__``.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Callable, Collection
from functools import partial
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import JsonValue

from twinkle.errors import ConfigurationError, NotFoundError, QueueFullError, SessionExpiredError, StateError
from twinkle.model.checkpoint.files import recover_all
from twinkle.server.auth import read_keys_file
from twinkle.server.config import ServerConfig
from twinkle.server.execution.groups.model_group import HOUSEKEEPING, ModelGroup, bare
from twinkle.server.execution.groups.run_files import (
    RELEASE_STATE,
    claim_memory,
    discard_unkept,
    discard_unrecorded,
    release_memory,
)
from twinkle.server.execution.groups.sampler_group import SamplerGroup
from twinkle.server.execution.host import Host
from twinkle.server.execution.hosts.model_host import ModelHost
from twinkle.server.execution.placement import build_host
from twinkle.server.execution.scheduling.scheduler import Batchable, Job
from twinkle.server.metering import Ledger, Meter
from twinkle.server.rate_limit import RateLimiter
from twinkle.server.store import Checkpoint, KnownRequest, RequestKey, Run, Store, Tenant
from twinkle.utils.logger import get_logger

logger = get_logger()
#: Seconds between two recordings of a run's last request time.
TOUCH_INTERVAL_S = 1.0
#: Seconds between two looks at a full queue by a request that waits for room in it.
QUEUE_POLL_S = 0.05


def private_folder(path: Path) -> None:
    """Make ``path`` (the data directory: the store, every tenant's checkpoints and states) readable by
    this user alone: code a sandbox runs as another user (``twinkle.agent.sandbox``), or any other
    account of the machine, must not read a tenant's weights. A folder of another user's is left as it is."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_uid == os.getuid():
        path.chmod(0o700)


class Service:
    """What the routes share: config, store, the hosted base models and metrics.

    ``host`` (tests, a host built elsewhere) is the default base model's; the others are built
    from the config."""

    def __init__(self, config: ServerConfig, host: Host | None = None):
        self.config = config
        private_folder(Path(config.data_dir))
        self.store = Store(config.store_location)
        if config.api_keys_file is not None:
            self.store.tenants.sync_keys_file(read_keys_file(config.api_keys_file))
        per_minute = config.limits.max_requests_per_minute
        self.limiter: RateLimiter | None = RateLimiter(per_minute) if per_minute is not None else None
        failed = self.store.futures.fail_unfinished('the server restarted before this request finished')
        if failed:
            logger.warning(f'{failed} requests were unfinished at the last shutdown; marked failed')
        recover_all(config.checkpoint_dir)  # saves of a run's state that a crash cut short in their swap
        # Kept states the last process left in host memory go to disk; the folder is ours while we run.
        found = claim_memory(config)
        if found:
            logger.warning(f'{found} kept states the last server left in host memory were put on disk')
        # Kept states no row names: written just before a crash, never committed (the step was not answered).
        discard_unkept(config.checkpoint_dir, self.store.states.folders())
        # Checkpoint folders no row names: saves a crash cut short before their row, or replaced just before one.
        discarded = discard_unrecorded(config.checkpoint_dir, self.store.checkpoints.paths())
        if discarded:
            logger.warning(f'{discarded} checkpoint folders were never recorded (a save cut short); deleted')
        for run in self.store.runs.idle(older_than_s=0.0):  # their adapters died with the last process
            self.store.runs.set_status(run.id, 'released')
        self._touched: dict[str, float] = {}  # run id -> monotonic time of the last recorded request
        # Signs the download links of checkpoint files (twinkle.server.api.links); made at start, so a
        # restart voids the links (the client asks for new ones).
        self.link_key = secrets.token_bytes(32)
        self.registry = CollectorRegistry()
        self.requests = Counter('twinkle_requests', 'Compute requests', ['operation', 'status'], registry=self.registry)
        self.seconds = Histogram('twinkle_request_seconds', 'Compute time', ['operation'], registry=self.registry)
        self.queued = Gauge('twinkle_queued_requests', 'Requests waiting', registry=self.registry)
        self.usage = Counter(
            'twinkle_usage',
            'Metered usage by tenant and kind: tokens trained, sampled and prompted, worker seconds, checkpoints',
            ['kind'] if config.metrics.tenant_label == 'none' else ['tenant', 'kind'],  # a tenant by id, name or not
            registry=self.registry,
        )
        #: The future id of each job to charge -> (tenant, run id, base model, meter, tokens admitted).
        self._meters: dict[str, tuple[Tenant, str | None, str, Meter, int]] = {}
        #: The tenants' quotas against their usage (``twinkle.server.metering``).
        self.ledger = Ledger(self.store, config.quotas)
        #: Each tenant's requests waiting for room in a worker's queue, in the order they came (``queue``).
        self._queue_turns: dict[tuple[str, int], asyncio.Lock] = {}
        self.pass_jobs = Histogram(
            'twinkle_pass_jobs',
            'Requests in the pass that ran each request (1: alone; more: a pass shared by tenants)',
            ['operation'],
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.slices = Histogram(
            'twinkle_request_slices',
            'Slices each request ran in (1: whole; more: a sampling request that gave other tenants the worker '
            'between them, sampling_slice_ms)',
            ['operation'],
            buckets=(1, 2, 4, 16, 64, 256, 1024, 4096),
            registry=self.registry,
        )
        self.memory_releases = Counter(
            'twinkle_memory_releases', 'Times the idle model process gave freed memory back', registry=self.registry
        )
        self.expired_requests = Counter(
            'twinkle_expired_requests',
            'Requests dropped before they started: their Tinker session sent no heartbeat for tinker.session_timeout_s',
            registry=self.registry,
        )
        self.restarts = Counter(
            'twinkle_model_restarts',
            "Times a model's worker processes were started again after one died",
            ['base_model'],
            registry=self.registry,
        )
        self.groups: dict[str, ModelGroup] = {}
        for index, group_config in enumerate(config.model_groups()):
            group_host = host if index == 0 and host is not None else build_host(group_config)
            sampler = None
            if group_config.sampler is not None and group_config.sampler.group:
                sampler = SamplerGroup(group_config, self.store, self._on_start, self._on_finish)
            self.groups[group_config.base_model] = ModelGroup(
                group_config, self.store, group_host, self._on_start, self._on_finish, self._on_idle, self._on_restart,
                sampler,
            )  # fmt: skip
        #: The group of ``config.base_model``: what a request that names no base model gets.
        self.default = self.groups[config.base_model]

    # ---- the hosted base models -----------------------------------------------------------------
    def group_named(self, name: str | None) -> ModelGroup:
        """The group of the base model ``name`` names (None: the default); 404 if none is hosted."""
        if name is None:
            return self.default
        group = self.find_group(name)
        if group is not None:
            return group
        raise NotFoundError(f'base model {name!r} is not served here; this server hosts {self.model_names()}')

    def group_of(self, run: Run) -> ModelGroup:
        """The group of a run's base model."""
        return self.hosting(run.base_model, f'training run {run.id!r}')

    def hosting(self, base_model: str, what: str) -> ModelGroup:
        """The group of ``base_model`` as the store records it (what the config named when the
        run was made; a spelling the config changed since, ``ms://X`` for ``X`` say, still
        finds it); a 409 naming ``what`` if the server no longer hosts it."""
        group = self.find_group(base_model)
        if group is None:
            raise StateError(
                f'{what} is of {bare(base_model)!r}, which this server no longer hosts; it hosts {self.model_names()}'
            )
        return group

    def find_group(self, base_model: str) -> ModelGroup | None:
        """The group of a base model as the store records it, under any spelling (None: not hosted)."""
        return self.groups.get(base_model) or next(
            (g for g in self.groups.values() if g.answers_to(base_model) or g.answers_to(bare(base_model))), None
        )

    def check_trained_on(self, checkpoint: Checkpoint, group: ModelGroup, shown_as: str) -> None:
        """A checkpoint loads only into an adapter of the base model it was trained on."""
        source = self.store.runs.by_id(checkpoint.run_id)
        if source is not None and self.hosting(source.base_model, f'checkpoint {shown_as!r}') is not group:
            raise ConfigurationError(
                f'checkpoint {shown_as!r} holds weights for {bare(source.base_model)!r}, not {bare(group.name)!r}'
            )

    def folder_now(self, tenant: Tenant, checkpoint: Checkpoint, shown_as: str) -> Path:
        """The checkpoint's folder as the store names it now (from a job, on the worker thread): a
        save may have replaced it since the request looked it up; 404 if it was deleted since."""
        now = self.store.checkpoints.readable(tenant.id, checkpoint.run_id, checkpoint.name, checkpoint.kind)
        if now is None:
            raise NotFoundError(f'checkpoint {shown_as!r} not found')
        return Path(now.path)

    def model_names(self) -> list[str]:
        """The hosted base models as clients name them (without ``ms://`` / ``hf://``), default first."""
        return [bare(name) for name in self.groups]

    def start(self) -> None:
        for group in self.groups.values():
            for scheduler in group.schedulers:
                scheduler.start()

    def stop(self) -> None:
        """Stop every group's workers after their running jobs; the jobs still queued fail."""
        stopped = 'the server stopped before this request ran'
        for group in self.groups.values():
            unrun = group.scheduler.stop(wait=True)
            for job in unrun:  # a paused one's continuation is cancelled, and whoever waits on it woken
                job.fail(StateError(stopped))
            unrun += group.sampler.stop(StateError(stopped)) if group.sampler is not None else []
            for job in unrun:
                self.store.futures.fail(job.id, stopped, 'server')
            group.host.shutdown()  # model workers in a Ray actor or processes, and a vLLM engine, go with their server
            group.pool.close()
        release_memory(self.config)

    # ---- jobs -----------------------------------------------------------------------------------
    def submit(
        self,
        tenant: Tenant,
        group: ModelGroup,
        run_id: str | None,
        operation: str,
        fn: Callable[[], object],
        batch: Batchable | None = None,
        internal: bool = False,
        future_id: str | None = None,
        meter: Meter | None = None,
        request_key: RequestKey | None = None,
    ) -> Job:
        """Queue ``fn`` on ``group``'s worker as the job of a future: a new one recorded for
        ``run_id`` (with the client's ``request_key``: ``KnownRequest`` if the key has a future
        already, and nothing queued), or ``future_id`` (recorded already). With ``batch`` it may share a pass with
        other tenants' jobs. An ``internal`` job (the server's own, such as releasing an idle
        adapter) is not held to the tenant's queue limit. Routes call it on the event loop: the
        future's row is committed without an fsync (``store/futures.py``), in less time than a hop to
        a thread and back would take. The tenant is charged its worker's seconds and, once it
        succeeds, what ``meter`` counted (``twinkle.server.metering``), within its quotas (a new
        future is admitted by ``ledger`` first; ``future_id``'s caller admitted it); an internal
        job is not."""
        meter = meter or Meter()
        if future_id is None:  # a 429 or 403 now, before a future is recorded
            future_id = self._new_future(tenant, run_id, operation, meter, internal, request_key)
        admitted = 0 if internal else meter.tokens  # admitted here, or by the caller that recorded the future
        if not internal:
            self._meters[future_id] = (tenant, run_id, group.name, meter, admitted)
        try:
            job = group.scheduler_for(operation).submit(
                tenant.id, group.sliced(operation, fn, tenant.id), job_id=future_id, batch=batch, operation=operation,
                internal=internal, run_id=run_id,
            )  # fmt: skip
        except QueueFullError as e:
            self._meters.pop(future_id, None)
            self.ledger.settle(tenant, admitted)
            if request_key is not None:  # the client sends it again with its key after the Retry-After
                self.store.futures.release_key(future_id)
            self.store.futures.fail(future_id, str(e), 'user')
            raise
        self.queued.set(self.queued_jobs())
        return job

    def _new_future(
        self, tenant: Tenant, run_id: str | None, operation: str, meter: Meter, internal: bool, key: RequestKey | None
    ) -> str:
        """A new request admitted by the ledger (a tenant's) and its future recorded; its id. A request key
        the tenant sent before is ``KnownRequest``, with nothing admitted."""
        if not internal:
            self.ledger.admit(tenant, meter)
        try:
            return self.store.futures.create(tenant.id, run_id, operation, request_key=key).id
        except KnownRequest:
            if not internal:
                self.ledger.settle(tenant, meter.tokens)
            raise

    async def queue(
        self,
        tenant: Tenant,
        group: ModelGroup,
        run_id: str | None,
        operation: str,
        fn: Callable[[], object],
        batch: Batchable | None = None,
        meter: Meter | None = None,
        wait_s: float = 0.0,
        request_key: RequestKey | None = None,
    ) -> Job:
        """``submit``, waiting up to ``wait_s`` seconds for room when the tenant's queue is full
        instead of refusing at once (a client's ``X-Twinkle-Queue``). The tenant's waiting requests
        enter in the order they came; past the wait, the 429 as ``submit`` raises it."""
        scheduler = group.scheduler_for(operation)
        if wait_s <= 0 or scheduler.queued(tenant.id) < scheduler.max_queued_per_tenant:
            return self.submit(tenant, group, run_id, operation, fn, batch, meter=meter, request_key=request_key)
        deadline = time.monotonic() + wait_s
        async with self._queue_turns.setdefault((tenant.id, id(scheduler)), asyncio.Lock()):
            while scheduler.queued(tenant.id) >= scheduler.max_queued_per_tenant and time.monotonic() < deadline:
                await asyncio.sleep(QUEUE_POLL_S)
            return self.submit(tenant, group, run_id, operation, fn, batch, meter=meter, request_key=request_key)

    def job(self, job_id: str) -> Job | None:
        """The job of a future, on whichever group runs it (None once forgotten)."""
        schedulers = (scheduler for group in self.groups.values() for scheduler in group.schedulers)
        return next((job for scheduler in schedulers if (job := scheduler.get(job_id)) is not None), None)

    def waiting_sessions(self) -> set[str]:
        """The Tinker sessions with jobs waiting on a worker that have not begun."""
        jobs = (job for group in self.groups.values() for s in group.schedulers for job in s.unsettled())
        return {session for job in jobs if job.status == 'pending' and (session := self._session_of(job)) is not None}

    def drop_sessions(self, session_ids: Collection[str], reason: str) -> int:
        """Drop the jobs of these Tinker sessions that have not begun, on every worker: each future
        fails with ``SessionExpiredError(reason)`` as the tenant's doing, its admitted tokens are let
        go, and it counts in ``twinkle_expired_requests``; how many. A job begun is left to finish."""
        error = SessionExpiredError(reason)
        dropped = [
            job
            for group in self.groups.values()
            for scheduler in group.schedulers
            for job in scheduler.withdraw(lambda job: self._session_of(job) in session_ids)
        ]
        for job in dropped:
            self.store.futures.fail(job.id, f'{type(error).__name__}: {error}', 'user')  # before a waiter wakes
            job.fail(error)
            charged = self._meters.pop(job.id, None)
            if charged is not None:
                self.ledger.settle(charged[0], charged[4])
        self.expired_requests.inc(len(dropped))
        self.queued.set(self.queued_jobs())
        return len(dropped)

    def _session_of(self, job: Job) -> str | None:
        """The Tinker session of a tenant's job (None: the native API's, or the server's own)."""
        charged = self._meters.get(job.id)
        return None if charged is None else charged[3].session_id

    def queued_jobs(self, tenant_id: str | None = None) -> int:
        """Jobs waiting on every group, of ``tenant_id`` or of all tenants."""
        return sum(s.queued(tenant_id) for group in self.groups.values() for s in group.schedulers)

    def _on_idle(self, group: ModelGroup) -> None:
        """A group's worker has been idle a while: its model process gives freed heap pages back,
        unless it is this process and another model here is busy (the release is the process's)."""
        here = [g for g in self.groups.values() if isinstance(g.host, ModelHost)]
        if group in here and any(g.scheduler.busy() for g in here if g is not group):
            return  # that model's worker releases once it is idle too
        if group.release_free_memory():
            self.memory_releases.inc()

    def _on_restart(self, group: ModelGroup) -> None:
        name = bare(group.name)
        logger.warning(f'the workers of {name!r} were started again; its runs continue from their saved state')
        self.restarts.labels(name).inc()

    def _on_start(self, job: Job) -> None:
        if job.slices == 1:  # its first slice (a sampling request's next ones find it running)
            self.store.futures.set_running(job.id)

    def _on_finish(self, job: Job) -> None:
        operation = job.operation
        if job.error is None:
            self.store.futures.finish(job.id, job.result)
        else:
            message, category = job.failure()
            if category == 'server':
                logger.error(f'request {job.id} ({operation}) failed: {job.error!r}')
            self.store.futures.fail(job.id, message, category)
        self.requests.labels(operation, job.status).inc()
        self._charge(job)
        if (seconds := job.duration_s) is not None:
            self.seconds.labels(operation).observe(seconds)  # its slices' time, without the other jobs' between them
            self.pass_jobs.labels(operation).observe(job.pass_size)
            self.slices.labels(operation).observe(job.slices)
        self.queued.set(self.queued_jobs())

    def _charge(self, job: Job) -> None:
        """Record what a finished job used: its share of its pass's seconds, and its meter's counts if it succeeded."""
        charged = self._meters.pop(job.id, None)
        if charged is None:
            return
        tenant, run_id, base_model, meter, admitted = charged
        self.ledger.settle(tenant, admitted)
        quantities = meter.quantities() if job.error is None else {}
        if (seconds := job.duration_s) is not None:
            quantities['compute_seconds'] = seconds / max(job.pass_size, 1)
        try:
            self.store.usage.add(tenant.id, run_id, meter.session_id, bare(base_model), quantities)
        except Exception as error:  # a closing store: the usage is lost, the answer is not
            logger.warning(f'the usage of request {job.id} was not recorded: {type(error).__name__}: {error}')
            return
        for kind, amount in quantities.items():
            if amount:
                self.usage.labels(*self._usage_labels(tenant, kind)).inc(amount)

    def _usage_labels(self, tenant: Tenant, kind: str) -> list[str]:
        """``twinkle_usage_total``'s labels: the tenant as ``metrics.tenant_label`` names it (or not at all)."""
        label = self.config.metrics.tenant_label
        return [kind] if label == 'none' else [tenant.name if label == 'name' else tenant.id, kind]

    # ---- runs -----------------------------------------------------------------------------------
    async def adapter_of(self, tenant: Tenant, run_id: str) -> Run:
        """A run of this tenant that is on its model or can be brought back; 404 otherwise.
        Jobs then call its group's ``loaded`` on the worker thread, where no release can slip in."""
        run = self.store.runs.get(tenant.id, run_id)
        if run is None or run.status == 'deleted':
            raise NotFoundError(f'training run {run_id!r} not found')
        group = self.group_of(run)
        if run_id not in group.adapters and await asyncio.to_thread(group.saved_state, run) is None:
            raise StateError(
                f'training run {run_id!r} is not loaded on the model (status {run.status!r}) and left no state '
                'to restore: create a run and load one of its checkpoints with load(path, load_optimizer=True)'
            )
        await self.touch(run_id)
        return run

    async def touch(self, run_id: str) -> None:
        """Record the run's last request; at most once a second, as each write syncs the disk. The
        write runs off the event loop; the requests in between skip the thread hop as well."""
        now = time.monotonic()
        if now - self._touched.get(run_id, -TOUCH_INTERVAL_S) >= TOUCH_INTERVAL_S:
            self._touched[run_id] = now
            await asyncio.to_thread(self.store.runs.touch, run_id)

    def remember_setup(self, run_id: str, operation: str, kwargs: dict[str, JsonValue]) -> None:
        """Record a configuration call, to replay when the adapter is brought back."""
        run = self.store.runs.by_id(run_id)
        if run is None:
            raise NotFoundError(f'training run {run_id!r} not found')
        config = dict(run.config)
        config['setup'] = [*config.get('setup', []), {'operation': operation, 'kwargs': kwargs}]
        self.store.runs.set_config(run_id, config)

    # ---- releasing idle adapters ----------------------------------------------------------------
    def release_all(self, timeout: float = 600.0) -> None:
        """Release every adapter of every group to disk, with the states released to host memory
        before (a graceful stop keeps them all): once the jobs queued before are done (they may
        bring runs back), so nothing is released to memory after."""
        for group in self.groups.values():
            group.scheduler.drain(timeout)
        for group in self.groups.values():
            for run_id in list(group.adapters):
                run = self.store.runs.by_id(run_id)
                if run is not None:
                    self._release_later(group, run, to_disk=True)
            group.scheduler.submit(HOUSEKEEPING, group.pool.spill_all, operation='release', internal=True)
        for group in self.groups.values():
            group.scheduler.drain(timeout)

    def release_idle(self) -> list[Job]:
        """Queue the release of every run idle longer than ``idle_release_s``."""
        if self.config.idle_release_s is None:
            return []
        jobs = []
        for run in self.store.runs.idle(self.config.idle_release_s):
            group = self.find_group(run.base_model)
            if group is not None and run.id in group.adapters:
                jobs.append(self._release_later(group, run))
        return jobs

    def _release_later(self, group: ModelGroup, run: Run, to_disk: bool = False) -> Job:
        tenant = Tenant(id=run.tenant_id, name='', created_at=0.0)
        return self.submit(tenant, group, run.id, 'release', partial(group.release, run, to_disk), internal=True)


__all__ = ['RELEASE_STATE', 'Service']
