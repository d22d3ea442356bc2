"""``ModelGroup``: one base model the service hosts, with what runs it.

A service hosts one or more base models (``base_model``, then ``more_models`` in the config).
Each is a group of its own: its host (the model, in the server's process or in a Ray actor),
its scheduler (one worker thread feeding that model, so passes of different models run at the
same time on their own devices), the runs with an adapter on its model, and the release and
restore of idle adapters. A run belongs to the group of its base model for its whole life;
the store records which.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar, cast

from tinker import types as tinker_types
from typing_extensions import Unpack

from twinkle.data_format import SampleResponse, SamplingParams
from twinkle.errors import LostWorkError, QueueFullError, StateError
from twinkle.model.checkpoint import files as ckpt
from twinkle.server.config import ServerConfig
from twinkle.server.execution.checks.images import Images, RowImages
from twinkle.server.execution.groups.adapter_pool import AdapterOptions, AdapterPool
from twinkle.server.execution.groups.run_files import KIND_FOLDERS, RELEASE_STATE, run_dir
from twinkle.server.execution.groups.sampler_group import SamplerGroup, saved_weights
from twinkle.server.execution.host import Host, Json, JsonObject, Outcome, SamplingHost
from twinkle.server.execution.hosts.model_host import ModelHost, is_mixable, request_tokens
from twinkle.server.execution.hosts.multi_rank import MultiRankHost
from twinkle.server.execution.sampling import slicing
from twinkle.server.execution.sampling.chat import ChatReply, ChatRequest
from twinkle.server.execution.sampling.vllm import VllmSamplerHost
from twinkle.server.execution.scheduling.scheduler import Batchable, Job, JobCallback, Scheduler
from twinkle.server.execution.tinker.codec import ForwardBackwardCall
from twinkle.server.store import Checkpoint, Run, Store
from twinkle.server.store.database import new_id
from twinkle.utils.logger import get_logger

logger = get_logger()
R = TypeVar('R')
#: The tenant the server's own chores are queued as.
HOUSEKEEPING = 'server-housekeeping'
#: Operations of both APIs that take an optimizer step: the runs' step history is recorded after them.
STEP_OPERATIONS = frozenset({'clip_grad_and_step', 'step', 'optim_step'})
#: Operations of every API that sample (native and Tinker ``sample``, OpenAI's chats and completions):
#: they run in slices (``ModelGroup.sliced``).
SAMPLING_OPERATIONS = frozenset({'sample', 'chat_completion', 'completion'})
#: A sampling request as the sampling host's method to call (``sample_weights``, ``sample_ids``) and its arguments.
SampleCall = tuple[str, tuple[object, ...]]


def weighted(config: ServerConfig) -> bool:
    """Whether any tenant's share of a worker differs from another's (``Quota.weight``)."""
    quotas = config.quotas
    return any(quota.weight != 1.0 for quota in (quotas.default, *quotas.tenants.values()))


def bare(model_id: str) -> str:
    """A model id without its hub scheme: ``ms://Qwen/Qwen3-4B`` -> ``Qwen/Qwen3-4B``."""
    for scheme in ('ms://', 'hf://'):
        if model_id.startswith(scheme):
            return model_id[len(scheme) :]
    return model_id


