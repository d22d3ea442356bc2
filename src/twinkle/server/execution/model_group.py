"""``ModelGroup``: one base model the service hosts, with what runs it.

A service hosts one or more base models (``base_model``, then ``more_models`` in the config).
Each is a group of its own: its host (the model, in the server's process or in a Ray actor),
its scheduler (one worker thread feeding that model, so passes of different models run at the
same time on their own devices), the runs with an adapter on its model, and the release and
restore of idle adapters. A run belongs to the group of its base model for its whole life;
the store records which.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar, cast

from tinker import types as tinker_types

from twinkle.data_format import SampleResponse, SamplingParams
from twinkle.errors import CapacityError, NotFoundError, QueueFullError, StateError
from twinkle.model import checkpoint as ckpt
from twinkle.server.config import ServerConfig
from twinkle.server.execution.chat import ChatReply, ChatRequest
from twinkle.server.execution.host import Host, Json, JsonObject, Outcome, SamplingHost
from twinkle.server.execution.model_host import is_mixable, request_tokens
from twinkle.server.execution.sampler_group import SamplerGroup, saved_weights
from twinkle.server.execution.scheduler import Batchable, Job, JobCallback, Scheduler
from twinkle.server.execution.tinker_codec import ForwardBackwardCall
from twinkle.server.store import TINKER_FOLDERS, Checkpoint, Run, Store
from twinkle.server.store.database import new_id
from twinkle.utils.logger import get_logger

logger = get_logger()
R = TypeVar('R')
#: Where a run's state is kept (at its release, and every ``save_state_every_steps`` steps), beside its checkpoints.
RELEASE_STATE = 'released-state'
#: The tenant the server's own chores are queued as.
HOUSEKEEPING = 'server-housekeeping'
#: Operations of both APIs that take an optimizer step: the runs' step history is recorded after them.
STEP_OPERATIONS = frozenset({'clip_grad_and_step', 'step', 'optim_step'})
#: The folder of each kind of checkpoint in a run's directory ('': the run's directory itself).
KIND_FOLDERS = {'training': '', 'sampler': TINKER_FOLDERS['sampler'], 'external': TINKER_FOLDERS['external']}
#: A checkpoint's folder: its name and the id of the row that records it (a name holds no '@').
CHECKPOINT_FOLDER = re.compile(r'(?P<name>[^@]+)@(?P<id>ckpt-[0-9a-f]+)')
#: The prefix of the scratch folder an export saves the adapter in before writing Tinker's layout.
EXPORT_SCRATCH = '.saving-'


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
        self.adapters: dict[str, str] = {}  # run id -> adapter name on the model
        self._pinned: set[str] = set()  # runs the worker's current jobs use: not released to make room
        self._running: list[Job] = []  # the jobs the worker runs now (one, or a shared pass)
        limits = config.limits
        self.scheduler = Scheduler(
            max_queued_per_tenant=limits.max_queued_per_tenant,
            on_start=self._started,
            on_finish=self._finished,
            max_tokens_per_pass=limits.max_tokens_per_pass,
            on_idle=None if config.release_memory_after_idle_s is None else lambda: on_idle(self),
            idle_after_s=config.release_memory_after_idle_s or 2.0,
            mix_wait_s=config.mix_wait_ms / 1000 if config.mixed_batches else 0.0,
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
        for run_id in self.adapters:
            self.store.runs.set_status(run_id, 'released')
        self.adapters.clear()
        self._pinned.clear()
        self.store.history.record_restart(self.name, reason)
        self._on_restart(self)

    def _finished(self, job: Job) -> None:
        self._pinned.clear()
        if job in self._running:
            self._running.remove(job)
        try:
            if job.error is None and job.operation in STEP_OPERATIONS:
                self._after_steps()  # before the future settles: its caller then finds the step recorded
        finally:
            self._on_finish(job)

    def _after_steps(self) -> None:
        """Each run's optimizer steps since the last record into the store (its step history), and
        the state of each run whose step count reached a multiple of ``save_state_every_steps``."""
        try:
            logs = self.host.take_step_logs()
        except Exception as error:  # a dead worker: the history misses these steps, nothing else
            logger.warning(f'the step history of {self.name!r} was not recorded: {type(error).__name__}: {error}')
            return
        every = self.config.save_state_every_steps
        runs = {adapter: run_id for run_id, adapter in self.adapters.items()}
        for adapter, steps in logs.items():
            run = self.store.runs.by_id(runs[adapter]) if adapter in runs else None
            if run is None:
                continue
            if every is not None and any(int(entry['step']) % every == 0 for entry in steps):
                self._keep_state_or_warn(run)  # first: a crash while it is written leaves the step unrecorded
            try:
                self.store.history.add_steps(run.id, steps)
            except Exception as error:  # a closing store: the history misses these steps, nothing else
                logger.warning(f'the step history of run {run.id!r} was not recorded: {type(error).__name__}: {error}')

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
        self.sampling_host.sample_request(inputs, sampling_params)

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

    def add_run(
        self,
        run: Run,
        lora: JsonObject,
        gradient_accumulation_steps: int = 1,
        seed: int | None = None,
        setup: list[tuple[str, JsonObject]] | None = None,
    ) -> str:
        """Put a new run's adapter on the model (worker thread), room made first, with its
        ``setup`` operations run on it; nothing of it stays if one fails. Its adapter's name."""
        adapter = self.adapter_name(run)
        self.make_room(run)
        self.host.add_adapter(adapter, lora, gradient_accumulation_steps, seed)
        try:
            for operation, kwargs in setup or []:
                self.host.run(adapter, operation, dict(kwargs))
            if self.config.save_state_every_steps is not None:
                self._keep_state(run, adapter)  # what it comes back as if a worker dies before its first save
        except BaseException:
            self.host.remove_adapter(adapter)
            raise
        self.adapters[run.id] = adapter
        return adapter

    def remove_run(self, run: Run) -> None:
        """Take a run's adapter off the model, if it is there (worker thread)."""
        adapter = self.adapters.pop(run.id, None)
        if adapter is not None:
            self.host.remove_adapter(adapter)

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
        folder = self.run_dir(run) / KIND_FOLDERS[kind] / f'{name}@{checkpoint_id}'
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

    def run_dir(self, run: Run) -> Path:
        """The folder of a run's checkpoints and saved state."""
        return self.config.checkpoint_dir / run.tenant_id / run.id

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
            self._keep_state_or_warn(run)

    def sample_weights(
        self, inputs: list[JsonObject], sampling_params: JsonObject | None, directory: Path | None, shown_as: str | None
    ) -> list[JsonObject]:
        """Sample the base model (``directory`` None) or saved weights, on the sampler if the model has one."""
        return self.sampling_host.sample_weights(inputs, sampling_params, saved_weights(directory, shown_as))

    def sample_ids(
        self, prompt: list[int], params: SamplingParams, directory: Path | None, shown_as: str | None
    ) -> SampleResponse:
        """Sample a prompt of token ids from the base model or saved weights, on the sampler if the
        model has one (worker thread)."""
        return self.sampling_host.sample_ids(prompt, params, saved_weights(directory, shown_as))

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

    # ---- the runs' adapters ----------------------------------------------------------------------
    def adapter_name(self, run: Run) -> str:
        """The name of a run's adapter on the model: its run id, unique on the server (the store
        makes it), so what the model's errors name is what the tenant knows. A tenant reaches an
        adapter only through its own runs, so naming another tenant's run reaches nothing."""
        return run.id

    def loaded(self, run: Run) -> str:
        """The run's adapter on the model, restored first if it was released (worker thread)."""
        if run.id not in self.adapters:
            self.restore(self._stored_run(run.id))
        self._pinned.add(run.id)
        return self.adapters[run.id]

    def _stored_run(self, run_id: str) -> Run:
        """The run as the store has it now (its latest config and status)."""
        run = self.store.runs.by_id(run_id)
        if run is None:
            raise NotFoundError(f'training run {run_id!r} not found')
        return run

    # ---- releasing idle adapters -----------------------------------------------------------------
    def release_state(self, run: Run) -> Path:
        return self.run_dir(run) / RELEASE_STATE

    def saved_state(self, run: Run) -> Path | None:
        """Where a run off the model continues from (``restore``); None if it has nothing."""
        found = self._saved_state(run)
        return None if found is None else found[0]

    def _saved_state(self, run: Run) -> tuple[Path, Checkpoint | None] | None:
        """The saved state of the run that stands at its latest optimizer step: its released state
        (written at each release, and every ``save_state_every_steps`` steps) or one of its training
        checkpoints (saved with ``save_optimizer=True``, or of weights alone: then the optimizer
        starts afresh); on a tie one with the optimizer, then the newest. With the checkpoint it is
        (None: the server's own). None if the run has none."""
        checkpoints = [c for c in self.store.checkpoints.of_run(run.tenant_id, run.id) if c.kind == 'training']
        places = [(self.release_state(run), None), *((Path(c.path), c) for c in checkpoints)]
        ranked: list[tuple[tuple[int, bool, int], Path, Checkpoint | None]] = []
        for path, checkpoint in places:
            if (path / ckpt.TRAINER_STATE).is_file():
                state = path / ckpt.TRAINER_STATE
                rank = (int(ckpt.read_trainer_state(path)['optim_step']), True, state.stat().st_mtime_ns)
            elif checkpoint is not None and (path / ckpt.ADAPTER_WEIGHTS).is_file():
                weights = path / ckpt.ADAPTER_WEIGHTS
                rank = (ckpt.read_weights_step(path), False, weights.stat().st_mtime_ns)
            else:
                continue
            ranked.append((rank, path, checkpoint))
        if not ranked:
            return None
        _, path, checkpoint = max(ranked, key=lambda place: place[0])
        return path, checkpoint

    def _keep_state(self, run: Run, adapter: str) -> None:
        """Save the run's state (weights, optimizer, counters, accumulation window) as its released
        state, the newest place ``restore`` brings it back from."""
        path = self.release_state(run)
        self.host.save(adapter, path.parent, path.name, save_optimizer=True)

    def _keep_state_or_warn(self, run: Run) -> None:
        adapter = self.adapters.get(run.id)
        if adapter is None:
            return
        try:
            self._keep_state(run, adapter)
        except Exception as error:  # a dead worker, a full disk: its next save or step tries again
            logger.warning(f'the state of run {run.id!r} was not saved: {type(error).__name__}: {error}')

    def release(self, run: Run) -> bool:
        """Save a run's adapter with its optimizer, counters and accumulation window (gradients
        waiting for a step included), then take it off the model (worker thread). A pending
        forward (``forward_only``, waiting for ``calculate_loss``) is not kept. False if the run
        was not on the model."""
        adapter = self.adapters.get(run.id)
        if adapter is None:
            return False
        self._keep_state(run, adapter)
        self.host.remove_adapter(adapter)
        del self.adapters[run.id]
        self.store.runs.set_status(run.id, 'released')
        return True

    def restore(self, run: Run) -> None:
        """Bring a released run back: its adapter, its setup calls replayed, then its saved state
        (``_saved_state``). A state older than the run's last recorded step, or weights alone,
        is recorded in its history (``History.record_restore``: what its ``restored_from`` says)."""
        adapter, config, found = self.adapter_name(run), run.config, self._saved_state(run)
        if found is None:
            raise StateError(
                f'training run {run.id!r} is not on the model and left no state to restore (the server stopped '
                'without saving it): load one of its checkpoints into a new run'
            )
        path, checkpoint = found
        self.make_room(run)
        self.host.add_adapter(adapter, config.get('lora', {}), config.get('gradient_accumulation_steps', 1))
        try:
            for call in config.get('setup', []):
                self.host.run(adapter, call['operation'], dict(call['kwargs']))
            shown = f'the saved state of training run {run.id!r}' if checkpoint is None else checkpoint.twinkle_path
            restored = self.host.restore_state(adapter, path, shown)
        except BaseException:
            self.host.remove_adapter(adapter)
            raise
        self.adapters[run.id] = adapter
        self.store.runs.set_status(run.id, 'active')
        source = None if checkpoint is None else checkpoint.twinkle_path
        event = self.store.history.record_restore(run.id, restored['optim_step'], source, restored['fresh_optimizer'])
        if event is not None:
            logger.warning(f'training run {run.id!r} came back with less than it had: {event}')

    # ---- room on the model -----------------------------------------------------------------------
    def make_room(self, run: Run) -> None:
        """Before ``run``'s adapter is added (worker thread): a tenant holding its
        ``max_adapters_per_tenant`` adapters gives up its least recently used one, and a model
        holding ``max_adapters`` one of a tenant holding more than an equal share of the pool
        (least recently used first; else the least recently used of all). A released adapter
        keeps all it held (gradients waiting for a step too) and comes back on its next request.
        Only adapters the running requests use stay: if every candidate is one, ``CapacityError``
        (429) with a Retry-After of when they are expected to end."""
        limits = self.config.limits
        own = self._held(run.tenant_id, but=run.id)
        if len(own) >= limits.max_adapters_per_tenant:
            why = f'you hold {len(own)} adapters on the model, the limit of max_adapters_per_tenant='
            self._release_one(own, f'{why}{limits.max_adapters_per_tenant}')
        everyone = self._held(None, but=run.id)
        if len(everyone) >= limits.max_adapters:
            why = f'the server holds its limit of {limits.max_adapters} adapters (max_adapters)'
            self._release_one(self._fairly(everyone, run.tenant_id), why)

    def _held(self, tenant_id: str | None, but: str | None = None) -> list[Run]:
        """Runs (of a tenant, or of all) with an adapter on this model, least recently used first."""
        return [run for run in self.store.runs.active(tenant_id) if run.id in self.adapters and run.id != but]

    def _fairly(self, runs: list[Run], asking: str) -> list[Run]:
        """``runs`` (least recently used first) in the order they give up their place: those of
        tenants holding more than an equal share of the pool (each tenant holding one, and the
        one asking, counted) first, so a few tenants cannot keep the others out."""
        held = Counter(run.tenant_id for run in runs)
        share = self.config.limits.max_adapters / len(held.keys() | {asking})
        return sorted(runs, key=lambda run: held[run.tenant_id] <= share)  # stable: least recently used first

    def _release_one(self, runs: list[Run], why: str) -> None:
        """Release the first of ``runs`` the running requests do not use; ``CapacityError`` if none."""
        if any(run.id not in self._pinned and self.release(run) for run in runs):
            return
        wait_s = self._running_left_s()
        raise CapacityError(
            f'{why}, and each is in use by the requests running now: retry once they end, in about {wait_s:.0f} s',
            retry_after_s=wait_s,
        )

    def _running_left_s(self) -> float:
        """Seconds until the running pass is expected to end (its jobs' mean duration so far), at least 1."""
        mean = self.scheduler.stats()['mean_duration_s'] or 0.0
        started = min((job.started_at for job in self._running if job.started_at is not None), default=time.time())
        return max(1.0, started + mean - time.time())


def discard_unrecorded(root: Path, recorded: set[str]) -> int:
    """At start: delete the checkpoint folders under ``root`` (``<name>@<id>`` in a run's
    directory, or its sampler or exported weights) that no row names: saves a crash cut short
    before their commit, and folders replaced just before one; and exports' scratch folders.
    How many there were."""
    gone = 0
    for run_dir in (path for tenant in _folders(root) for path in _folders(tenant)):
        for kind_dir in {run_dir / folder for folder in KIND_FOLDERS.values()}:
            for folder in _folders(kind_dir):
                unrecorded = CHECKPOINT_FOLDER.fullmatch(folder.name) and str(folder) not in recorded
                if unrecorded or folder.name.startswith(EXPORT_SCRATCH):
                    shutil.rmtree(folder, ignore_errors=True)
                    gone += 1
    return gone


def _folders(path: Path) -> list[Path]:
    return [child for child in path.iterdir() if child.is_dir()] if path.is_dir() else []


__all__ = ['EXPORT_SCRATCH', 'KIND_FOLDERS', 'RELEASE_STATE', 'ModelGroup', 'bare', 'discard_unrecorded']
