"""The execution layer of the training service: one worker thread, fair across tenants.

One model on one device serves many tenants, and the device runs one pass at a time. Every
compute request is accepted at once as a :class:`Job` and runs later on the single worker
thread, off the asyncio event loop, so health checks and other requests are answered meanwhile.

Fairness: jobs are queued per tenant and the worker takes them round-robin across the tenants
that have work. A tenant whose job is running re-enters the rotation only when that pass ends,
so a tenant with 100 queued jobs delays another tenant's single job by at most the pass already
running. Within a tenant, jobs run in submission order (a training loop's calls never reorder).
A failing job fails alone: its exception is recorded and the worker goes on. With ``weight_of``
the rotation is weighted (deficit round robin): a tenant of weight 2 leads two passes in a row
where one of weight 1 leads one, and one of weight 0.5 leads one every other round.

Mixing: a job may say it can share a pass (:class:`Batchable`). When the device becomes free,
the worker takes the job at the head of the rotation and, if it can share, the first waiting job
of each following tenant with the same ``key``, while the pass stays within ``max_tokens_per_pass``;
they run as one pass (each tenant's rows through its own adapter). Only the first waiting job of
a tenant is ever taken, so a tenant's order, and its optimizer steps between passes, hold; but jobs
whose ``Batchable.commutes`` (sampling on a sampler group: none changes what another computes) join
with the run of such jobs at the head of their tenant's queue, so one tenant's many requests share a pass.

Waiting for companions: tenants training in step with each other send their next requests
within a few milliseconds of one another, so the first to arrive would start alone on the idle
worker and the others wait a whole pass for it. With ``mix_wait_s`` the worker holds a job that
can share a pass until every tenant of the last two passes of its kind has a job for it, or
``mix_wait_s`` passed, whichever comes first, and only while no other kind of job waits (the
device never idles with work queued). Two passes, not one: a tenant that once missed a pass by a
few milliseconds would otherwise run alone one pass behind the others for good (each pass
expecting only the tenants of the last, measured: 7 + 1 jobs a step for 8 tenants in step).
A tenant alone never waits, and a tenant that stops sending costs the others two waits, after
which it is no longer expected. ``mix_wait_s=0`` starts every job at once.

Slices: a job whose ``fn`` returns :class:`Continue` gives the worker up before it is done (a long
sampling request, after each ``sampling_slice_ms``: ``execution/sampling/slicing.py``). It goes back to the head of its
tenant's queue, so its tenant's later jobs still run after it, and its tenant to the end of the
rotation, so every other tenant with work runs a pass before its next slice: another tenant's
training step waits for one slice, not the whole reply. A slice counts as a pass for the weights.

Sharing: jobs that ``shares(job)`` marks (sampling requests on one model's torch sampler, whose
rows all decode in one running batch) commute with one another. A paused one goes back behind its
tenant's next such jobs instead of in front of them, those not yet started first, so they start and
join the batch it is in (:meth:`Scheduler.joiners_waiting` tells a slice one waits); any other job
of the tenant still waits until all of them ended. Without this, a tenant's 32 requests at once
would run one after another: its next job waits for its paused one.

>>> scheduler = Scheduler()
>>> scheduler.start()
>>> job = scheduler.submit('alice', lambda: 1 + 1)
>>> job.wait(5), job.status, job.result
(True, 'done', 2)
>>> scheduler.stop()
[]
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

from twinkle.errors import ConfigurationError, QueueFullError, StateError, TwinkleError
from twinkle.utils.logger import get_logger

logger = get_logger()

JobStatus = Literal['pending', 'running', 'paused', 'done', 'failed']
JobCallback = Callable[['Job'], None]

# How many recent job durations the mean (and so ``retry_after_s``) is taken over.
_DURATION_WINDOW = 100


@dataclass(frozen=True, eq=False)
class Batchable:
    """How a job can share a pass with other tenants' jobs."""

    # Jobs with equal keys can run together (the same operation and collation).
    key: Hashable
    # The job's share of the pass's token budget.
    tokens: int
    # What ``run_many`` receives for this job (Any: each kind of pass has its own: a run and its
    # arguments, a run and a Tinker call, a run and Adam's parameters; only ``run_many`` reads it).
    payload: Any = field(repr=False)
    # Runs several jobs' payloads as one pass; one result per payload, in order. An exception
    # in place of a result fails that job alone. ``run_many`` may raise only before it changes
    # any state (the jobs are then run one by one with their own ``fn``).
    run_many: Callable[[list[Any]], list[Any]] = field(repr=False)
    # Whether jobs of this key commute with one another (sampling on a sampler group: none changes
    # what the others compute): then a tenant's waiting run of them joins the pass too, not only
    # its first job, so one tenant's many requests share a pass.
    commutes: bool = False


