"""The service's sampling through vLLM (``sampler: vllm``, or ``sampler: {backend: vllm, ...}``).

``VllmSampling`` is one ``vLLMSampler`` engine holding the base model, with the runs' weights as
vLLM LoRA adapters: a run's current adapter (exported from the trainer when its weights changed
since the last export: ``sampler: vllm``, sampling beside the model), or a saved checkpoint's
(a sampler group's runs sample their last sync; Tinker sampling clients and published weights).
Only adapter tensors reach the engine; it loads the base once.

``VllmSamplerHost`` is a sampler group of its own on vLLM (``sampler: {backend: vllm}``): the
engine alone, without a trainer's copy of the model, behind the methods the sampling routes call
on a group's ``sampling_host``. Its engine is a process of vLLM's own; on GPUs the group's
``device`` ('cuda:2,3') picks the GPUs it sees, and ``ranks`` > 1 shard it with tensor
parallelism (unless ``engine_args`` set ``tensor_parallel_size``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from peft import PeftConfig

from twinkle.data_format import SampleResponse, SamplingParams
from twinkle.errors import ConfigurationError
from twinkle.sampler.vllm_sampler import vLLMSampler
from twinkle.server.config import SamplerSettings, ServerConfig, gpu_indices
from twinkle.server.execution.checks.images import Images
from twinkle.server.execution.checks.requests import (
    JsonObject,
    RequestChecks,
    SavedAdapters,
    SavedWeights,
    sample_prompt,
    sample_saved,
)
from twinkle.server.execution.sampling import slicing
from twinkle.template import Template

#: The LoRA ranks vLLM can be started with; the engine takes the smallest that holds the server's limit.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


class VllmSampling:
    """One vLLM engine for a hosted model, and the adapters it holds for runs and checkpoints."""

    def __init__(self, model_id: str, settings: SamplerSettings, max_lora_rank: int, ranks: int = 1):
        args: dict[str, object] = {'enable_lora': True, 'max_lora_rank': engine_lora_rank(max_lora_rank)}
        if ranks > 1:
            args['tensor_parallel_size'] = ranks
        args.update(settings.engine_args)
        with visible_gpus(settings.device):
            self.sampler = vLLMSampler(model_id, engine_args=args)
        self.sampler.turns = slicing.TURNS  # a sampling job in slices gives the engine up between steps
        self.vocab_size, self.context = self.sampler.vocab_size, self.sampler.context
        self._saved = SavedAdapters(
            'saved-',
            lambda adapter, directory: self.sampler.add_adapter(adapter, str(directory)),
            self.sampler.remove_adapter,
        )
        self._runs: dict[str, tuple[tuple[int, int], str]] = {}  # run adapter -> (weights key, adapter)

    @property
    def template(self) -> Template:
        return self.sampler.template

    def saved_adapter(self, directory: Path, shown_as: str | None = None) -> str:
        """The adapter of the weights saved in ``directory`` (``SavedAdapters``)."""
        return self._saved.adapter(directory, shown_as)

    def run_adapter(
        self, adapter: str, key: tuple[int, int], config: PeftConfig, weights: Callable[[], Mapping[str, torch.Tensor]]
    ) -> str:
        """A run's adapter as it is now: ``weights()`` is exported to the engine when ``key`` (the
        run's weights version) changed since the last export."""
        held = self._runs.get(adapter)
        if held is not None and held[0] == key:
            return held[1]
        tensors = weights()
        name = f'run-{adapter}'
        self.sampler.load_adapter_weights(name, tensors, config)
        self._runs[adapter] = (key, name)
        return name

    def forget_run(self, adapter: str) -> None:
        """A run's adapter left the model: its exported weights go too."""
        held = self._runs.pop(adapter, None)
        if held is not None:
            self.sampler.remove_adapter(held[1])

    def forget(self, directory: Path) -> None:
        """Unload the adapter of ``directory``'s weights, if loaded (its checkpoint was deleted)."""
        self._saved.forget(directory)

    def generate(
        self, prompts: list[JsonObject], params: SamplingParams, adapter: str | None, weight_version: int = 0
    ) -> list[SampleResponse]:
        self.sampler.weight_version = weight_version
        return self.sampler.sample(prompts, params, adapter_name=adapter)

    def alive(self) -> bool:
        """Whether the engine's processes still run (vLLM gives up an engine whose core died)."""
        core = self.sampler.llm.llm_engine.engine_core
        return not getattr(core, 'resources', None) or not getattr(core.resources, 'engine_dead', False)

    def close(self) -> None:
        self.sampler.close()


