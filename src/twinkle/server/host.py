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

import inspect
import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import torch
from peft import LoraConfig

from twinkle.data_format import IGNORE_INDEX, InputFeature, ModelOutput, SamplingParams
from twinkle.errors import (
    CapacityError,
    ConfigurationError,
    DataError,
    SequenceTooLongError,
    TwinkleError,
    UnknownNameError,
)
from twinkle.loss import LOSSES
from twinkle.metric import METRICS
from twinkle.model import AdapterCall, StepCall, TransformersModel
from twinkle.model.multi_lora import lora_targets
from twinkle.model.offload import OptimizerOffloader
from twinkle.model.optim import OPTIMIZERS, SCHEDULERS, check_optimizer_args, check_scheduler_args
from twinkle.processor import PROCESSORS
from twinkle.registry import Registry
from twinkle.sampler import TorchSampler
from twinkle.server.config import ServerConfig
from twinkle.template import TEMPLATES, Template
from twinkle.utils.memory import release_free_memory
from twinkle.utils.weights import vocab_size
from twinkle.wire import LORA_FIELDS, OPERATIONS, Configure

#: Most top-k logprobs per token a sampling request may ask for (vLLM's default ``max_logprobs``).
MAX_TOP_LOGPROBS = 20
#: Saved sampler weights kept loaded as adapters at once; the least recently used one goes first.
MAX_SAMPLER_ADAPTERS = 4
SAMPLER_PREFIX = 'sampler--'
#: Held while an adapter is drawn from the process's random generator (``add_adapter``).
_SEEDED_INIT = threading.Lock()


