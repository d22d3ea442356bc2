"""``ModelGroup``: one base model the service hosts, with what runs it.

A service hosts one or more base models (``base_model``, then ``more_models`` in the config).
Each is a group of its own: its host (the model, in the server's process or in a Ray actor),
its scheduler (one worker thread feeding that model, so passes of different models run at the
same time on their own devices), the runs with an adapter on its model, and the release and
restore of idle adapters. A run belongs to the group of its base model for its whole life;
the store records which.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

from tinker import types as tinker_types

from twinkle.data_format import SampleResponse, SamplingParams
from twinkle.errors import CapacityError, NotFoundError, StateError
from twinkle.server.config import ServerConfig
from twinkle.server.execution.chat import ChatReply, ChatRequest
from twinkle.server.execution.host import Host, Json, JsonObject, Outcome, SamplingHost
from twinkle.server.execution.model_host import is_mixable, request_tokens
from twinkle.server.execution.sampler_group import SamplerGroup, saved_weights
from twinkle.server.execution.scheduler import Batchable, Job, JobCallback, Scheduler
from twinkle.server.execution.tinker_codec import ForwardBackwardCall
from twinkle.server.store import Run, Store
from twinkle.utils.logger import get_logger

#: Where a released adapter's state is kept, beside the run's checkpoints.
logger = get_logger()
RELEASE_STATE = 'released-state'
#: Operations of both APIs that take an optimizer step: the runs' step history is recorded after them.
#: The tenant the server's own chores are queued as.
HOUSEKEEPING = 'server-housekeeping'
STEP_OPERATIONS = frozenset({'clip_grad_and_step', 'step', 'optim_step'})


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
        try:
            if job.error is None and job.operation in STEP_OPERATIONS:
                self._record_steps()  # before the future settles: its caller then finds the step recorded
        finally:
            self._on_finish(job)

    def _record_steps(self) -> None:
        """Each run's optimizer steps since the last record into the store (its step history)."""
        try:
            logs = self.host.take_step_logs()
            runs = {adapter: run_id for run_id, adapter in self.adapters.items()}
            for adapter, steps in logs.items():
                if adapter in runs:
                    self.store.history.add_steps(runs[adapter], steps)
        except Exception as error:  # a dead worker, a closing store: the history misses these steps, nothing else
            logger.warning(f'the step history of {self.name!r} was not recorded: {type(error).__name__}: {error}')

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
        """Save the run's adapter as ``directory/name`` (worker thread); the checkpoint's folder."""
        return Path(self.host.save(self.loaded(run), directory, name, save_optimizer))

    def load(self, run: Run, path: Path, load_optimizer: bool, shown_as: str) -> None:
        """Load a checkpoint into the run's adapter (worker thread); errors name ``shown_as``."""
        self.host.load(self.loaded(run), path, load_optimizer, shown_as)

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
        """Queue a chore that unloads these folders' weights where the model loaded them for
        sampling (their checkpoints were deleted); on the worker thread, no sampling job is using
        them. A sampler group of its own unloads them once evicted or saved again."""

        def forget() -> None:
            for directory in directories:
                self.host.forget_sampler_weights(directory)

        self.scheduler.submit(HOUSEKEEPING, forget, operation='forget_sampler_weights')

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
        return self.config.checkpoint_dir / run.tenant_id / run.id / RELEASE_STATE

    def saved_state(self, run: Run) -> Path | None:
        """Where a run off the model continues from: the newer of its released state and its
        last training checkpoint (a model restarted after a crash held steps saved since the
        release); None if it has neither."""
        saved = [Path(c.path) for c in self.store.checkpoints.of_run(run.tenant_id, run.id) if c.kind == 'training']
        places = [path for path in (self.release_state(run), *saved[-1:]) if (path / 'trainer_state.json').is_file()]
        return max(places, key=lambda path: (path / 'trainer_state.json').stat().st_mtime, default=None)

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
        self.store.runs.set_status(run.id, 'released')
        return True

    def restore(self, run: Run) -> None:
        """Bring a released run back: its adapter, its setup calls replayed, then its saved
        weights, optimizer, scheduler and step counters."""
        adapter, config, path = self.adapter_name(run), run.config, self.saved_state(run)
        if path is None:
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
        self.store.runs.set_status(run.id, 'active')

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
        """Runs (of a tenant, or of all) with an adapter on this model, least recently used first."""
        return [run for run in self.store.runs.active(tenant_id) if run.id in self.adapters and run.id != but]

    def _release_first(self, runs: list[Run]) -> bool:
        """Release the first of ``runs`` that can go; False if none could."""
        return any(run.id not in self._pinned and self.release(run) for run in runs)


__all__ = ['RELEASE_STATE', 'ModelGroup', 'bare']