class VllmSamplerHost(RequestChecks):
    """A sampler group of its own on vLLM: what the routes call on ``ModelGroup.sampling_host``."""

    def __init__(self, config: ServerConfig):
        from twinkle import assets

        settings = config.sampler
        if not isinstance(settings, SamplerSettings):
            raise ConfigurationError('a vLLM sampler group needs the sampler section of the config')
        self.config, self.settings = config, settings
        self.model_id = (
            assets.tiny_model(config.base_model) if config.base_model in assets.MODELS else config.base_model
        )
        self.device = torch.device('cuda' if (settings.device or config.device or '').startswith('cuda') else 'cpu')
        self.restarts = 0
        self.sampling = self._start()
        self.vocab_size: int = self.sampling.vocab_size
        self.context: int | None = self.sampling.context

    def _start(self) -> VllmSampling:
        return VllmSampling(self.model_id, self.settings, self.config.limits.max_lora_rank, self.settings.ranks)

    def sampler_adapter(self, directory: Path, shown_as: str | None = None) -> str:
        return self.sampling.saved_adapter(directory, shown_as)

    def forget_sampler_weights(self, directory: Path) -> None:
        self.sampling.forget(directory)

    def generate(
        self, prompts: list[JsonObject], params: SamplingParams, adapter: str | None, weight_version: int = 0
    ) -> list[SampleResponse]:
        self.check_prompt_lengths(list(enumerate(p['input_ids'] for p in prompts)), params)
        return self.sampling.generate(prompts, params, adapter, weight_version)

    def sample_weights(
        self, inputs: list[JsonObject], sampling_params: JsonObject | None, weights: SavedWeights | None = None
    ) -> list[JsonObject]:
        """``ModelHost.sample_weights`` on the engine: the base model, or saved weights."""
        return sample_saved(self, self.sampling.template, inputs, sampling_params, weights)

    def sample_ids(
        self, prompt: list[int], params: SamplingParams, weights: SavedWeights | None, images: Images = ()
    ) -> SampleResponse:
        return sample_prompt(self, prompt, params, weights, images)

    def restart_if_dead(self) -> str | None:
        """Start the engine again if its process died; then what happened, else None."""
        if self.sampling.alive():
            return None
        with contextlib.suppress(Exception):
            self.sampling.close()
        self.sampling = self._start()
        self.restarts += 1
        return 'the vLLM engine of the sampler died'

    def shutdown(self) -> None:
        self.sampling.close()


def samples_on_vllm(config: ServerConfig) -> bool:
    """Whether the model's own worker samples through vLLM (``sampler: vllm``)."""
    return config.sampler is not None and config.sampler.backend == 'vllm' and not config.sampler.group


def engine_lora_rank(limit: int) -> int:
    """The smallest rank vLLM starts with that holds adapters of rank ``limit``.

    >>> engine_lora_rank(64), engine_lora_rank(48), engine_lora_rank(4)
    (64, 64, 8)
    """
    return next((rank for rank in VLLM_LORA_RANKS if rank >= limit), VLLM_LORA_RANKS[-1])


@contextlib.contextmanager
def visible_gpus(device: str | None) -> Iterator[None]:
    """While the engine starts (its processes inherit the environment): only the GPUs ``device``
    lists ('cuda:2,3' or 'cuda:1') are visible; other devices leave the environment alone."""
    indices = gpu_indices(device) or ([int(device.split(':')[1])] if device and device.startswith('cuda:') else [])
    if not indices:
        yield
        return
    before = os.environ.get('CUDA_VISIBLE_DEVICES')
    os.environ['CUDA_VISIBLE_DEVICES'] = ','.join(map(str, indices))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop('CUDA_VISIBLE_DEVICES', None)
        else:
            os.environ['CUDA_VISIBLE_DEVICES'] = before


__all__ = ['VllmSamplerHost', 'VllmSampling', 'engine_lora_rank']
