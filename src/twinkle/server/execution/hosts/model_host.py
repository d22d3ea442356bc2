"""``ModelHost``: one base model, many tenants' adapters, and the operations a tenant may run.

Every operation runs on the scheduler's worker thread (one step at a time on the device). A
tenant's run maps to an adapter named by its run id (what the tenant knows, so errors name it);
a tenant names only its own runs, so it cannot reach another's adapter. Arguments arrive as
JSON and are checked before they reach the model: names must be registered, classes cannot be
passed, token ids must be in the vocabulary and a request may not exceed the token limit.
``sample`` runs a ``TorchSampler`` over the model's own weights (``TorchSampler.from_model``): a
run samples its adapter as it is after its last step, with nothing to sync.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TypedDict, cast

import torch
from peft import LoraConfig
from tinker import types as tinker_types
from transformers import PretrainedConfig, PreTrainedModel

from twinkle.data_format import InputFeature, ModelOutput, SampleResponse, SamplingParams
from twinkle.errors import CapacityError, ConfigurationError, DataError, StateError, TwinkleError
from twinkle.loss import LOSSES
from twinkle.metric import METRICS
from twinkle.model import AdapterCall, StepCall, TransformersModel
from twinkle.model.checkpoint.checkpointer import Restored
from twinkle.model.lora.multi import expert_target_parameters, lora_targets, peft_state_dict
from twinkle.model.optim.offload import OptimizerOffloader
from twinkle.model.optim.registry import OPTIMIZERS, SCHEDULERS
from twinkle.processor import PROCESSORS
from twinkle.sampler import TorchSampler
from twinkle.server.config import ServerConfig
from twinkle.server.execution.checks.images import ImageRows, Images
from twinkle.server.execution.checks.requests import (
    MAX_SAMPLER_ADAPTERS,
    MEGATRON_PROJECTIONS,
    RequestChecks,
    SavedAdapters,
    SavedWeights,
    check_name,
    encoded_prompt,
    responses_json,
    sample_prompt,
    sample_saved,
    shown_to_tenant,
)
from twinkle.server.execution.host import AdapterRequest, Footprint, Json, JsonObject, Outcome
from twinkle.server.execution.sampling import chat, slicing
from twinkle.server.execution.sampling.chat import ChatReply, ChatRequest
from twinkle.server.execution.sampling.passes import SamplingPass
from twinkle.server.execution.sampling.vllm import VllmSampling, samples_on_vllm
from twinkle.server.execution.tinker import compute as tinker_compute
from twinkle.server.execution.tinker.codec import ForwardBackwardCall
from twinkle.template import TEMPLATES
from twinkle.utils.memory import release_free_memory, resident_mib
from twinkle.utils.weights import vocab_size
from twinkle.wire import OPERATIONS, Configure

#: The handler of a wire operation: the adapter, then the request's arguments by name.
Operation = Callable[..., Json]
SAMPLER_PREFIX = 'sampler--'
#: Held while an adapter is drawn from the process's random generator (``add_adapter``).
_SEEDED_INIT = threading.Lock()


class Described(TypedDict):
    """What a host's far side tells once: the model's shape and its process."""

    model_id: str
    vocab_size: int
    context: int | None
    architecture: str | None
    pid: int


class ModelHost(RequestChecks):
    """The base model and the adapters on it (a ``Host``, in this process)."""

    def __init__(self, config: ServerConfig):
        from twinkle import assets

        self.config = config
        model_id = config.base_model
        if model_id in assets.MODELS:
            model_id = assets.tiny_model(model_id)
        self.model_id = model_id
        self.model = build_model(config, model_id)
        limits = config.limits
        if limits.max_optimizers_on_device is not None or limits.max_optimizers_in_memory is not None:
            self.model.offloader = OptimizerOffloader(
                self.model.device, config.spill_dir, limits.max_optimizers_on_device, limits.max_optimizers_in_memory
            )
        self.device = self.model.device
        self.vocab_size = model_vocab_size(self.model.model)
        # A vision-language model keeps it on its text config; a text model's is its own config.
        text_config = self.model.model.config.get_text_config()
        self.context: int | None = getattr(text_config, 'max_position_embeddings', None)
        self.architecture: str | None = (getattr(self.model.model.config, 'architectures', None) or [None])[0]
        self.image_rows = ImageRows.of(self.model_id, config.limits)
        self._sampler: TorchSampler | None = None
        self._sampler_adapters = SavedAdapters(
            SAMPLER_PREFIX,
            lambda adapter, directory: self.model.add_adapter_to_model(adapter, str(directory)),
            self._unload_sampler_adapter,
        )
        #: Saved weights' adapters unloaded while a paused generation samples them: removed once it ends.
        self._unload_later: set[str] = set()
        #: The sampling pass running now (``sample_many``), whose calls sample together.
        self._pass: SamplingPass | None = None
        #: With ``sampler: vllm``: the vLLM engine beside the model (on rank 0 of a group).
        self.vllm: VllmSampling | None = None
        if config.sampler is not None and samples_on_vllm(config) and self.hosts_sampler_engine():
            self.vllm = VllmSampling(model_id, config.sampler, limits.max_lora_rank)
        # Bumped whenever an adapter's weights change other than by a step (added, loaded): with
        # the optimizer step, what says a run's weights exported to the vLLM engine are current.
        self._weights_epoch: dict[str, int] = {}
        self.operations = self._operations()

    def _operations(self) -> dict[str, Operation]:
        """The handler of each wire operation (``twinkle.wire.OPERATIONS``): the server's own
        (checking names against their registries), or the model's method of that name."""
        model = self.model
        return {
            'set_optimizer': self._set_optimizer,
            'set_lr_scheduler': self._set_lr_scheduler,
            'set_loss': self._set_loss,
            'set_template': self._set_template,
            'set_processor': self._set_processor,
            'add_metric': self._add_metric,
            'forward_backward': self._forward_backward,
            'forward_only': self._forward_only,
            'calculate_loss': self._calculate_loss,
            'sample': self._sample,
            'log_step_figures': self._log_step_figures,
            'clip_grad_norm': _model_call('clip_grad_norm', model.clip_grad_norm),
            'step': _model_call('step', model.step),
            'zero_grad': _model_call('zero_grad', model.zero_grad),
            'lr_step': _model_call('lr_step', model.lr_step),
            'clip_grad_and_step': _model_call('clip_grad_and_step', model.clip_grad_and_step),
            'calculate_metric': _model_call('calculate_metric', model.calculate_metric),
            'get_train_configs': self._train_configs,
        }

    def _train_configs(self, adapter: str, **kwargs: Json) -> Json:
        """The model's ``get_train_configs``, naming the base model as tenants name it (the
        server's own folder of an embedded model is not theirs to see)."""
        _check_scalars('get_train_configs', kwargs)
        text = self.model.get_train_configs(adapter_name=adapter)
        return text.replace(f'model: {self.model_id}', f'model: {self.config.base_model}', 1)

    # ---- adapters -------------------------------------------------------------------------------
    def add_adapter(
        self, adapter: str, lora: Mapping[str, Json], gradient_accumulation_steps: int = 1, seed: int | None = None
    ) -> None:
        """Add an adapter; with ``seed`` its initial weights are drawn from that seed (the same
        adapter a local ``torch.manual_seed(seed)`` then ``add_adapter_to_model`` gives), without
        touching the server's own random state."""
        self.check_adapter(lora)
        limit = self.config.limits.max_adapters
        if len([name for name in self.model.adapter_names if not name.startswith(SAMPLER_PREFIX)]) >= limit:
            raise CapacityError(f'the server holds its limit of {limit} adapters (max_adapters); try again later')
        try:
            # The generator is the process's: models of one server seed their adapters one at a time.
            with _SEEDED_INIT, torch.random.fork_rng(devices=[]):
                if seed is not None:
                    torch.manual_seed(seed)
                self.model.add_adapter_to_model(
                    adapter, LoraConfig(**lora), gradient_accumulation_steps=gradient_accumulation_steps
                )
        except TwinkleError:
            raise
        except (TypeError, ValueError) as e:  # peft / torch refusing a LoRA field's type or value
            raise ConfigurationError(f'cannot add a LoRA adapter with {dict(lora)}: {type(e).__name__}: {e}') from e
        self._weights_epoch[adapter] = self._weights_epoch.get(adapter, 0) + 1

    def shutdown(self) -> None:
        """Stop what the host started beside the model (the vLLM engine of ``sampler: vllm``)."""
        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None

    def restart_if_dead(self) -> str | None:
        """Nothing to restart: the model is this process's."""
        return None

    def describe(self) -> Described:
        """What a host on the far side (``RemoteHost``, ``MultiRankHost``) learns once: the model's shape."""
        return {
            'model_id': self.model_id,
            'vocab_size': self.vocab_size,
            'context': self.context,
            'architecture': self.architecture,
            'pid': os.getpid(),
        }

    def hosts_sampler_engine(self) -> bool:
        """Whether this process starts the vLLM engine of ``sampler: vllm`` (a group's rank 0)."""
        return True

    def whole_request_share(self) -> float:
        """How much this process counts of a request every rank of a group runs whole: all of it
        here (``RankHost``: rank 0 all, the others nothing)."""
        return 1.0

    def release_free_memory(self) -> bool:
        """Give the model process's free heap pages back to the OS (``release_free_memory``)."""
        return release_free_memory()

    def footprint(self) -> list[Footprint]:
        """The base weights this process holds (all of them) and its resident memory."""
        return [weights_footprint(self.model.model, rank=0)]

    def ping(self) -> None:
        """Nothing: what a call costs to reach the model."""

    def take_step_logs(self) -> dict[str, list[dict[str, float]]]:
        """Each adapter's optimizer steps since the last call (the runs' step history)."""
        return self.model.take_step_logs()

    def lora_targets(self, attn: bool, mlp: bool, unembed: bool) -> list[str]:
        """Leaf names of the linear layers under attention, MLP blocks and the output head
        (megatron: the Hugging Face names of the projections it adapts, and ``lm_head``, which
        ``add_adapter`` refuses there)."""
        if self.config.backend == 'megatron':
            return megatron_lora_targets(attn, mlp, unembed)
        return lora_targets(self.model.model, attn, mlp, unembed)

    def expert_targets(self) -> list[str]:
        """peft ``target_parameters`` naming the model's expert stacks ([] for a dense model):
        what Tinker's ``train_mlp`` trains besides the MLP's linear layers ([] on megatron, whose
        LoRA does not reach its experts)."""
        if self.config.backend == 'megatron':
            return []
        return expert_target_parameters(self.model.model)

    def restore_state(self, adapter: str, path: Path, shown_as: str | None = None) -> Restored:
        """Bring the adapter back to a state ``save`` wrote (``TransformersModel.restore_state``:
        weights and, where kept, the optimizer, counters and accumulation window; from weights
        alone a fresh optimizer); errors name ``shown_as`` for ``path`` (see ``load``)."""
        with shown_to_tenant(path, shown_as):
            restored = self.model.restore_state(str(path), adapter_name=adapter)
        self._weights_epoch[adapter] = self._weights_epoch.get(adapter, 0) + 1
        return restored

    def remove_adapter(self, adapter: str) -> None:
        if adapter in self.model.adapter_names:
            self.model.remove_adapter(adapter)
        if self.vllm is not None:
            self.vllm.forget_run(adapter)

    def save(self, adapter: str, directory: Path, name: str, save_optimizer: bool) -> str:
        path = self.model.save(name, str(directory), adapter_name=adapter, save_optimizer=save_optimizer)
        self.forget_sampler_weights(Path(path))  # weights saved there before may be loaded for sampling
        return path

    def load(self, adapter: str, path: Path, load_optimizer: bool, shown_as: str | None = None) -> None:
        """Load a checkpoint's weights (and optimizer) into ``adapter``; its errors name
        ``shown_as`` (the path the tenant gave: ``twinkle://...``, ``tinker://...``) for ``path``,
        a directory of the server's."""
        with shown_to_tenant(path, shown_as):
            self.model.load(str(path), adapter_name=adapter, load_optimizer=load_optimizer)
        self._weights_epoch[adapter] = self._weights_epoch.get(adapter, 0) + 1

    # ---- operations -----------------------------------------------------------------------------
    def run_mixed(self, operation: str, requests: list[AdapterRequest]) -> list[Outcome]:
        """Several adapters' ``forward_backward`` (or ``forward_only``) requests as one pass
        (``is_mixable`` ones); each result is what ``run`` would return for that request."""
        forward_only = operation == 'forward_only'
        calls, rows = [], []
        for adapter, kwargs in requests:
            options = {k: v for k, v in kwargs.items() if k not in ('inputs', 'disable_lora')}
            _check_scalars(operation, options)
            rows.append(self.features(_rows(kwargs['inputs'])))
            calls.append(AdapterCall(adapter, rows[-1], options))
        outputs = self.model.forward_backward_mixed(calls, forward_only=forward_only)
        results: list[Outcome] = []
        for out, features in zip(outputs, rows, strict=True):
            if isinstance(out, TwinkleError):  # its loss was not finite: its DataError in place of its output
                results.append(out)
            elif forward_only:
                results.append({'loss': out.loss, 'num_tokens': out.num_tokens, 'logps': _row_logps(out, features)})
            else:
                results.append({'loss': out.loss, 'num_tokens': out.num_tokens})
        return results

    def run_steps(self, requests: list[AdapterRequest]) -> list[Outcome]:
        """Several adapters' ``clip_grad_and_step`` requests as one update
        (``clip_grad_and_step_many``); each result is what ``run`` would return for that request."""
        calls = []
        for adapter, kwargs in requests:
            _check_scalars('clip_grad_and_step', kwargs)
            norm = kwargs.get('max_grad_norm', 1.0)
            calls.append(StepCall(adapter, float(norm) if isinstance(norm, (int, float)) else 1.0))
        try:
            return [result.grad_norm for result in self.model.clip_grad_and_step_many(calls)]
        except Exception as error:  # gradients may be clipped already: each request fails, none runs again
            return [error] * len(calls)

    def tinker_forward_backward(self, requests: list[tuple[str, ForwardBackwardCall]]) -> list[bytes | TwinkleError]:
        """Tinker ``forward_backward`` (or ``forward``) calls of several models as one pass."""
        return tinker_compute.forward_backward_many(self, requests)

    def tinker_optim_step(self, requests: list[tuple[str, tinker_types.AdamParams]]) -> list[Outcome]:
        """Tinker ``optim_step`` calls of several models as one optimizer update."""
        return tinker_compute.optim_steps(self.model, requests)

    def sample_chat(self, request: ChatRequest) -> ChatReply:
        """An OpenAI-style completion of the base model or of saved weights (``execution.sampling.chat``)."""
        return chat.sample_chat(self, self.sampler().template, self.context, request)

    def run(self, adapter: str, operation: str, kwargs: JsonObject) -> Json:
        """Run a tenant's ``operation`` on its adapter; the result is JSON-ready."""
        handler = self.operations.get(operation)
        if handler is None:
            raise ConfigurationError(f'unknown operation {operation!r}; accepted: {sorted(self.operations)}')
        if not isinstance(kwargs, dict):
            raise DataError(f'arguments of {operation} must be an object; got {type(kwargs).__name__}')
        if operation not in BUILDS_COMPONENTS:
            return handler(adapter, **kwargs)
        try:
            return handler(adapter, **kwargs)
        except TwinkleError:
            raise
        except (TypeError, ValueError, IndexError, KeyError) as e:  # a component refusing a value's type
            raise ConfigurationError(f'{operation}({_brief(kwargs)}) failed: {type(e).__name__}: {e}') from e

    def _set_optimizer(self, adapter: str, optimizer_cls: str = 'AdamW', **kwargs: Json) -> None:
        check_name('optimizer', optimizer_cls, OPTIMIZERS.names())
        _check_scalars('set_optimizer', kwargs)
        self.model.set_optimizer(optimizer_cls, adapter_name=adapter, **kwargs)

    def _set_lr_scheduler(self, adapter: str, scheduler_cls: str, **kwargs: Json) -> None:
        check_name('lr scheduler', scheduler_cls, SCHEDULERS.names())
        _check_scalars('set_lr_scheduler', kwargs)
        self.model.set_lr_scheduler(scheduler_cls, adapter_name=adapter, **kwargs)

    def _set_loss(self, adapter: str, loss_cls: str, **kwargs: Json) -> None:
        check_name('loss', loss_cls, LOSSES.names())
        _check_scalars('set_loss', kwargs)
        self.model.set_loss(loss_cls, adapter_name=adapter, **kwargs)

    def _set_template(self, adapter: str, template_cls: str = 'Template', **kwargs: Json) -> None:
        check_name('template', template_cls, TEMPLATES.names())
        kwargs.pop('model_id', None)  # the tokenizer is the base model's, whatever the client names
        _check_scalars('set_template', kwargs)
        self.model.set_template(template_cls, adapter_name=adapter, model_id=self.model_id, **kwargs)

    def _set_processor(self, adapter: str, processor_cls: str = 'InputProcessor', **kwargs: Json) -> None:
        check_name('processor', processor_cls, PROCESSORS.names())
        _check_scalars('set_processor', kwargs)
        self.model.set_processor(processor_cls, adapter_name=adapter, **kwargs)

    def _add_metric(self, adapter: str, metric: str, is_training: bool = True, **kwargs: Json) -> None:
        check_name('metric', metric, METRICS.names())
        _check_scalars('add_metric', kwargs)
        self.model.add_metric(metric, is_training=is_training, adapter_name=adapter, **kwargs)

    def _forward_backward(self, adapter: str, inputs: Json, **kwargs: Json) -> JsonObject:
        features = self.features(_rows(inputs))
        output = self.model.forward_backward(inputs=features, adapter_name=adapter, **kwargs)
        return {'loss': output.loss, 'num_tokens': output.num_tokens}

    def _log_step_figures(self, adapter: str, figures: dict[str, float]) -> None:
        self.model.log_step_figures(figures, adapter_name=adapter)

    def _calculate_loss(self, adapter: str, **loss_inputs: Json) -> float:
        if self.model.groups[adapter].pending.forward is None:
            raise StateError(
                'calculate_loss() needs a forward_only() first, and none is pending: either none ran, or the '
                "server released the run's adapter since (it saves an idle run, or one that makes room for another, "
                "and takes it off the model; a forward's outputs are not kept): run forward_only() again"
            )
        return self.model.calculate_loss(adapter_name=adapter, **loss_inputs)

    def _forward_only(self, adapter: str, inputs: Json, disable_lora: bool = False) -> JsonObject:
        features = self.features(_rows(inputs))
        output = self.model.forward_only(inputs=features, adapter_name=adapter, disable_lora=disable_lora)
        return {'loss': output.loss, 'num_tokens': output.num_tokens, 'logps': _row_logps(output, features)}

    def _sample(
        self,
        adapter: str,
        inputs: list[JsonObject],
        sampling_params: JsonObject | None = None,
        base_model: bool = False,
    ) -> list[JsonObject]:
        """Sample the run's adapter as it is now (``base_model=True``: the base model, every
        adapter off); one ``SampleResponse`` per prompt, as a dict. ``messages`` prompts are
        encoded with the run's template (``set_template``), else the base model's. A sequence's
        ``weight_version`` is the adapter's optimizer step count (0 for the base model)."""
        prompts, params = self.sample_request(inputs, sampling_params)
        sampler = self.sampler()
        group = self.model.groups[adapter]
        template = group.spec.template or sampler.template
        prompts = [encoded_prompt(template, index, prompt) for index, prompt in enumerate(prompts)]
        if base_model:
            responses = self.generate(prompts, params, None)
        else:
            responses = self.generate(prompts, params, self._current(adapter), weight_version=group.window.optim_step)
        return responses_json(responses, inputs)

    def _current(self, adapter: str) -> str:
        """The adapter to sample a run's weights as they are now: its own (torch), or on the vLLM
        engine its export, made again when a step, a load or a new adapter changed its weights."""
        if self.vllm is None:
            return adapter
        group = self.model.groups[adapter]
        key = (self._weights_epoch.get(adapter, 0), group.window.optim_step)
        return self.vllm.run_adapter(
            adapter, key, group.spec.config, lambda: peft_state_dict(self.model.model, adapter)
        )

    def sample_weights(
        self, inputs: list[JsonObject], sampling_params: JsonObject | None, weights: SavedWeights | None = None
    ) -> list[JsonObject]:
        """Sample the base model (``weights`` None) or saved weights, without a training run;
        ``messages`` prompts are encoded with the base model's template. One ``SampleResponse`` per
        prompt, as a dict."""
        return sample_saved(self, self.sampler().template, inputs, sampling_params, weights)

    def sample_ids(
        self, prompt: list[int], params: SamplingParams, weights: SavedWeights | None, images: Images = ()
    ) -> SampleResponse:
        """Sample a prompt of token ids (with its image chunks, ``images``) from the base model
        (``weights`` None) or saved weights."""
        return sample_prompt(self, prompt, params, weights, images)

    def generate(
        self, prompts: list[JsonObject], params: SamplingParams, adapter: str | None, weight_version: int = 0
    ) -> list[SampleResponse]:
        """Sample encoded ``prompts`` (``input_ids`` checked) from ``adapter`` (None: the base
        model); one ``SampleResponse`` per prompt."""
        self.check_sampling_params(params)
        self.check_prompt_lengths(list(enumerate(cast(list[int], p['input_ids']) for p in prompts)), params)
        if self.vllm is not None:
            return self.vllm.generate(prompts, params, adapter, weight_version)
        sampler = self.sampler()
        if self._pass is None:
            try:
                return versioned(sampler.sample(prompts, params, adapter_name=adapter), weight_version)
            finally:
                self._unload_idle()
        with self._pass.sampling():  # with the other calls of the pass, in one batch
            return versioned(sampler.sample(prompts, params, adapter_name=adapter), weight_version)

    def sample_many(self, calls: list[tuple[str, tuple[object, ...]]]) -> list[object]:
        """Several sampling calls at once (``sample_weights`` or ``sample_ids``, by name, with their
        arguments: a sampler group's pass), their rows decoded in one batch (``SamplingPass``); each
        call's result, or its error, in order."""
        methods: dict[str, Callable[..., object]] = {
            'sample_weights': self.sample_weights,
            'sample_ids': self.sample_ids,
        }
        if len(calls) == 1 or self.model.uses_fsdp:  # FSDP ranks sample in step, one call after another
            return [_outcome(partial(methods[name], *args)) for name, args in calls]
        results: list[object] = []
        for chunk in adapter_chunks(calls):  # no call's adapter is evicted by another's of its pass
            self._pass = SamplingPass(len(chunk))
            try:
                results += self._pass.run([partial(methods[name], *args) for name, args in chunk])
            finally:
                self._pass = None
                self._unload_idle()
        return results

    def _unload_idle(self) -> None:
        """The saved weights' adapters unloaded while generations sampled them, of those none samples now."""
        if self._sampler is None:
            return
        for idle in [name for name in self._unload_later if name not in self._sampler.busy]:
            self._unload_later.discard(idle)
            self.remove_adapter(idle)

    def sampler_adapter(self, directory: Path, shown_as: str | None = None) -> str:
        """The adapter holding the saved weights in ``directory`` (a ``save`` of any adapter),
        loaded on first use and again once the directory holds a newer save (a sampler group
        of its own sees each sync of a run into the same directory); at most
        ``MAX_SAMPLER_ADAPTERS`` stay loaded. Errors name ``shown_as`` (the tenant's path of the
        checkpoint) for ``directory``."""
        if self.vllm is not None:
            return self.vllm.saved_adapter(directory, shown_as)
        return self._sampler_adapters.adapter(directory, shown_as)

    def forget_sampler_weights(self, directory: Path) -> None:
        """Unload the adapter of ``directory``'s weights, if loaded (its checkpoint was deleted)."""
        if self.vllm is not None:
            self.vllm.forget(directory)
        self._sampler_adapters.forget(directory)

    def sampler(self) -> TorchSampler:
        """The sampler over the model's own weights and adapters; refused on a megatron model,
        whose ``GPTModel`` keeps no KV cache for a ``TorchSampler`` to decode with."""
        if self.config.backend == 'megatron':
            raise ConfigurationError(
                f'model {self.config.base_model!r} trains on backend: megatron, which cannot sample on its own '
                "workers (megatron-core's GPTModel has no KV cache for the torch sampler): configure a sampler group "
                'of its own (sampler: {ranks: 1}, or {backend: vllm, device: ...}), which samples the weights a run '
                'saves for sampling'
            )
        if self._sampler is None:
            self._sampler = TorchSampler.from_model(self.model.model, self.model_id)
            self._sampler.turns = slicing.TURNS  # a sampling job in slices gives way between decode steps
        return self._sampler

    def _unload_sampler_adapter(self, adapter: str) -> None:
        """Unload saved weights' adapter (evicted, or its checkpoint deleted): at once, or once the
        generations paused on it between two slices have ended (``generate``)."""
        if self._sampler is not None and adapter in self._sampler.busy:
            self._unload_later.add(adapter)
        else:
            self.remove_adapter(adapter)