@dataclass(frozen=True, eq=False)
class Continue:
    """What a job's ``fn`` returns to give the worker up before it is done: the job waits at the
    head of its tenant's queue, and at its tenant's next turn ``then()`` runs (its result is the
    job's, or another ``Continue``). ``cancel()`` is called if the job fails instead of going on
    (the scheduler stopped): what the job holds between slices is let go."""

    then: Callable[[], Any] = field(repr=False)
    cancel: Callable[[], None] | None = field(default=None, repr=False)


@dataclass(eq=False)
class Job:
    """One unit of compute for one tenant; times are ``time.time()`` seconds."""

    id: str
    tenant: str
    fn: Callable[[], Any] = field(repr=False)
    # What the job does (``forward_backward``, ``save``...), for the metrics and the log.
    operation: str = 'unknown'
    # The training run it acts on (None: none, such as sampling a checkpoint).
    run_id: str | None = None
    submitted_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    # Any: what ``fn`` returned, which the route that queued the job reads as its own type.
    result: Any = field(default=None, repr=False)
    error: BaseException | None = None
    status: JobStatus = 'pending'
    # Slices the job started (1 unless its fn returned ``Continue``), and the seconds they ran.
    slices: int = 0
    ran_s: float = 0.0
    # Set when the job may share a pass with other tenants' jobs.
    batch: Batchable | None = field(default=None, repr=False)
    # Passes started before the job was submitted; the pass it ran in (numbered from 1) and how
    # many jobs that pass held.
    passes_before: int = 0
    pass_id: int | None = None
    pass_size: int = 0
    # Set once the job is settled (done or failed), after ``on_finish`` ran.
    done: threading.Event = field(default_factory=threading.Event, repr=False)
    _callbacks: list[JobCallback] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # When its running slice started, and what to call if it fails while paused.
    _slice_at: float = field(default=0.0, repr=False)
    _cancel: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def duration_s(self) -> float | None:
        """Seconds the job ran, once it finished: its slices' (not the other jobs' between them)."""
        return None if self.started_at is None or self.finished_at is None else self.ran_s

    def failure(self) -> tuple[str, str]:
        """What the job's future records of its error, and whose fault it was (``Futures.fail``):
        a ``TwinkleError``'s own words (the user's); any other error's text may name server paths,
        so the tenant gets the request id and the server's log the rest."""
        error = self.error
        if isinstance(error, TwinkleError):
            return f'{type(error).__name__}: {error}', 'user'
        return f'{type(error).__name__}: the server failed; its log has the details of request {self.id}', 'server'

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job is settled; False if ``timeout`` seconds passed first."""
        return self.done.wait(timeout)

    def add_done_callback(self, fn: JobCallback) -> None:
        """Call ``fn(job)`` once the job is settled, on the settling thread (at once if it already is)."""
        with self._lock:
            if not self.done.is_set():
                self._callbacks.append(fn)
                return
        _call_guarded(fn, self, 'done callback')

    def remove_done_callback(self, fn: JobCallback) -> None:
        """Forget ``fn`` if it has not been called yet."""
        with self._lock:
            if fn in self._callbacks:
                self._callbacks.remove(fn)

    def fail(self, error: BaseException) -> None:
        """Settle a job that will not run (e.g. one :meth:`Scheduler.stop` returned) as failed;
        a paused one's continuation is cancelled first."""
        cancel, self._cancel = self._cancel, None
        if cancel is not None:
            _call_guarded(lambda job: cancel(), self, 'cancel')
        self.error, self.status = error, 'failed'
        self.finished_at = time.time()
        self._settle()

    def _settle(self) -> None:
        with self._lock:
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            _call_guarded(fn, self, 'done callback')