class RequestChecks:
    """What a request must satisfy before it is queued: the checks that need the model's
    shape (vocabulary, context) and the limits, not its weights. A host answers them where the
    routes run (``MultiRankHost`` without a round trip to its workers)."""

    config: ServerConfig
    vocab_size: int
    context: int | None
    device: torch.device

    def check_adapter(self, lora: Mapping[str, Any]) -> None:
        """Known LoRA fields and a rank within the limit (room on the model is the service's
        to make, ``Service.make_room``; ``add_adapter`` checks that it is there)."""
        limits = self.config.limits
        unknown = sorted(set(lora) - LORA_FIELDS)
        if unknown:
            raise ConfigurationError(f'unknown LoRA fields {unknown}; accepted: {sorted(LORA_FIELDS)}')
        rank = lora.get('r', 8)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 < rank <= limits.max_lora_rank:
            raise ConfigurationError(f'LoRA rank r={rank!r} must be an integer in [1, {limits.max_lora_rank}]')

    def validate(self, operation: str, kwargs: dict[str, Any]) -> None:
        """What the request's wire model (``twinkle.wire.OPERATIONS[operation]``, checked at the
        route) cannot check: a registered component that takes these options, token ids in the
        vocabulary, lengths within the context and the request limits. The server runs it before
        queueing, so bad input is a 4xx and not a failed future."""
        spec = OPERATIONS[operation]
        if issubclass(spec, Configure):
            _check_component(spec, kwargs)
        if operation == 'sample':
            self.sample_request(kwargs['inputs'], kwargs.get('sampling_params'))
        elif 'inputs' in kwargs:
            self.features(kwargs['inputs'])
        if operation == 'set_optimizer':  # lr=-1 or lr='fast': a 4xx now, not a failed future at the step
            options = {k: v for k, v in kwargs.items() if k != 'optimizer_cls'}
            check_optimizer_args(kwargs.get('optimizer_cls', 'AdamW'), options, self.device)
        elif operation == 'set_lr_scheduler':
            check_scheduler_args(kwargs['scheduler_cls'], {k: v for k, v in kwargs.items() if k != 'scheduler_cls'})

    def sample_request(
        self, inputs: list[dict[str, Any]], sampling_params: dict[str, Any] | None
    ) -> tuple[list[dict[str, Any]], SamplingParams]:
        """The prompts (``twinkle.wire.Prompt`` s) and parameters of a ``sample`` request,
        checked: known parameters with valid values, prompt token ids in the vocabulary, and
        (for prompts given as token ids; ``messages`` are counted once encoded, on the worker)
        each prompt plus ``max_tokens`` within the model context and the request within the
        token limit."""
        params = SamplingParams.from_dict(sampling_params)
        self.check_sampling_params(params)
        prompts = [_prompt(index, row, self.vocab_size) for index, row in enumerate(inputs)]
        self._check_prompt_lengths([(i, p['input_ids']) for i, p in enumerate(prompts) if 'input_ids' in p], params)
        return prompts, params

    def check_sampling_params(self, params: SamplingParams) -> None:
        for token in params.stop_token_ids:
            if token >= self.vocab_size:
                raise ConfigurationError(f'stop token id {token} is outside the vocabulary [0, {self.vocab_size})')
        if not isinstance(params.topk_prompt_logprobs, int):  # SamplingParams lets null through; the sampler cannot
            raise ConfigurationError(
                f'topk_prompt_logprobs must be an integer >= 0; got {params.topk_prompt_logprobs!r}'
            )
        for name in ('logprobs', 'topk_prompt_logprobs'):
            value = getattr(params, name) or 0
            if value > MAX_TOP_LOGPROBS:
                raise ConfigurationError(f'{name}={value} is over the limit of {MAX_TOP_LOGPROBS} top logprobs')

    def _check_prompt_lengths(self, prompts: list[tuple[int, list[int]]], params: SamplingParams) -> None:
        """Each prompt plus ``max_tokens`` fits the context; the request's sequences (prompt
        plus ``max_tokens``, ``num_samples`` times per prompt) fit the token limit."""
        for index, ids in prompts:
            if self.context is not None and len(ids) + params.max_tokens > self.context:
                raise SequenceTooLongError(
                    f'prompt {index} has {len(ids)} tokens; with max_tokens={params.max_tokens} it would exceed '
                    f'the model context of {self.context} tokens'
                )
        total = params.num_samples * sum(len(ids) + params.max_tokens for _, ids in prompts)
        limit = self.config.limits.max_tokens_per_request
        if total > limit:
            raise DataError(
                f'sampling would hold up to {total} tokens (num_samples={params.num_samples} sequences per prompt, '
                f'each the prompt plus max_tokens={params.max_tokens}), over the limit of {limit} per request'
            )

    def features(self, inputs: list[dict[str, Any]]) -> list[InputFeature]:
        """Encoded rows (``twinkle.wire.InputRow`` s) checked against the model: token ids and
        labels in the vocabulary, and the request's token total within the limit."""
        features, total = [], 0
        for index, row in enumerate(inputs):
            feature = _feature(index, row, self.vocab_size)
            total += len(feature['input_ids'])
            features.append(feature)
        limit = self.config.limits.max_tokens_per_request
        if total > limit:
            raise DataError(f'the request holds {total} tokens, over the limit of {limit} per request')
        return features