def build_model(config: ServerConfig, model_id: str) -> TransformersModel:
    """The model of the config's ``backend``, on the runtime's mesh (a group's ranks set it):
    ``TransformersModel``, or ``MegatronModel``, imported only here (megatron-core is an extra:
    where it is missing, a ``ConfigurationError`` says how to install it)."""
    if config.backend == 'transformers':
        return TransformersModel(model_id, device=config.device, dtype=base_dtype(config), **config.speed.model_dump())
    from twinkle.model.megatron.model import MegatronModel, require_megatron

    require_megatron()
    return MegatronModel(model_id, device=config.device, dtype=base_dtype(config))


def model_vocab_size(model: torch.nn.Module) -> int:
    """Token ids the model takes: its input embedding's rows; a megatron model's config's
    ``vocab_size`` (its embedding holds this rank's slice of the rows, or none on a later stage)."""
    if isinstance(model, PreTrainedModel):
        return vocab_size(model)
    return int(cast(PretrainedConfig, model.config).vocab_size)


def megatron_lora_targets(attn: bool, mlp: bool, unembed: bool) -> list[str]:
    """``lora_targets`` of a megatron model; ``unembed`` names ``lm_head``, which
    ``check_megatron_targets`` then refuses with what to ask for instead."""
    names = (MEGATRON_PROJECTIONS['attn'] if attn else []) + (MEGATRON_PROJECTIONS['mlp'] if mlp else [])
    return sorted(names + (['lm_head'] if unembed else []))


