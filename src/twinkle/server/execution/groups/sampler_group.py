"""``SamplerGroup``: a base model's sampler on devices of its own, beside its model group.

With ``sampler: {ranks: 1, device: cuda:1}`` in the config (seed 003's ``DeviceGroup(name=
'sampler')``), a hosted model samples on worker processes of their own (``MultiRankHost``, each
loading the base model once; with ``backend: vllm`` a vLLM engine, ``VllmSamplerHost``) with a
worker thread of its own, so sampling runs at the same time
as training. Only adapter tensors cross from the trainer to the sampler: a run's sampler weights
are what it last saved for sampling (Tinker's ``save_weights_for_sampler``, or the native
``sync_sampler`` that ``twinkle_client``'s ``CheckpointEngineManager.sync_weights`` calls),
loaded from that checkpoint on first use. Every sample carries the version it came from: the
optimizer step the weights were saved at (0 for the base model). Without a sampler group,
sampling runs on the model group, on the trainer's current weights, as before.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import torch

from twinkle.errors import ConfigurationError, StateError
from twinkle.model.checkpoint.files import WEIGHTS_STEP
from twinkle.server.config import ServerConfig
from twinkle.server.execution.checks.requests import JsonObject, SavedWeights
from twinkle.server.execution.hosts.multi_rank import MultiRankHost, ProcessRanks
from twinkle.server.execution.sampling.vllm import VllmSamplerHost
from twinkle.server.execution.scheduling.scheduler import Job, JobCallback, Scheduler
from twinkle.server.store import Run, Store

#: The name of the checkpoint a native ``sync_sampler`` writes (each sync replaces it).
SYNC_NAME = 'sync'


class SamplerGroup:
    """The sampler's host (worker processes) and its own worker thread."""

    def __init__(self, config: ServerConfig, store: Store, on_start: JobCallback, on_finish: JobCallback):
        settings = config.sampler
        if settings is None:
            raise ConfigurationError('a SamplerGroup needs the sampler section of the config')
        sampler_config = config.model_copy(  # a TorchSampler on the Hugging Face model, whatever trains it
            update={
                'ranks': settings.ranks, 'fsdp_size': 1, 'device': settings.device or config.device,
                'backend': 'transformers', 'tp_size': 1, 'pp_size': 1,
            }
        )  # fmt: skip
        self.name, self.store, self._on_start = f'{config.base_model} (sampler)', store, on_start
        self.host: MultiRankHost | VllmSamplerHost
        self._threads_before: int | None = None  # this process's torch threads before a CPU split, put back at stop
        if settings.backend == 'vllm':
            self.host = VllmSamplerHost(sampler_config)
        else:
            split = cpu_split(config, settings.ranks, sampler_config.device)
            self.host = MultiRankHost(
                sampler_config, None if split is None else partial(ProcessRanks, threads=split[1])
            )
            if split is not None:
                self._threads_before = torch.get_num_threads()
                torch.set_num_threads(split[0])  # the model, in this process
        self.scheduler = Scheduler(
            max_queued_per_tenant=config.limits.max_queued_per_tenant,
            on_start=self._started,
            on_finish=on_finish,
            shares=self._shares if isinstance(self.host, VllmSamplerHost) else None,
        )

    @staticmethod
    def _shares(job: Job) -> bool:
        """On vLLM, sampling jobs commute (``Scheduler.shares``): their requests join one running
        generation of the engine, and none changes the weights the others sample."""
        return job.operation == 'sample'

    def _started(self, job: Job) -> None:
        """Before a job: a sampler whose worker died starts again (it holds no state of its own:
        the runs' sampler weights are on disk)."""
        reason = self.host.restart_if_dead()
        if reason is not None:
            self.store.history.record_restart(self.name, reason)
        self._on_start(job)

    def weights_of(self, run: Run) -> Path:
        """The folder of the run's sampler weights: its newest sampler checkpoint."""
        saved = [c for c in self.store.checkpoints.of_run(run.tenant_id, run.id) if c.kind == 'sampler']
        if not saved:
            raise StateError(
                f'training run {run.id!r} has no sampler weights yet: this server samples on a sampler group of its '
                'own, which sees a run as of its last sync (CheckpointEngineManager(model, sampler).sync_weights(), '
                'or save_weights_for_sampler)'
            )
        return Path(saved[-1].path)

    def sample_call(self, run: Run, kwargs: JsonObject) -> tuple[str, tuple[object, ...]]:
        """A run's ``sample`` request on the sampler, as the host's method and its arguments: its
        last synced weights (``base_model``: the base model), each sequence marked with their version."""
        weights = None
        if not kwargs.get('base_model', False):  # a load error names the run's weights, not their folder
            weights = saved_weights(self.weights_of(run), f'the sampler weights of training run {run.id!r}')
        return 'sample_weights', (kwargs['inputs'], kwargs.get('sampling_params'), weights)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self, error: BaseException) -> list[Job]:
        """End the worker after its running slice; the jobs that will not run now (queued, or paused
        between slices: their sequences are dropped) fail with ``error`` before the engine goes."""
        jobs = self.scheduler.stop(wait=True)
        for job in jobs:
            job.fail(error)
        self.host.shutdown()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
        return jobs


def cpu_split(config: ServerConfig, sampler_ranks: int, sampler_device: str | None) -> tuple[int, int] | None:
    """``(the server process's torch threads, each sampler rank's)`` when the model (in this process)
    and its sampler group both compute on this machine's CPU: its cores split between the two, where
    each taking them all has two sets of threads contend for the same cores (the async GRPO recipe
    in server mode on 2 cores: every forward 2.3x slower, 0.43 of one process's samples/s; split,
    1.03: ``benchmarks/async_rl.py --modes``). None on a GPU, or with the model on processes of its
    own (``ranks`` > 1, Ray), which share the cores among themselves.

    >>> cpu_split(ServerConfig(base_model='m', device='cpu'), 1, 'cpu')[1] == max(1, _cores() // 2)
    True
    """
    if config.ranks > 1 or config.ray is not None or not _on_cpu(config.device) or not _on_cpu(sampler_device):
        return None
    share = max(1, _cores() // (sampler_ranks + 1))
    return max(1, _cores() - share * sampler_ranks), share


def _on_cpu(device: str | None) -> bool:
    return (device or '').startswith('cpu') or (device is None and not torch.cuda.is_available())


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1


def saved_weights(directory: Path | None, shown_as: str | None) -> SavedWeights | None:
    """The saved weights in ``directory`` to sample (None: the base model), at the step they were saved at."""
    return None if directory is None else SavedWeights(directory, shown_as, version_of(directory))


def version_of(directory: Path) -> int:
    """The optimizer step a checkpoint's weights were saved at (0 for one saved before this was
    recorded)."""
    state = directory / WEIGHTS_STEP
    return int(json.loads(state.read_text()).get('optim_step', 0)) if state.is_file() else 0


__all__ = ['SYNC_NAME', 'SamplerGroup', 'cpu_split', 'saved_weights', 'version_of']