def _call_guarded(fn: JobCallback, job: Job, what: str) -> None:
    """Run a callback on the worker's behalf: its exception is logged, never raised."""
    try:
        fn(job)
    except Exception:
        logger.exception(f'{what} {fn!r} raised for job {job.id!r} of tenant {job.tenant!r}')


class Scheduler:
    """Runs submitted jobs on one worker thread, round-robin across tenants, in order within one.

    ``on_start(job)`` and ``on_finish(job)`` are called on the worker thread right before a job
    runs and right after it ends (before ``job.done`` is set, so whoever waits on the job sees
    what ``on_finish`` recorded); for a job in slices, ``on_start`` before each slice,
    ``on_pause(job)`` after each but the last, and ``on_finish`` once, after the last.
    ``on_idle()`` is called there once the worker has had nothing to do for ``idle_after_s``
    seconds, then not again until a job has run. Their exceptions are logged and never stop the
    worker.
    """

    def __init__(
        self,
        max_queued_per_tenant: int = 64,
        on_start: JobCallback | None = None,
        on_finish: JobCallback | None = None,
        keep_finished: int = 10_000,
        max_tokens_per_pass: int = 16_384,
        on_idle: Callable[[], None] | None = None,
        idle_after_s: float = 2.0,
        mix_wait_s: float = 0.0,
        weight_of: Callable[[str], float] | None = None,
        on_pause: JobCallback | None = None,
        shares: Callable[[Job], bool] | None = None,
    ):
        if max_queued_per_tenant < 1:
            raise ConfigurationError(f'max_queued_per_tenant must be at least 1, got {max_queued_per_tenant}')
        if keep_finished < 0:
            raise ConfigurationError(f'keep_finished must be 0 or more, got {keep_finished}')
        if idle_after_s <= 0:
            raise ConfigurationError(f'idle_after_s must be positive, got {idle_after_s}')
        if mix_wait_s < 0:
            raise ConfigurationError(f'mix_wait_s must be 0 or more, got {mix_wait_s}')
        # Longest a job that can share a pass waits for the companions of its last two passes.
        self.mix_wait_s = mix_wait_s
        # The tenants of the last two passes of each kind: whom a pass of that kind waits for.
        self._members: dict[Hashable, deque[frozenset[str]]] = {}
        if max_tokens_per_pass < 1:
            raise ConfigurationError(f'max_tokens_per_pass must be at least 1, got {max_tokens_per_pass}')
        # Tokens several jobs may bring to one shared pass (a job alone may bring more).
        self.max_tokens_per_pass = max_tokens_per_pass
        # Jobs one tenant may have waiting (not counting its running one) before submit refuses.
        self.max_queued_per_tenant = max_queued_per_tenant
        self.on_start, self.on_finish, self.on_pause = on_start, on_finish, on_pause
        self.on_idle, self.idle_after_s = on_idle, idle_after_s
        self._idle_called = True  # nothing has run yet: nothing to clean up after
        # Finished jobs kept for get(); older ones are forgotten first.
        self.keep_finished = keep_finished
        self._cond = threading.Condition()
        self._queues: dict[str, deque[Job]] = {}
        # Tenants with queued work, in serving order; the running jobs' tenants are not in it.
        self._ring: deque[str] = deque()
        self._running: list[Job] = []
        self._passes = 0
        self._jobs: dict[str, Job] = {}
        self._finished_ids: deque[str] = deque()
        self._durations: deque[float] = deque(maxlen=_DURATION_WINDOW)
        self._completed = self._failed = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        # A tenant's share of the worker (None: all equal); with it, each tenant's credit of
        # requests in the current round (deficit round robin: ``_rotate_to_lead``).
        self.weight_of = weight_of
        self._credit: dict[str, float] = {}
        # Which jobs commute with one another within a tenant (None: none): ``_requeue``.
        self.shares = shares

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread; jobs submitted before this wait for it."""
        with self._cond:
            if self._stopping:
                raise StateError('This Scheduler was stopped; create a new one instead of restarting it')
            if self._thread is not None:
                raise StateError('This Scheduler is already started')
            self._thread = threading.Thread(target=self._work, name='twinkle-scheduler', daemon=True)
            self._thread.start()

    def stop(self, wait: bool = True) -> list[Job]:
        """Let the running job finish, then end the worker; return the queued jobs, still 'pending'
        (or 'paused': begun, in slices).

        The returned jobs are removed from the queues and will never run: the caller fails them
        (``job.fail(...)``) and tells their tenants. ``wait`` joins the worker thread first, and
        then returns a job the running slice paused as well.
        """
        with self._cond:
            self._stopping = True
            left = self._take_queued()
            self._cond.notify_all()
            thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()
            with self._cond:
                left += self._take_queued()
        return left

    def _take_queued(self) -> list[Job]:
        """With the lock held: every queued job, oldest first, out of the queues."""
        left = sorted((job for queue in self._queues.values() for job in queue), key=lambda job: job.submitted_at)
        self._queues.clear()
        self._ring.clear()
        return left

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running; False if ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._ring and not self._running, timeout)

    # -- requests ----------------------------------------------------------------------------

    def submit(
        self,
        tenant: str,
        fn: Callable[[], Any],
        job_id: str | None = None,
        batch: Batchable | None = None,
        operation: str = 'unknown',
        internal: bool = False,
        run_id: str | None = None,
    ) -> Job:
        """Queue ``fn`` for ``tenant`` and return its pending Job at once (thread-safe). With
        ``batch`` the job may instead run in a pass shared with other tenants' jobs.

        Raises QueueFullError when the tenant already has ``max_queued_per_tenant`` jobs waiting,
        unless the job is ``internal``: the server's own work on the tenant's behalf (releasing
        an idle adapter), which the tenant's requests must not crowd out.
        """
        job = Job(id=job_id or uuid.uuid4().hex, tenant=tenant, fn=fn, operation=operation, run_id=run_id, batch=batch)
        with self._cond:
            if self._stopping:
                raise StateError(f'The scheduler is stopped; job for tenant {tenant!r} was not accepted')
            if job.id in self._jobs:
                raise ConfigurationError(f'Job id {job.id!r} is already in use; pass a new id or none')
            queue = self._queues.setdefault(tenant, deque())
            if len(queue) >= self.max_queued_per_tenant and not internal:
                raise QueueFullError(tenant, self.max_queued_per_tenant, self._retry_after(len(queue)))
            queue.append(job)
            job.passes_before = self._passes
            self._jobs[job.id] = job
            if tenant not in self._ring and all(job.tenant != tenant for job in self._running):
                self._ring.append(tenant)
            self._cond.notify_all()
        return job

    def withdraw(self, select: Callable[[Job], bool]) -> list[Job]:
        """Take the jobs waiting that have not begun and ``select`` picks out of their queues, and
        return them, still 'pending': they will never run, and the caller fails them (a client
        gone, say). A job running, or begun and paused between slices, is left to finish."""
        with self._cond:
            taken: list[Job] = []
            for tenant, queue in list(self._queues.items()):
                picked = [job for job in queue if job.status == 'pending' and select(job)]
                if not picked:
                    continue
                taken += picked
                left = deque(job for job in queue if job not in picked)
                if left:
                    self._queues[tenant] = left
                    continue
                del self._queues[tenant]  # a tenant in the ring has work queued: it leaves the ring
                if tenant in self._ring:
                    self._ring.remove(tenant)
                    self._credit.pop(tenant, None)
            for job in taken:
                self._completed += 1
                self._failed += 1
                self._forget_old(job.id)
            self._cond.notify_all()
        return taken

    def busy(self) -> bool:
        """Whether a job is running or queued."""
        with self._cond:
            return bool(self._ring or self._running)

    def others_waiting(self, tenant: str) -> bool:
        """Whether a tenant other than ``tenant`` has a job queued: what a job in slices gives way to."""
        with self._cond:
            return any(other != tenant for other in self._ring)

    def joiners_waiting(self) -> bool:
        """Whether a job that shares (``shares``) and has not started waits where it runs before
        the tenant's other jobs: among the sharing jobs at the head of its tenant's queue."""
        if self.shares is None:
            return False
        with self._cond:
            for queue in self._queues.values():
                for job in queue:
                    if not self.shares(job):
                        break
                    if job.slices == 0:
                        return True
        return False

    def get(self, job_id: str) -> Job | None:
        """The job with this id: queued, running, or among the last ``keep_finished`` finished."""
        with self._cond:
            return self._jobs.get(job_id)

    def unsettled(self) -> list[Job]:
        """The jobs running or queued now (what must settle before a folder they may read goes)."""
        with self._cond:
            return [*self._running, *(job for queue in self._queues.values() for job in queue)]

    def queued(self, tenant: str | None = None) -> int:
        """Jobs waiting (not running) for ``tenant``, or for all tenants."""
        with self._cond:
            if tenant is not None:
                return len(self._queues.get(tenant, ()))
            return sum(len(queue) for queue in self._queues.values())

    def stats(self) -> dict[str, Any]:
        """Queued jobs per tenant, the running job id, finished counts and the recent mean duration."""
        with self._cond:
            return {
                'queued': {tenant: len(queue) for tenant, queue in self._queues.items() if queue},
                'running': [job.id for job in self._running],
                'passes': self._passes,
                'completed': self._completed,
                'failed': self._failed,
                'mean_duration_s': self._mean_duration(),
                'alive': self._thread is not None and self._thread.is_alive(),
            }

    # -- worker ------------------------------------------------------------------------------

    def _work(self) -> None:
        while jobs := self._next_pass():
            if len(jobs) == 1:
                self._run(jobs[0])
            else:
                self._run_shared(jobs)
            logger.debug(f'pass {jobs[0].pass_id} ran {1000 * (time.time() - (jobs[0].started_at or 0)):.1f} ms')
            self._retire(jobs)

    def _next_pass(self) -> list[Job]:
        """Block for work; the head of the rotation's first job and the jobs that can share its
        pass (empty once stopping). ``on_idle`` runs, outside the lock, if the wait is long."""
        while True:
            with self._cond:
                timeout = None if self._idle_called or self.on_idle is None else self.idle_after_s
                if self._cond.wait_for(lambda: self._stopping or self._ring, timeout):
                    self._rotate_to_lead()
                    self._wait_for_companions()
                    if not self._ring and not self._stopping:  # a withdraw emptied it during that wait
                        continue
                    self._rotate_to_lead()  # a no-op unless a withdraw took the head's jobs meanwhile
                    return self._take_pass()
                self._idle_called = True
            self._idle()

    def _idle(self) -> None:
        if self.on_idle is None:
            return
        try:
            self.on_idle()
        except Exception:
            logger.exception(f'on_idle {self.on_idle!r} raised')

    def _wait_for_companions(self) -> None:
        """With the lock held and work queued: if the head job can share a pass and no other
        kind of job waits, wait up to ``mix_wait_s`` until as many tenants have a job for it as
        the last two such passes held."""
        if self._stopping or self.mix_wait_s <= 0:
            return
        head = self._queues[self._ring[0]][0]
        if head.batch is None:
            return
        key = head.batch.key
        expected = len(frozenset().union(*self._members.get(key, ())))
        deadline = time.monotonic() + self.mix_wait_s
        # Wait only while the device would otherwise have nothing else to do.
        while not self._stopping and (sharing := self._sharing(key)) < expected and sharing == len(self._ring):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _sharing(self, key: Hashable) -> int:
        """Tenants whose next job could join a pass of ``key``."""
        return sum(1 for tenant in self._ring if (b := self._queues[tenant][0].batch) is not None and b.key == key)

    def _rotate_to_lead(self) -> None:
        """With the lock held and work queued: with weights, turn the ring until its head has a
        whole request of credit; each time a tenant comes to the head with less, its weight is
        added (deficit round robin: a tenant of weight 2 leads two passes in a row, one of 0.5
        every other round). Without weights the ring's order stands: plain round robin."""
        if self.weight_of is None or self._stopping:
            return
        while True:
            tenant = self._ring[0]
            credit = self._credit.get(tenant, 0.0)
            if credit < 1:
                credit += self.weight_of(tenant)
            self._credit[tenant] = credit
            if credit >= 1:
                return
            self._ring.rotate(-1)

    def _take_pass(self) -> list[Job]:
        """With the lock held: the next pass's jobs, marked running (empty once stopping)."""
        if self._stopping:
            return []
        lead = self._ring.popleft()
        if lead in self._credit:
            self._credit[lead] -= 1
        jobs = [self._queues[lead].popleft()]
        if jobs[0].batch is not None:
            tokens = [jobs[0].batch.tokens]
            jobs += self._commuting(self._queues[lead], jobs[0].batch, tokens)
            jobs += self._companions(jobs[0].batch, tokens)
            members = self._members.setdefault(jobs[0].batch.key, deque(maxlen=2))
            members.append(frozenset(job.tenant for job in jobs))
        self._passes += 1
        self._idle_called = False
        now = time.time()
        for job in jobs:
            job.status, job.pass_id, job.pass_size = 'running', self._passes, len(jobs)
            job.started_at, job._slice_at, job.slices = job.started_at or now, now, job.slices + 1
        self._running = jobs
        logger.debug(f'pass {self._passes}: {len(jobs)} {jobs[0].operation} job(s); {len(self._ring)} tenant(s) wait')
        return jobs

    def _companions(self, lead: Batchable, tokens: list[int]) -> list[Job]:
        """The first waiting job of each following tenant in the rotation that can share the
        lead's pass (with ``commutes``, the run of such jobs at the head of its queue), while the
        pass's tokens (``tokens[0]``, counted on) fit ``max_tokens_per_pass``; their tenants leave the ring."""
        taken = []
        for tenant in list(self._ring):
            queue = self._queues[tenant]
            head = queue[0]
            if head.batch is None or head.batch.key != lead.key:
                continue
            if tokens[0] + head.batch.tokens > self.max_tokens_per_pass:
                continue
            tokens[0] += head.batch.tokens
            taken.append(queue.popleft())
            taken += self._commuting(queue, lead, tokens)
            self._ring.remove(tenant)
        return taken

    def _commuting(self, queue: deque[Job], lead: Batchable, tokens: list[int]) -> list[Job]:
        """With ``lead.commutes``: the jobs of ``lead``'s key at the head of a tenant's ``queue``,
        while the pass's tokens fit (``tokens[0]``, counted on)."""
        taken: list[Job] = []
        while lead.commutes and queue and (batch := queue[0].batch) is not None and batch.key == lead.key:
            if tokens[0] + batch.tokens > self.max_tokens_per_pass:
                break
            tokens[0] += batch.tokens
            taken.append(queue.popleft())
        return taken

    def _run(self, job: Job) -> None:
        """Run one job and its callbacks; nothing it raises escapes."""
        if self.on_start is not None:
            _call_guarded(self.on_start, job, 'on_start')
        self._execute(job)
        self._finish(job)

    def _run_shared(self, jobs: list[Job]) -> None:
        """Run jobs as one pass. If the pass fails (one job's bad input, say, found before any
        gradient is touched), each job runs alone instead: the bad one fails alone."""
        for job in jobs:
            if self.on_start is not None:
                _call_guarded(self.on_start, job, 'on_start')
        batches = [job.batch for job in jobs if job.batch is not None]  # every job of a shared pass has one
        try:
            results = batches[0].run_many([batch.payload for batch in batches])
        except Exception as error:
            logger.info(f'a pass of {len(jobs)} jobs failed ({error!r}); running them one by one')
            for job in jobs:
                job.pass_size = 1
                self._execute(job)
                self._finish(job)
            return
        for job, result in zip(jobs, results, strict=True):
            if isinstance(result, BaseException):
                job.error, job.status = result, 'failed'
                logger.warning(f'Job {job.id!r} of tenant {job.tenant!r} failed in a shared pass: {result!r}')
            else:
                job.result, job.status = result, 'done'
            self._finish(job)

    def _execute(self, job: Job) -> None:
        try:
            result = job.fn()
            if isinstance(result, Continue):
                job.fn, job._cancel, job.status = result.then, result.cancel, 'paused'
            else:
                job.result, job.status, job._cancel = result, 'done', None
        except BaseException as error:  # the worker must outlive any job, SystemExit included
            job._cancel = None
            job.error, job.status = error, 'failed'
            logger.warning(f'Job {job.id!r} of tenant {job.tenant!r} failed: {error!r}')

    def _finish(self, job: Job) -> None:
        now = time.time()
        job.ran_s += now - job._slice_at
        if job.status == 'paused':  # back in its queue by ``_retire``; settled after its last slice
            if self.on_pause is not None:
                _call_guarded(self.on_pause, job, 'on_pause')
            return
        job.finished_at = now
        if self.on_finish is not None:
            _call_guarded(self.on_finish, job, 'on_finish')
        job._settle()

    def _retire(self, jobs: list[Job]) -> None:
        """Book the finished jobs and put their tenants back at the end of the rotation if they have more."""
        with self._cond:
            self._running = []
            for job in jobs:
                self._durations.append(time.time() - job._slice_at)  # a slice's: how long the worker was held
                if job.status == 'paused':  # its next slice is its tenant's next job, or a sharing one's
                    self._requeue(job)
                else:
                    self._completed += 1
                    self._failed += job.status == 'failed'
                    self._forget_old(job.id)
                if self._queues.get(job.tenant):
                    if job.tenant not in self._ring:  # a pass of commuting jobs holds several of a tenant
                        self._ring.append(job.tenant)
                else:
                    self._queues.pop(job.tenant, None)
                    self._credit.pop(job.tenant, None)  # a new round starts afresh
            lead = jobs[0].tenant
            if self._credit.get(lead, 0.0) >= 1 and self._queues.get(lead):  # its turn goes on
                self._ring.remove(lead)
                self._ring.appendleft(lead)
            self._cond.notify_all()

    def _requeue(self, job: Job) -> None:
        """With the lock held: a paused job back in its tenant's queue, at the head; one that shares
        behind the sharing jobs at the head, those not started first (so they can join it)."""
        queue = self._queues.setdefault(job.tenant, deque())
        if self.shares is None or not self.shares(job):
            queue.appendleft(job)
            return
        ahead: list[Job] = []
        while queue and self.shares(queue[0]):
            ahead.append(queue.popleft())
        fresh = [waiting for waiting in ahead if waiting.slices == 0]
        begun = [waiting for waiting in ahead if waiting.slices > 0]
        queue.extendleft(reversed([*fresh, *begun, job]))

    def _forget_old(self, finished_id: str) -> None:
        self._finished_ids.append(finished_id)
        while len(self._finished_ids) > self.keep_finished:
            self._jobs.pop(self._finished_ids.popleft(), None)

    def _mean_duration(self) -> float | None:
        return sum(self._durations) / len(self._durations) if self._durations else None

    def _retry_after(self, queued: int) -> float:
        """Seconds until a queue slot likely frees: queued jobs times the recent mean duration, at least 1."""
        return max(1.0, queued * (self._mean_duration() or 0.0))


async def wait_job(job: Job, timeout: float | None = None) -> bool:
    """Wait for ``job`` to settle without blocking the event loop; False if ``timeout`` passed first.

    The worker wakes the loop through a done callback, so a waiting request holds no thread
    (``asyncio.to_thread(job.done.wait)`` would hold one of the default executor's few).
    """
    if job.done.is_set():
        return True
    loop = asyncio.get_running_loop()
    settled: asyncio.Future[None] = loop.create_future()

    def wake(_: Job) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(_resolve, settled)

    job.add_done_callback(wake)
    try:
        await asyncio.wait([settled], timeout=timeout)
    finally:
        job.remove_done_callback(wake)
    return job.done.is_set()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