def base_dtype(config: ServerConfig) -> torch.dtype:
    """The dtype of the base weights: the config's, or for 'auto' bfloat16 on a GPU that has it
    (a device of ``cuda``, or none given where CUDA is there), float32 elsewhere."""
    if config.dtype != 'auto':
        dtype: torch.dtype = getattr(torch, config.dtype)  # a name the config's Dtype allows
        return dtype
    device = config.device or ('cuda' if torch.cuda.is_available() else 'cpu')
    on_gpu = device.startswith('cuda') and torch.cuda.is_available()
    return torch.bfloat16 if on_gpu and torch.cuda.is_bf16_supported() else torch.float32


#: Operations whose handler hands its arguments to a component or a model method, whose
#: ``TypeError`` / ``ValueError`` then means a bad argument (the user's error).
BUILDS_COMPONENTS = frozenset(name for name, spec in OPERATIONS.items() if issubclass(spec, Configure)) | {
    'clip_grad_norm',
    'step',
    'zero_grad',
    'lr_step',
    'clip_grad_and_step',
    'calculate_metric',
    'get_train_configs',
}


def weights_footprint(model: torch.nn.Module, rank: int) -> Footprint:
    """What ``model``'s base weights take on this rank (its FSDP2 shard of each, or all of it)."""
    from torch.distributed.tensor import DTensor

    base = [(name, p) for name, p in model.named_parameters() if 'lora_' not in name]
    local = [(name, p.to_local() if isinstance(p, DTensor) else p) for name, p in base]
    layers = [(p, held) for (name, p), (_, held) in zip(base, local, strict=True) if '.layers.' in name]
    return {
        'rank': rank,
        'decoder_elements_held': sum(held.numel() for _, held in layers),
        'decoder_elements': sum(p.numel() for p, _ in layers),
        'base_bytes_held': sum(held.numel() * held.element_size() for _, held in local),
        'base_bytes': sum(p.numel() * p.element_size() for _, p in base),
        'resident_mib': resident_mib(),
    }