class ModelHost(RequestChecks):
    """The base model and the adapters on it."""

    def __init__(self, config: ServerConfig):
        from twinkle import assets

        self.config = config
        model_id = config.base_model
        if model_id in assets.MODELS:
            model_id = assets.tiny_model(model_id)
        self.model_id = model_id
        self.model = TransformersModel(model_id, device=config.device, dtype=base_dtype(config))
        limits = config.limits
        if limits.max_optimizers_on_device is not None or limits.max_optimizers_in_memory is not None:
            self.model.offloader = OptimizerOffloader(
                self.model.device, config.spill_dir, limits.max_optimizers_on_device, limits.max_optimizers_in_memory
            )
        self.device = self.model.device
        self.vocab_size = vocab_size(self.model.model)
        self.context: int | None = getattr(self.model.model.config, 'max_position_embeddings', None)
        self._sampler: TorchSampler | None = None
        # checkpoint directory -> (which save of it, adapter)
        self._sampler_adapters: OrderedDict[str, tuple[tuple[int, int] | None, str]] = OrderedDict()
        self._sampler_ids = itertools.count()
        # The handler of each wire operation: the method ``_<name>`` here, else the model's ``<name>``.
        self.operations: dict[str, Callable[..., Any]] = {
            name: getattr(self, f'_{name}', None) or self._simple(name) for name in OPERATIONS
        }

    # ---- adapters -------------------------------------------------------------------------------
    def add_adapter(
        self, adapter: str, lora: Mapping[str, Any], gradient_accumulation_steps: int = 1, seed: int | None = None
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

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(self, *args)``: an operation written against the host (a Tinker step, say) runs
        where the model is, here in this process, in the actor of a ``RemoteHost`` or on every
        rank of a ``MultiRankHost``. ``fn`` runs as given: call a host's own method by name
        (``host.run_mixed(...)``), not as ``call(ModelHost.run_mixed, ...)``, or a ``RankHost``
        would run the base class's instead of its own."""
        return fn(self, *args)

    def whole_request_share(self) -> float:
        """How much this process counts of a request every rank of a group runs whole: all of it
        here (``RankHost``: rank 0 all, the others nothing)."""
        return 1.0

    def release_free_memory(self) -> bool:
        """Give the model process's free heap pages back to the OS (``release_free_memory``)."""
        return release_free_memory()

    def lora_targets(self, attn: bool, mlp: bool, unembed: bool) -> list[str]:
        """Leaf names of the linear layers under attention, MLP blocks and the output head."""
        return lora_targets(self.model.model, attn, mlp, unembed)

    @property
    def architecture(self) -> str | None:
        return (getattr(self.model.model.config, 'architectures', None) or [None])[0]

    def has_pending_gradients(self, adapter: str) -> bool:
        """Whether the adapter holds gradients (or a forward) waiting for an optimizer step."""
        group = self.model.groups[adapter]
        return group.pending is not None or any(param.grad is not None for param in group.params)

    def restore_state(self, adapter: str, path: Path, shown_as: str | None = None) -> None:
        """Load a state ``save`` wrote (with the optimizer when the adapter has one) and its step
        counters; errors name ``shown_as`` for ``path`` (see ``load``)."""
        from twinkle.model import checkpoint as ckpt

        group = self.model.groups[adapter]
        self.load(adapter, path, load_optimizer=group.optimizer is not None, shown_as=shown_as)
        with shown_to_tenant(path, shown_as):
            state = ckpt.read_trainer_state(path)
        self.model.restore_counters(state, adapter_name=adapter)

    def remove_adapter(self, adapter: str) -> None:
        if adapter in self.model.adapter_names:
            self.model.remove_adapter(adapter)

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

    # ---- operations -----------------------------------------------------------------------------
    def run_mixed(self, operation: str, requests: list[tuple[str, dict[str, Any]]]) -> list[Any]:
        """Several adapters' ``forward_backward`` (or ``forward_only``) requests as one pass
        (``is_mixable`` ones); each result is what ``run`` would return for that request."""
        forward_only = operation == 'forward_only'
        calls, rows = [], []
        for adapter, kwargs in requests:
            options = {k: v for k, v in kwargs.items() if k not in ('inputs', 'disable_lora')}
            _check_scalars(operation, options)
            rows.append(self.features(kwargs['inputs']))
            calls.append(AdapterCall(adapter, rows[-1], options))
        outputs = self.model.forward_backward_mixed(calls, forward_only=forward_only)
        results: list[Any] = []
        for out, features in zip(outputs, rows, strict=True):
            if isinstance(out, TwinkleError):  # its loss was not finite: its DataError in place of its output
                results.append(out)
            elif forward_only:
                results.append({'loss': out.loss, 'num_tokens': out.num_tokens, 'logps': _row_logps(out, features)})
            else:
                results.append({'loss': out.loss, 'num_tokens': out.num_tokens})
        return results

    def run_steps(self, requests: list[tuple[str, dict[str, Any]]]) -> list[Any]:
        """Several adapters' ``clip_grad_and_step`` requests as one update
        (``clip_grad_and_step_many``); each result is what ``run`` would return for that request."""
        calls = []
        for adapter, kwargs in requests:
            _check_scalars('clip_grad_and_step', kwargs)
            calls.append(StepCall(adapter, kwargs.get('max_grad_norm', 1.0)))
        try:
            return [result.grad_norm for result in self.model.clip_grad_and_step_many(calls)]
        except Exception as error:  # gradients may be clipped already: each request fails, none runs again
            return [error] * len(calls)

    def run(self, adapter: str, operation: str, kwargs: dict[str, Any]) -> Any:
        """Run a tenant's ``operation`` on its adapter; the result is JSON-ready."""
        if operation not in self.operations:
            raise ConfigurationError(f'unknown operation {operation!r}; accepted: {sorted(self.operations)}')
        if not isinstance(kwargs, dict):
            raise DataError(f'arguments of {operation} must be an object; got {type(kwargs).__name__}')
        if not _builds_components(operation):
            return self.operations[operation](adapter, **kwargs)
        try:
            return self.operations[operation](adapter, **kwargs)
        except TwinkleError:
            raise
        except (TypeError, ValueError, IndexError, KeyError) as e:  # a component refusing a value's type
            raise ConfigurationError(f'{operation}({_brief(kwargs)}) failed: {type(e).__name__}: {e}') from e

    def _simple(self, method: str) -> Callable[..., Any]:
        def call(adapter: str, **kwargs: Any) -> Any:
            _check_scalars(method, kwargs)
            return getattr(self.model, method)(adapter_name=adapter, **kwargs)

        return call

    def _set_optimizer(self, adapter: str, optimizer_cls: str = 'AdamW', **kwargs: Any) -> None:
        _check_name('optimizer', optimizer_cls, OPTIMIZERS.names())
        _check_scalars('set_optimizer', kwargs)
        self.model.set_optimizer(optimizer_cls, adapter_name=adapter, **kwargs)

    def _set_lr_scheduler(self, adapter: str, scheduler_cls: str, **kwargs: Any) -> None:
        _check_name('lr scheduler', scheduler_cls, SCHEDULERS.names())
        _check_scalars('set_lr_scheduler', kwargs)
        self.model.set_lr_scheduler(scheduler_cls, adapter_name=adapter, **kwargs)

    def _set_loss(self, adapter: str, loss_cls: str, **kwargs: Any) -> None:
        _check_name('loss', loss_cls, LOSSES.names())
        _check_scalars('set_loss', kwargs)
        self.model.set_loss(loss_cls, adapter_name=adapter, **kwargs)

    def _set_template(self, adapter: str, template_cls: str = 'Template', **kwargs: Any) -> None:
        _check_name('template', template_cls, TEMPLATES.names())
        kwargs.pop('model_id', None)  # the tokenizer is the base model's, whatever the client names
        _check_scalars('set_template', kwargs)
        self.model.set_template(template_cls, adapter_name=adapter, model_id=self.model_id, **kwargs)

    def _set_processor(self, adapter: str, processor_cls: str = 'InputProcessor', **kwargs: Any) -> None:
        _check_name('processor', processor_cls, PROCESSORS.names())
        _check_scalars('set_processor', kwargs)
        self.model.set_processor(processor_cls, adapter_name=adapter, **kwargs)

    def _add_metric(self, adapter: str, metric: str, is_training: bool = True, **kwargs: Any) -> None:
        _check_name('metric', metric, METRICS.names())
        _check_scalars('add_metric', kwargs)
        self.model.add_metric(metric, is_training=is_training, adapter_name=adapter, **kwargs)

    def _forward_backward(self, adapter: str, inputs: Any, **kwargs: Any) -> dict[str, Any]:
        features = self.features(inputs)
        output = self.model.forward_backward(inputs=features, adapter_name=adapter, **kwargs)
        return {'loss': output.loss, 'num_tokens': output.num_tokens}

    def _forward_only(self, adapter: str, inputs: Any, disable_lora: bool = False) -> dict[str, Any]:
        features = self.features(inputs)
        output = self.model.forward_only(inputs=features, adapter_name=adapter, disable_lora=disable_lora)
        return {'loss': output.loss, 'num_tokens': output.num_tokens, 'logps': _row_logps(output, features)}

    def _sample(
        self, adapter: str, inputs: Any, sampling_params: dict[str, Any] | None = None, base_model: bool = False
    ) -> list[dict[str, Any]]:
        """Sample the run's adapter as it is now (``base_model=True``: the base model, every
        adapter off); one ``SampleResponse`` per prompt, as a dict. ``messages`` prompts are
        encoded with the run's template (``set_template``), else the base model's. A sequence's
        ``weight_version`` is the adapter's optimizer step count (0 for the base model)."""
        prompts, params = self.sample_request(inputs, sampling_params)
        sampler = self.sampler()
        group = self.model.groups[adapter]
        template = group.template or sampler.template
        prompts = [_encoded_prompt(template, index, prompt) for index, prompt in enumerate(prompts)]
        if base_model:
            responses = self.generate(prompts, params, None)
        else:
            responses = self.generate(prompts, params, adapter, weight_version=group.optim_step)
        return [asdict(response) for response in responses]

    def sample_weights(
        self,
        inputs: list[dict[str, Any]],
        sampling_params: dict[str, Any] | None,
        directory: Path | None,
        shown_as: str | None = None,
        weight_version: int = 0,
    ) -> list[dict[str, Any]]:
        """Sample the base model (``directory`` None) or the weights saved in ``directory`` (a
        checkpoint the tenant calls ``shown_as``, its sequences marked ``weight_version``),
        without a training run; ``messages`` prompts are encoded with the base model's template.
        One ``SampleResponse`` per prompt, as a dict."""
        prompts, params = self.sample_request(inputs, sampling_params)
        template = self.sampler().template
        prompts = [_encoded_prompt(template, index, prompt) for index, prompt in enumerate(prompts)]
        adapter = None if directory is None else self.sampler_adapter(directory, shown_as)
        return [asdict(response) for response in self.generate(prompts, params, adapter, weight_version)]

    def generate(
        self, prompts: list[dict[str, Any]], params: SamplingParams, adapter: str | None, weight_version: int = 0
    ) -> list[Any]:
        """Sample encoded ``prompts`` (``input_ids`` checked) from ``adapter`` (None: the base
        model); one ``SampleResponse`` per prompt."""
        self.check_sampling_params(params)
        self._check_prompt_lengths(list(enumerate(p['input_ids'] for p in prompts)), params)
        sampler = self.sampler()
        sampler.weight_version = weight_version
        return sampler.sample(prompts, params, adapter_name=adapter)

    def sampler_adapter(self, directory: Path, shown_as: str | None = None) -> str:
        """The adapter holding the saved weights in ``directory`` (a ``save`` of any adapter),
        loaded on first use and again once the directory holds a newer save (a sampler group
        of its own sees each sync of a run into the same directory); at most
        ``MAX_SAMPLER_ADAPTERS`` stay loaded. Errors name ``shown_as`` (the tenant's path of the
        checkpoint) for ``directory``."""
        key, stamp = str(directory), _stamp(directory)
        loaded = self._sampler_adapters.get(key)
        if loaded is not None and loaded[0] == stamp:
            self._sampler_adapters.move_to_end(key)
            return loaded[1]
        self.forget_sampler_weights(directory)
        if len(self._sampler_adapters) >= MAX_SAMPLER_ADAPTERS:
            _, (_, oldest) = self._sampler_adapters.popitem(last=False)
            self.remove_adapter(oldest)
        adapter = f'{SAMPLER_PREFIX}{next(self._sampler_ids)}'
        with shown_to_tenant(directory, shown_as):
            self.model.add_adapter_to_model(adapter, key)
        self._sampler_adapters[key] = (stamp, adapter)
        return adapter

    def forget_sampler_weights(self, directory: Path) -> None:
        """Unload the adapter of ``directory``'s weights, if loaded (its checkpoint was deleted)."""
        loaded = self._sampler_adapters.pop(str(directory), None)
        if loaded is not None:
            self.remove_adapter(loaded[1])

    def sampler(self) -> TorchSampler:
        """The sampler over the model's own weights and adapters."""
        if self._sampler is None:
            self._sampler = TorchSampler.from_model(self.model.model, self.model_id)
        return self._sampler


#: The registry of the component each ``twinkle.wire.Configure`` field names.
_REGISTRIES: dict[str, Registry[Any]] = {
    'optimizer_cls': OPTIMIZERS,
    'scheduler_cls': SCHEDULERS,
    'loss_cls': LOSSES,
    'template_cls': TEMPLATES,
    'processor_cls': PROCESSORS,
    'metric': METRICS,
}
#: Constructor parameters the model fills in itself (the parameters, the optimizer, the model id).
_COMPONENT_SLOTS: dict[str, dict[str, Any]] = {
    'optimizer_cls': {'params': None},
    'scheduler_cls': {'optimizer': None},
    'template_cls': {'model_id': 'x'},
}


def base_dtype(config: ServerConfig) -> torch.dtype:
    """The dtype of the base weights: the config's, or for 'auto' bfloat16 on a GPU that has it
    (a device of ``cuda``, or none given where CUDA is there), float32 elsewhere."""
    if config.dtype != 'auto':
        return getattr(torch, config.dtype)
    device = config.device or ('cuda' if torch.cuda.is_available() else 'cpu')
    on_gpu = device.startswith('cuda') and torch.cuda.is_available()
    return torch.bfloat16 if on_gpu and torch.cuda.is_bf16_supported() else torch.float32


def _builds_components(operation: str) -> bool:
    """Whether ``operation`` hands its arguments to a component or a model method, whose
    ``TypeError`` / ``ValueError`` then means a bad argument (the user's error)."""
    return issubclass(OPERATIONS[operation], Configure) or not hasattr(ModelHost, f'_{operation}')


def _check_component(spec: type[Configure], kwargs: Mapping[str, Any]) -> None:
    """The component ``kwargs`` names is registered and its constructor takes the options."""
    field = spec.component_field
    registry = _REGISTRIES[field]
    name = kwargs.get(field, spec.model_fields[field].default)
    _check_name(registry.kind, name, registry.names())
    slots = _COMPONENT_SLOTS.get(field, {})
    options = {k: v for k, v in kwargs.items() if k not in spec.model_fields and k not in slots}
    component = registry.get(name)
    _bind(f'{registry.kind} {component.__name__}', component, options, slots)


def _bind(what: str, target: Callable[..., Any], kwargs: Mapping[str, Any], filled: Mapping[str, Any]) -> None:
    """``DataError`` unless ``target`` accepts ``kwargs`` (besides what the server fills in)."""
    signature = inspect.signature(target)
    try:
        signature.bind(**filled, **kwargs)
    except TypeError as e:
        accepted = [n for n, p in signature.parameters.items() if n not in filled and p.kind not in (p.VAR_POSITIONAL,)]
        raise DataError(f'{what}: {e}; it accepts {accepted}') from None


@contextmanager
def shown_to_tenant(path: Path, shown_as: str | None) -> Iterator[None]:
    """Errors raised inside name ``shown_as`` (what the tenant calls the checkpoint) where they
    would name ``path``, the server's directory of it: a tenant never sees the data directory."""
    try:
        yield
    except TwinkleError as error:
        if shown_as is not None:
            error.args = tuple(a.replace(str(path), shown_as) if isinstance(a, str) else a for a in error.args)
        raise


def is_mixable(operation: str, kwargs: Mapping[str, Any]) -> bool:
    """Whether a request can share a pass with other adapters' requests: ``forward_backward``
    without micro-batches, ``forward_only`` through the adapter (not the base model alone), or
    ``clip_grad_and_step`` (stepped together, ``ModelHost.run_steps``)."""
    if operation == 'clip_grad_and_step':
        return True
    if operation == 'forward_backward':
        return 'micro_batch_size' not in kwargs
    return operation == 'forward_only' and not kwargs.get('disable_lora', False)


def request_tokens(inputs: Any) -> int:
    """Tokens in a request's rows (checked already), for the pass's token budget."""
    rows = [inputs] if isinstance(inputs, Mapping) else inputs
    return sum(len(row['input_ids']) for row in rows)


def _stamp(directory: Path) -> tuple[int, int] | None:
    """Which save a checkpoint directory holds: a save swaps in a new directory (another inode)."""
    try:
        status = directory.stat()
    except OSError:
        return None  # gone: loading it says so, naming the tenant's path
    return status.st_ino, status.st_mtime_ns


def _row_logps(output: ModelOutput, features: list[InputFeature]) -> list[list[float]]:
    return [output.logps[i, : len(f['input_ids'])].tolist() for i, f in enumerate(features)]


def _brief(kwargs: Mapping[str, Any]) -> str:
    return ', '.join(f'{k}={str(v)[:40]}' for k, v in kwargs.items())


def _feature(index: int, row: dict[str, Any], vocab: int) -> InputFeature:
    """A row the wire checked (``twinkle.wire.InputRow``: integer ids >= 0, labels, equal
    lengths), checked against the vocabulary."""
    bad = next((t for t in row['input_ids'] if t >= vocab), None)
    if bad is not None:
        raise DataError(f'input row {index} has token id {bad}, outside the vocabulary [0, {vocab})')
    bad = next((t for t in row['labels'] if t >= vocab), None)
    if bad is not None:
        raise DataError(f'input row {index} has label {bad}: labels are {IGNORE_INDEX} or token ids in [0, {vocab})')
    return cast(InputFeature, row)  # an InputRow's fields: input_ids, labels and the token fields it has


def _prompt(index: int, prompt: dict[str, Any], vocab: int) -> dict[str, Any]:
    """A prompt the wire checked (``twinkle.wire.Prompt``), its token ids in the vocabulary;
    the template checks the roles of ``messages`` when it encodes them."""
    bad = next((t for t in prompt.get('input_ids') or [] if t >= vocab), None)
    if bad is not None:
        raise DataError(f'prompt {index} has token id {bad}, outside the vocabulary [0, {vocab})')
    return prompt


def _encoded_prompt(template: Template, index: int, prompt: dict[str, Any]) -> dict[str, Any]:
    """``prompt`` with ``input_ids``: its own, or its ``messages`` encoded for generation."""
    if 'input_ids' in prompt:
        return prompt
    try:
        feature = template.encode(prompt, add_generation_prompt=True)
    except TwinkleError:
        raise
    except Exception as e:  # the chat template refusing the tenant's messages (a jinja error, a bad type)
        raise DataError(f'prompt {index}: its messages cannot be encoded: {type(e).__name__}: {e}') from e
    if feature is None:
        raise DataError(f"prompt {index} is over the template's max_length and its truncation_strategy drops it")
    return {**prompt, 'input_ids': feature['input_ids']}


def _check_name(kind: str, name: Any, valid: list[str]) -> None:
    if not isinstance(name, str) or name not in valid:
        raise UnknownNameError(kind, name, valid)


def _check_scalars(operation: str, kwargs: Mapping[str, Any]) -> None:
    """Plain JSON values only, and no NaN or infinity."""
    for key, value in kwargs.items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                raise DataError(f'{operation} argument {key!r} is {item}; it must be a finite number')