class ModelGroup:
    """A hosted base model: its host, its scheduler and the adapters on it.

    ``on_start`` and ``on_finish`` are the service's bookkeeping of every job (the store's
    futures, the metrics); ``on_idle(group)`` runs once its worker has been idle a while
    (``release_memory_after_idle_s``).
    """

    def __init__(
        self,
        config: ServerConfig,
        store: Store,
        host: Host,
        on_start: JobCallback,
        on_finish: JobCallback,
        on_idle: Callable[[ModelGroup], None],
        on_restart: Callable[[ModelGroup], None] = lambda group: None,
        sampler: SamplerGroup | None = None,
    ):
        self.name = config.base_model  # as the config names it, and the store records it
        self.config, self.store, self.host = config, store, host
        self._on_start, self._on_finish, self._on_restart = on_start, on_finish, on_restart
        #: Its sampler on devices of its own, or None: sampling runs on this group's worker.
        self.sampler = sampler
        self._running: list[Job] = []  # the jobs the worker runs now (one, or a shared pass)
        #: The runs each paused job (a sampling request between two slices) uses: kept pinned meanwhile.
        self._held_pins: dict[str, set[str]] = {}
        #: Optimizer steps the host logged whose run's step job has not settled yet, by adapter (a
        #: shared pass steps several runs; each job records its own run's).
        self._step_logs: dict[str, list[dict[str, float]]] = {}
        #: The runs with an adapter on the model: released when idle or to make room, restored on use.
        self.pool = AdapterPool(config, store, host, self._running_left_s)
        limits = config.limits
        self.scheduler = Scheduler(
            max_queued_per_tenant=limits.max_queued_per_tenant,
            on_start=self._started,
            on_finish=self._finished,
            on_pause=self._paused,
            max_tokens_per_pass=limits.max_tokens_per_pass,
            on_idle=None if config.release_memory_after_idle_s is None else lambda: on_idle(self),
            idle_after_s=config.release_memory_after_idle_s or 2.0,
            mix_wait_s=config.mix_wait_ms / 1000 if config.mixed_batches else 0.0,
            weight_of=self._weight if weighted(config) else None,
            shares=self._shares,
        )

    def answers_to(self, name: str | None) -> bool:
        """Whether a client naming ``name`` means this model: its id as configured, without its
        ``ms://`` or ``hf://`` scheme, or the directory it was loaded from."""
        return name in {self.name, bare(self.name), self.host.model_id}

    # ---- where a request runs --------------------------------------------------------------------
    @property
    def schedulers(self) -> list[Scheduler]:
        """The worker threads of this model: its own, and its sampler's."""
        return [self.scheduler] if self.sampler is None else [self.scheduler, self.sampler.scheduler]

    def scheduler_for(self, operation: str) -> Scheduler:
        """The worker a request runs on: a sampling request on the sampler's, if there is one."""
        return self.sampler.scheduler if self.sampler is not None and operation == 'sample' else self.scheduler

    @property
    def sampling_host(self) -> SamplingHost:
        """The host that samples: the sampler group's, else the model's own."""
        return self.host if self.sampler is None else self.sampler.host

    def sliced(self, operation: str, fn: Callable[[], object], tenant_id: str) -> Callable[[], object]:
        """``fn`` as ``tenant_id``'s job of ``operation``: a sampling request whose sampler this
        process drives (the torch sampler of this model's worker, or a vLLM engine: ``sampler: vllm``,
        or a sampler group of its own on vLLM) in slices of ``sampling_slice_ms`` (each longer while
        no other tenant's job waits, and cut short when a sampling job waits to join its batch); on
        the torch sampler for at most ``max_sampling_s`` of worker time (``slicing.sliced``). Any other
        job as it is: a sampler group on worker processes, a model in worker processes or a Ray actor
        sample a request whole."""
        if not self._samples_in_slices(operation):
            return fn
        scheduler = self.scheduler_for(operation)
        slice_ms, limit_s = self.config.sampling_slice_ms, self.config.limits.max_sampling_s
        contended = partial(scheduler.others_waiting, tenant_id)
        slice_s = None if slice_ms is None else slice_ms / 1000
        return slicing.sliced(fn, slice_s, limit_s, contended, scheduler.joiners_waiting)

    def _samples_in_slices(self, operation: str) -> bool:
        """Whether a job of ``operation`` samples with a sampler this process drives, one batch for
        every request in flight: the torch sampler of this group's worker, or a vLLM engine (this
        group's, or its sampler group's)."""
        if operation not in SAMPLING_OPERATIONS:
            return False
        if self.sampler is not None:
            return isinstance(self.sampler.host, VllmSamplerHost)
        return isinstance(self.host, ModelHost)

    def _shares(self, job: Job) -> bool:
        """Whether ``job`` may pass its tenant's other sampling jobs (``Scheduler.shares``): they all
        add their rows to one batch, and none changes the weights the others sample."""
        return self._samples_in_slices(job.operation)

    def _started(self, job: Job) -> None:
        self._revive()
        self._running.append(job)
        self._on_start(job)

    def _revive(self) -> None:
        """Before a job (worker thread): a model whose worker process died starts again. Its
        adapters died with it: their runs are marked released and come back, on their next
        request, from their last saved or released state (``restore``)."""
        reason = self.host.restart_if_dead()
        if reason is None:
            return
        self.pool.forget_all()
        self._step_logs.clear()  # the dead worker's
        self.store.history.record_restart(self.name, reason)
        self._on_restart(self)

    def _paused(self, job: Job) -> None:
        """After a slice of a job that goes on: the runs it pinned stay pinned until its last slice,
        so no other tenant's restore releases them between its slices to make room."""
        others = set().union(*(held for job_id, held in self._held_pins.items() if job_id != job.id))
        self._held_pins[job.id] = self._held_pins.get(job.id, set()) | (self.pool.pinned - others)
        self._unpin()
        if job in self._running:
            self._running.remove(job)

    def _unpin(self) -> None:
        """The worker's jobs ended: no adapter is in use but the paused jobs'."""
        self.pool.unpin_all()
        self.pool.pinned.update(*self._held_pins.values())

    def _finished(self, job: Job) -> None:
        self._held_pins.pop(job.id, None)
        self._unpin()
        if job in self._running:
            self._running.remove(job)
        try:
            if job.error is None and job.operation in STEP_OPERATIONS and job.run_id is not None:
                self._after_step(job, job.run_id)  # before the future settles: its caller then finds the step recorded
            elif isinstance(job.error, LostWorkError):
                self.pool.told(job.error.run_id, lambda: self.store.futures.fail(job.id, *job.failure()))
        finally:
            self._on_finish(job)

    def _after_step(self, job: Job, run_id: str) -> None:
        """A step job of ``run_id`` succeeded: its optimizer steps go into the run's step history,
        and the run's state is kept when its step count reached a multiple of ``save_state_every_steps``,
        both in the transaction that settles the job's future, so a step a client was told of is a step
        its run comes back with."""
        try:
            for name, logged in self.host.take_step_logs().items():
                self._step_logs.setdefault(name, []).extend(logged)
        except Exception as error:  # a dead worker: the history misses these steps, nothing else
            logger.warning(f'the step history of {self.name!r} was not recorded: {type(error).__name__}: {error}')
        run = self.store.runs.by_id(run_id)
        adapter = self.adapters.get(run_id)
        steps = [] if adapter is None else self._step_logs.pop(adapter, [])
        if run is None:
            return

        def settle() -> None:
            if steps:
                self.store.history.add_steps(run_id, steps)
            self.store.futures.finish(job.id, job.result)

        every = self.config.save_state_every_steps
        try:
            if every is not None and any(int(entry['step']) % every == 0 for entry in steps):
                self.pool.keep_state_or_warn(run, commit=settle)
            else:
                with self.store.transaction():
                    settle()
        except Exception as error:  # a closing store: the answer settles as it would have (``on_finish``)
            logger.warning(f'the step history of run {run_id!r} was not recorded: {type(error).__name__}: {error}')

    # ---- passes shared by tenants ----------------------------------------------------------------
    def mixable(self, run: Run, operation: str, kwargs: JsonObject) -> Batchable | None:
        """How a native ``forward_backward`` / ``forward_only`` request can share a pass with
        other tenants', and a ``clip_grad_and_step`` their optimizer update (None for other
        operations, micro-batched ones, and the base model alone)."""
        if not self.config.mixed_batches or not is_mixable(operation, kwargs):
            return None
        stepping = operation == 'clip_grad_and_step'

        def run_many(payloads: list[tuple[Run, JsonObject]]) -> list[Outcome]:
            requests = [(self.loaded(run), kwargs) for run, kwargs in payloads]
            if stepping:
                return self.host.run_steps(requests)  # by name: a RankHost runs its own (its share)
            return self.host.run_mixed(operation, requests)

        tokens = 0 if stepping else request_tokens(kwargs['inputs'])
        return Batchable(('native', operation), tokens, (run, kwargs), run_many)

    def tinker_mixable(self, run: Run, call: ForwardBackwardCall) -> Batchable | None:
        """How a Tinker ``forward_backward`` (or ``forward``) call can share a pass with other
        models' (each result the ``ForwardBackwardOutput`` protobuf, or that call's error)."""
        if not self.config.mixed_batches:
            return None

        def run_many(payloads: list[tuple[Run, ForwardBackwardCall]]) -> list[bytes | Exception]:
            return list(self.host.tinker_forward_backward([(self.loaded(run), call) for run, call in payloads]))

        tokens = sum(len(datum.tokens) for datum in call.data)
        return Batchable(('tinker', call.forward_only), tokens, (run, call), run_many)

    def tinker_steppable(self, run: Run, params: tinker_types.AdamParams) -> Batchable | None:
        """How a Tinker ``optim_step`` can share one optimizer update with other models' steps."""
        if not self.config.mixed_batches:
            return None

        def run_many(payloads: list[tuple[Run, tinker_types.AdamParams]]) -> list[Outcome]:
            return self.host.tinker_optim_step([(self.loaded(run), params) for run, params in payloads])

        return Batchable(('tinker', 'optim_step'), 0, (run, params), run_many)

    # ---- what the routes ask of the model -----------------------------------------------------------
    # Checks need the model's shape only: they run where the routes do. The rest runs on the worker
    # thread (in a job): a run's adapter is restored first if it was released (``loaded``).
    @property
    def context(self) -> int | None:
        """The model's context length in tokens (None: not known)."""
        return self.host.context

    def check_lora(self, lora: JsonObject) -> None:
        self.host.check_adapter(lora)

    def validate(self, operation: str, kwargs: JsonObject) -> None:
        """Names, token ids, sizes of a request: a 4xx before it is queued, not a failed future."""
        self.host.validate(operation, kwargs)

    def check_sample_request(self, inputs: list[JsonObject], sampling_params: JsonObject | None) -> None:
        self.sampling_host.sample_request(inputs, sampling_params, decode=False)

    def check_images(self, rows: Sequence[RowImages], sampling: bool = False) -> None:
        """A Tinker request's images (its datums', or with ``sampling`` its prompt's, on the host that
        samples), as the native ones are checked: ``RequestChecks.check_images``."""
        (self.sampling_host if sampling else self.host).check_images(rows)

    def check_sampling_params(self, params: SamplingParams) -> None:
        self.sampling_host.check_sampling_params(params)

    @property
    def architecture(self) -> str | None:
        return self.host.architecture

    @property
    def model_id(self) -> str:
        """The model as its host loaded it: its hub id, or the local directory it was read from."""
        return self.host.model_id

    def lora_targets(self, attn: bool, mlp: bool, unembed: bool) -> list[str]:
        return self.host.lora_targets(attn, mlp, unembed)

    def expert_targets(self) -> list[str]:
        return self.host.expert_targets()

    def add_run(self, run: Run, lora: JsonObject, **options: Unpack[AdapterOptions]) -> str:
        """Put a new run's adapter on the model (worker thread; ``AdapterPool.add``)."""
        return self.pool.add(run, lora, **options)

    def _weight(self, tenant_id: str) -> float:
        """A tenant's share of the worker (``Quota.weight``), by the name the config gives it."""
        name = self.store.tenants.name_of(tenant_id)
        return self.config.quotas.of(name).weight if name is not None else 1.0

    def remove_run(self, run: Run) -> None:
        """Take a run's adapter off the model, if it is there (worker thread)."""
        self.pool.remove(run)

    def delete_run(self, run: Run) -> None:
        """A tenant deletes a run (worker thread): its adapter off the model, its state the server
        kept (released, and saved every few steps) gone, the run marked deleted. Its checkpoints
        stay, each deleted on its own."""
        self.pool.remove(run)
        self.store.runs.set_status(run.id, 'deleted')
        shutil.rmtree(run_dir(self.config, run) / RELEASE_STATE, ignore_errors=True)  # an older server's

    # ---- the runs' adapters (``AdapterPool``) -------------------------------------------------------
    @property
    def adapters(self) -> dict[str, str]:
        """Run id -> the name of its adapter on the model, for the runs on it now."""
        return self.pool.adapters

    def loaded(self, run: Run) -> str:
        """The run's adapter on the model, restored first if it was released (worker thread)."""
        return self.pool.loaded(run)

    def saved_state(self, run: Run) -> Path | None:
        """Where a run off the model continues from; None if it has nothing."""
        return self.pool.saved_state(run)

    def release(self, run: Run, to_disk: bool = False) -> bool:
        """Save a run's whole state, in host memory or ``to_disk``, and take its adapter off the
        model (worker thread)."""
        return self.pool.release(run, to_disk)

    def run(self, run: Run, operation: str, kwargs: JsonObject) -> Json:
        """A tenant's ``operation`` on its run's adapter (worker thread); the result is JSON-ready."""
        return self.host.run(self.loaded(run), operation, kwargs)

    def save(self, run: Run, directory: Path, name: str, save_optimizer: bool) -> Path:
        """Save the run's adapter as ``directory/name`` (worker thread), recording nothing; the folder."""
        return Path(self.host.save(self.loaded(run), directory, name, save_optimizer))

    def save_checkpoint(
        self,
        run: Run,
        kind: str,
        name: str,
        answer: Callable[[Checkpoint], R],
        *,
        save_optimizer: bool,
        expires_at: float | None = None,
    ) -> R:
        """Save the run's adapter as its checkpoint ``name`` of ``kind`` (worker thread; see
        ``record_checkpoint``), with its optimizer state if ``save_optimizer``."""

        def write(folder: Path) -> None:
            self.save(run, folder.parent, folder.name, save_optimizer)

        return self.record_checkpoint(run, kind, name, write, answer, expires_at=expires_at)

    def record_checkpoint(
        self,
        run: Run,
        kind: str,
        name: str,
        write: Callable[[Path], None],
        answer: Callable[[Checkpoint], R],
        *,
        expires_at: float | None = None,
    ) -> R:
        """Write a checkpoint of the run and record it under ``name`` (worker thread); what
        ``answer(checkpoint)`` makes of it is the request's result.

        The store's row is the one commit point: ``write(folder)`` fills a folder of this save's
        own (``<name>@<checkpoint id>``, beside the run's other checkpoints of ``kind``), never
        one a row names; then one transaction replaces the name's row and settles the save's
        future with the answer (whatever ``answer`` writes to the store joins it). Only then is
        the folder it replaced deleted, once the requests queued before have finished (one of
        them may read it). A crash before the commit leaves the old row, its folder, and a failed
        future; after it, the new ones: the client is told what the name holds. A folder no row
        names is deleted at the next start (``discard_unrecorded``)."""
        checkpoint_id = new_id('ckpt')
        folder = run_dir(self.config, run) / KIND_FOLDERS[kind] / f'{name}@{checkpoint_id}'
        write(folder)
        settling = self._running[0].id if len(self._running) == 1 else None  # the save's future
        try:
            size = ckpt.folder_size(folder)
            with self.store.transaction():
                checkpoint, replaced = self.store.checkpoints.add(
                    run.tenant_id, run.id, name, str(folder), kind, size, expires_at=expires_at,
                    checkpoint_id=checkpoint_id,
                )  # fmt: skip
                result = answer(checkpoint)
                if settling is not None:
                    self.store.futures.finish(settling, result)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if replaced is not None and Path(replaced.path) != folder:
            self.discard_later([Path(replaced.path)])
        return result

    def discard_later(self, folders: list[Path]) -> None:
        """Delete checkpoint folders no row names any more, once every job queued or running now
        on this model's workers has settled (a request accepted before may have read their path),
        and unload their weights where sampling loaded them."""
        jobs = [job for scheduler in self.schedulers for job in scheduler.unsettled()]
        left, lock = [len(jobs)], threading.Lock()

        def settled(_: Job) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._discard(folders)

        if not jobs:
            self._discard(folders)
        for job in jobs:
            job.add_done_callback(settled)

    def _discard(self, folders: list[Path]) -> None:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        try:
            self.unload_saved_weights(folders)
        except (QueueFullError, StateError) as error:  # stopping, or flooded: evicted in time
            logger.info(f'replaced checkpoints stay loaded for sampling until evicted: {error}')

    def load(self, run: Run, path: Path, load_optimizer: bool, shown_as: str) -> None:
        """Load a checkpoint into the run's adapter (worker thread); errors name ``shown_as``. The
        run's state is kept then (as after ``save_state_every_steps`` steps): a worker's death
        brings it back with the weights it loaded."""
        self.host.load(self.loaded(run), path, load_optimizer, shown_as)
        if self.config.save_state_every_steps is not None:
            self.pool.keep_state_or_warn(run)

    def sample_weights(
        self, inputs: list[JsonObject], sampling_params: JsonObject | None, directory: Path | None, shown_as: str | None
    ) -> list[JsonObject]:
        """Sample the base model (``directory`` None) or saved weights, on the sampler if the model has one."""
        return self.sampling_host.sample_weights(inputs, sampling_params, saved_weights(directory, shown_as))

    def sample_ids(
        self,
        prompt: list[int],
        params: SamplingParams,
        directory: Path | None,
        shown_as: str | None,
        images: Images = (),
    ) -> SampleResponse:
        """Sample a prompt of token ids (with its image chunks) from the base model or saved
        weights, on the sampler if the model has one (worker thread)."""
        return self.sampling_host.sample_ids(prompt, params, saved_weights(directory, shown_as), images)

    def sampling_job(
        self, call: Callable[[], SampleCall], finish: Callable[[R], object], tokens: int
    ) -> tuple[Callable[[], object], Batchable | None]:
        """A sampling request's job, and how it joins a pass: ``call()`` (on the worker thread) names
        the sampling host's method, ``sample_weights`` or ``sample_ids``, and its arguments; ``finish``
        makes the job's result of what it returns. On a sampler group in worker processes the waiting
        requests, of one tenant and of several, run as one pass of at most ``max_tokens_per_pass``
        ``tokens`` (each request's prompt and sampled tokens), decoded as one batch there
        (``sampling/passes.py``); elsewhere the sampler in this process batches them itself (None)."""

        def fn() -> object:
            name, args = call()
            return finish(cast(R, getattr(self.sampling_host, name)(*args)))

        if self.sampler is None or not isinstance(self.sampler.host, MultiRankHost):
            return fn, None
        host = self.sampler.host

        def run_many(payloads: list[tuple[Callable[[], SampleCall], Callable[[R], object]]]) -> list[object]:
            made = [_outcome(call) for call, _ in payloads]
            sampled = iter(host.sample_many([m for m in made if not isinstance(m, Exception)]))
            results: list[object] = []
            for (_, done), m in zip(payloads, made, strict=True):
                outcome = m if isinstance(m, Exception) else next(sampled)
                results.append(outcome if isinstance(outcome, Exception) else _outcome(partial(done, cast(R, outcome))))
            return results

        return fn, Batchable(('sample',), tokens, (call, finish), run_many, commutes=True)

    def sample_chat(self, request: ChatRequest) -> ChatReply:
        """An OpenAI-style completion of the base model or saved weights (worker thread)."""
        return self.host.sample_chat(request)

    def tinker_forward_backward(self, run: Run, call: ForwardBackwardCall) -> bytes:
        """A Tinker ``forward_backward`` (or ``forward``) call alone (worker thread): its output protobuf."""
        (output,) = self.host.tinker_forward_backward([(self.loaded(run), call)])
        if isinstance(output, Exception):
            raise output
        return output

    def tinker_optim_step(self, run: Run, params: tinker_types.AdamParams) -> JsonObject:
        """A Tinker ``optim_step`` alone (worker thread): its metrics."""
        (result,) = self.host.tinker_optim_step([(self.loaded(run), params)])
        if isinstance(result, Exception):
            raise result
        return cast(JsonObject, result)

    def unload_saved_weights(self, directories: list[Path]) -> None:
        """Queue a chore on each worker (the model's, and its sampler group's) that unloads these
        folders' weights where it loaded them for sampling (their checkpoints were deleted or
        replaced); on the worker thread, no sampling job is using them."""
        hosts: list[tuple[Scheduler, SamplingHost]] = [(self.scheduler, self.host)]
        if self.sampler is not None:
            hosts.append((self.sampler.scheduler, self.sampler.host))
        for scheduler, host in hosts:

            def forget(host: SamplingHost = host) -> None:
                for directory in directories:
                    host.forget_sampler_weights(directory)

            scheduler.submit(HOUSEKEEPING, forget, operation='forget_sampler_weights')

    def queued(self, tenant_id: str) -> int:
        """The tenant's requests waiting for this model's worker (its sampler's not counted)."""
        return self.scheduler.queued(tenant_id)

    def release_free_memory(self) -> bool:
        """Give the model process's free heap pages back to the OS (worker thread, when idle)."""
        return self.host.release_free_memory()

    def _running_left_s(self) -> float:
        """Seconds until the running pass is expected to end (its jobs' mean duration so far), at least 1."""
        mean = self.scheduler.stats()['mean_duration_s'] or 0.0
        started = min((job.started_at for job in self._running if job.started_at is not None), default=time.time())
        return max(1.0, started + mean - time.time())


def sampling_tokens(prompts: list[JsonObject], params: SamplingParams) -> int:
    """A sampling request's tokens for a pass's budget: its prompts' token ids (a ``messages``
    prompt, not encoded yet, counts none) and the tokens it may sample."""
    prompt_tokens = sum(len(cast(list[int], prompt.get('input_ids') or ())) for prompt in prompts)
    return prompt_tokens + len(prompts) * params.num_samples * params.max_tokens


def _outcome(call: Callable[[], R]) -> R | Exception:
    """``call()``, or the error it raised (a pass's request fails alone)."""
    try:
        return call()
    except Exception as error:
        return error


__all__ = ['HOUSEKEEPING', 'ModelGroup', 'SampleCall', 'bare', 'sampling_tokens']