def _model_call(operation: str, method: Callable[..., Json]) -> Operation:
    """The handler of an operation that is the model's own method of that name."""

    def call(adapter: str, **kwargs: Json) -> Json:
        _check_scalars(operation, kwargs)
        return method(adapter_name=adapter, **kwargs)

    return call


def is_mixable(operation: str, kwargs: Mapping[str, Json]) -> bool:
    """Whether a request can share a pass with other adapters' requests: ``forward_backward``
    without micro-batches, ``forward_only`` through the adapter (not the base model alone), or
    ``clip_grad_and_step`` (stepped together, ``ModelHost.run_steps``)."""
    if operation == 'clip_grad_and_step':
        return True
    if operation == 'forward_backward':
        return 'micro_batch_size' not in kwargs
    return operation == 'forward_only' and not kwargs.get('disable_lora', False)


def request_tokens(inputs: Json) -> int:
    """Tokens in a request's rows (checked already), for the pass's token budget."""
    return sum(len(row['input_ids']) for row in _rows(inputs))


def _rows(inputs: Json) -> list[JsonObject]:
    """A request's rows, as the wire checked them (``twinkle.wire.InputRow`` s; one row alone as a list of one)."""
    return cast(list[JsonObject], [inputs] if isinstance(inputs, dict) else inputs)


def _row_logps(output: ModelOutput, features: list[InputFeature]) -> list[list[float]]:
    return [output.logps[i, : len(f['input_ids'])].tolist() for i, f in enumerate(features)]


def _brief(kwargs: Mapping[str, Json]) -> str:
    return ', '.join(f'{k}={str(v)[:40]}' for k, v in kwargs.items())


def _check_scalars(operation: str, kwargs: Mapping[str, Json]) -> None:
    """Plain JSON values only, and no NaN or infinity."""
    for key, value in kwargs.items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                raise DataError(f'{operation} argument {key!r} is {item}; it must be a finite number')


def adapter_chunks(calls: list[tuple[str, tuple[object, ...]]]) -> list[list[tuple[str, tuple[object, ...]]]]:
    """``calls`` in order, cut where a pass would sample more saved weights than the
    ``MAX_SAMPLER_ADAPTERS`` that stay loaded (a call's ``SavedWeights`` argument names them).

    >>> calls = [('sample_ids', (SavedWeights(Path(str(i % 6))),)) for i in range(8)]
    >>> [len(chunk) for chunk in adapter_chunks(calls)]
    [4, 4]
    """
    chunks: list[list[tuple[str, tuple[object, ...]]]] = [[]]
    seen: set[Path] = set()
    for call in calls:
        weights = {arg.directory for arg in call[1] if isinstance(arg, SavedWeights)}
        if len(seen | weights) > MAX_SAMPLER_ADAPTERS and chunks[-1]:
            chunks.append([])
            seen = set()
        seen |= weights
        chunks[-1].append(call)
    return chunks


def versioned(responses: list[SampleResponse], weight_version: int) -> list[SampleResponse]:
    """``responses`` with every sequence marked as sampled from weights of ``weight_version`` (set
    per call: calls of one pass sample one sampler at once)."""
    for response in responses:
        for sequence in response.sequences:
            sequence.weight_version = weight_version
    return responses


def _outcome(call: Callable[[], object]) -> object:
    """``call()``, or the error it raised (a pass's call fails alone)."""
    try:
        return call()
    except Exception as error:
        return error
