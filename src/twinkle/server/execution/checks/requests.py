"""What a request must satisfy before it is queued, and the helpers every host uses to read one.

``RequestChecks`` answers the checks that need the model's shape (vocabulary, context) and the
limits, not its weights, where the routes run: a ``ModelHost`` in the server's process, a
``MultiRankHost`` without a round trip to its workers, a vLLM sampler group without a trainer.
"""

from __future__ import annotations

import inspect
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from twinkle.data_format import IGNORE_INDEX, InputFeature, SampleResponse, SamplingParams
from twinkle.errors import (
    ConfigurationError,
    DataError,
    FieldError,
    SequenceTooLongError,
    TwinkleError,
    UnknownNameError,
)
from twinkle.loss import LOSSES
from twinkle.metric import METRICS
from twinkle.model.optim.registry import OPTIMIZERS, SCHEDULERS, check_optimizer_args, check_scheduler_args
from twinkle.processor import PROCESSORS
from twinkle.registry import Registry
from twinkle.server.config import ServerConfig
from twinkle.server.execution.checks.images import ImageRows, Images, ImageSlot, RowImages, data_url_bytes
from twinkle.template import TEMPLATES, Template
from twinkle.wire import LORA_FIELDS, OPERATIONS, Configure

#: JSON as the wire checked it: a request's arguments, rows and prompts, an operation's result. Its shape is
#: each operation's (``twinkle.wire.OPERATIONS``); this ``Any`` is JSON and nothing else.
Json = Any
JsonObject = dict[str, Json]
#: The result of one request of a shared pass, or the error of that request alone (the others keep theirs).
Outcome = Json | Exception
#: Most top-k logprobs per token a sampling request may ask for (vLLM's default ``max_logprobs``).
MAX_TOP_LOGPROBS = 20
#: Saved sampler weights kept loaded as adapters at once; the least recently used one goes first.
MAX_SAMPLER_ADAPTERS = 4


class RequestChecks:
    """What a request must satisfy before it is queued: the checks that need the model's
    shape (vocabulary, context) and the limits, not its weights. A host answers them where the
    routes run (``MultiRankHost`` without a round trip to its workers)."""

    config: ServerConfig
    vocab_size: int
    context: int | None
    device: torch.device
    #: A vision-language model's: how its rows' images are checked and decoded (else None).
    image_rows: ImageRows | None = None

    def check_adapter(self, lora: Mapping[str, Json]) -> None:
        """Known LoRA fields and a rank within the limit (room on the model is the service's
        to make, ``AdapterPool.make_room``; ``add_adapter`` checks that it is there)."""
        limits = self.config.limits
        unknown = sorted(set(lora) - LORA_FIELDS)
        if unknown:
            raise ConfigurationError(f'unknown LoRA fields {unknown}; accepted: {sorted(LORA_FIELDS)}')
        rank, limit = lora.get('r', 8), limits.max_lora_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 < rank <= limit:
            raise ConfigurationError(
                f"LoRA rank r={rank!r} must be an integer in [1, {limit}]: {limit} is this server's "
                'limits.max_lora_rank (ServerConfig), which its operator may raise'
            )
        if self.config.backend == 'megatron':
            check_megatron_targets(lora)

    def validate(self, operation: str, kwargs: JsonObject) -> None:
        """What the request's wire model (``twinkle.wire.OPERATIONS[operation]``, checked at the
        route) cannot check: a registered component that takes these options, token ids in the
        vocabulary, lengths within the context and the request limits. The server runs it before
        queueing, so bad input is a 4xx and not a failed future."""
        spec = OPERATIONS[operation]
        if issubclass(spec, Configure):
            _check_component(spec, kwargs)
        if operation == 'sample':
            self.sample_request(kwargs['inputs'], kwargs.get('sampling_params'), decode=False)
        elif 'inputs' in kwargs:
            self.features(kwargs['inputs'], decode=False)
        if operation == 'set_optimizer':  # lr=-1 or lr='fast': a 4xx now, not a failed future at the step
            options = {k: v for k, v in kwargs.items() if k != 'optimizer_cls'}
            check_optimizer_args(kwargs.get('optimizer_cls', 'AdamW'), options, self.device)
        elif operation == 'set_lr_scheduler':
            check_scheduler_args(kwargs['scheduler_cls'], {k: v for k, v in kwargs.items() if k != 'scheduler_cls'})

    def sample_request(
        self, inputs: list[JsonObject], sampling_params: JsonObject | None, decode: bool = True
    ) -> tuple[list[JsonObject], SamplingParams]:
        """The prompts (``twinkle.wire.Prompt`` s) and parameters of a ``sample`` request,
        checked: known parameters with valid values, prompt token ids in the vocabulary, and
        (for prompts given as token ids; ``messages`` are counted once encoded, on the worker)
        each prompt plus ``max_tokens`` within the model context and the request within the
        token limit; a prompt's ``images`` decoded into its pixels (``decode=False``, where a request
        is accepted: checked, ``check_images``, and left as they are)."""
        params = SamplingParams.from_dict(sampling_params)
        self.check_sampling_params(params)
        self.check_image_count(inputs)
        prompts = [_prompt(i, row, self.vocab_size) for i, row in enumerate(inputs)]
        self.check_prompt_lengths([(i, p['input_ids']) for i, p in enumerate(prompts) if 'input_ids' in p], params)
        if not decode:
            self.check_images(_row_images('prompt', prompts))
            return prompts, params
        return [self.with_images(f'prompt {i}', prompt) for i, prompt in enumerate(prompts)], params

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
        if self.context is None or params.max_tokens < self.context:  # else the context's check says it better
            self.check_sampled_tokens(params, prompts=1)
        sampler = self.config.sampler
        on_cpu_vllm = sampler is not None and sampler.backend == 'vllm' and self.device.type == 'cpu'
        if on_cpu_vllm and (params.prompt_logprobs or params.topk_prompt_logprobs):
            raise ConfigurationError(
                "prompt logprobs are not served by this server's sampler (vLLM's CPU build fails on them with LoRA "
                "enabled); ask for the sampled tokens' logprobs only, or use a server with the torch sampler"
            )

    def check_prompt_lengths(self, prompts: list[tuple[int, list[int]]], params: SamplingParams) -> None:
        """Each prompt plus ``max_tokens`` fits the context; the request's sequences (prompt
        plus ``max_tokens``, ``num_samples`` times per prompt) fit the token limit."""
        for index, ids in prompts:
            if self.context is not None and len(ids) + params.max_tokens > self.context:
                raise SequenceTooLongError(
                    f'prompt {index} has {len(ids)} tokens; with max_tokens={params.max_tokens} it would exceed '
                    f'the model context of {self.context} tokens'
                )
        self.check_sampled_tokens(params, prompts=len(prompts))
        total = params.num_samples * sum(len(ids) + params.max_tokens for _, ids in prompts)
        limit = self.config.limits.max_tokens_per_request
        if total > limit:
            raise DataError(
                f'sampling would hold up to {total} tokens (num_samples={params.num_samples} sequences per prompt, '
                f'each the prompt plus max_tokens={params.max_tokens}), over the limit of {limit} per request'
            )

    def check_sampled_tokens(self, params: SamplingParams, prompts: int) -> None:
        """The tokens a request of ``prompts`` prompts asks to sample (``num_samples`` x ``max_tokens``
        each) within ``max_sampled_tokens_per_request``: a 400 naming the limit (``max_tokens``, as
        OpenAI's routes name the field at fault)."""
        asked = prompts * params.num_samples * params.max_tokens
        limit = self.config.limits.max_sampled_tokens_per_request
        if asked > limit:
            each = f'{prompts} prompts x ' if prompts > 1 else ''
            raise FieldError(
                f'{each}{params.num_samples} samples of up to max_tokens={params.max_tokens} would generate {asked} '
                f'tokens, over the limit of max_sampled_tokens_per_request={limit}: ask for fewer samples or tokens',
                'max_tokens',
            )

    def features(self, inputs: list[JsonObject], decode: bool = True) -> list[InputFeature]:
        """Encoded rows (``twinkle.wire.InputRow`` s) checked against the model: token ids and
        labels in the vocabulary, the request's token total within the limit, and a row's
        ``images`` decoded into its pixels (``ImageRows.attach``; ``decode=False``, where a request
        is accepted: checked, ``check_images``, and left as they are)."""
        self.check_image_count(inputs)
        features = [_feature(index, row, self.vocab_size) for index, row in enumerate(inputs)]
        total, limit = sum(len(feature['input_ids']) for feature in features), self.config.limits.max_tokens_per_request
        if total > limit:
            raise DataError(f'the request holds {total} tokens, over the limit of {limit} per request')
        if not decode:
            self.check_images(_row_images('input row', features))
            return features
        return [self.with_images(f'input row {index}', feature) for index, feature in enumerate(features)]

    def check_images(self, rows: Sequence[RowImages]) -> None:
        """A request's images, where it is accepted, before it is queued: every route that takes
        images calls this, for both APIs (the native rows and prompts, Tinker's datums and prompts),
        so each limit is held in one place (``ImageRows.check``)."""
        count = sum(len(row.files) for row in rows)
        if count == 0:
            return
        if self.image_rows is None:
            raise DataError(f'the request holds {count} images, but this model takes no images (a text model)')
        self.image_rows.check(rows)

    def check_image_count(self, rows: list[JsonObject], count: int | None = None) -> None:
        """The images of a request's rows or prompts (or ``count`` of them): a model that takes
        them, within the limit."""
        count = sum(len(row.get('images') or ()) for row in rows) if count is None else count
        if count == 0:
            return
        if self.image_rows is None:
            raise DataError(f'the request holds {count} images, but this model takes no images (a text model)')
        self.image_rows.check_count(count)

    def image_row(self, where: str, tokens: list[int], slots: Sequence[ImageSlot]) -> JsonObject:
        """A Tinker datum's or prompt's tokens as a row, its image chunks (``slots``) made the image
        pad id and the images' pixels (the request's image count is the caller's to check)."""
        if not slots:
            return {'input_ids': tokens}
        if self.image_rows is None:
            raise DataError(f'{where} holds {len(slots)} image chunks, but this model takes no images (a text model)')
        return self.image_rows.fill(where, tokens, slots)

    def with_images(self, where: str, row: Any) -> Any:
        """``row`` with its ``images`` (data URLs) made pixels, grids and image token types."""
        urls = row.get('images')
        if not urls or self.image_rows is None:  # no images, or none allowed (check_image_count refused them)
            return row
        data = [data_url_bytes(f'{where} image {j}', url) for j, url in enumerate(urls)]
        return self.image_rows.attach(where, {k: v for k, v in row.items() if k != 'images'}, data)


def _row_images(kind: str, rows: Sequence[Any]) -> list[RowImages]:
    """The images of a request's rows (``kind`` 'input row') or prompts ('prompt'), as data URLs decoded."""
    out = []
    for index, row in enumerate(rows):
        where = f'{kind} {index}'
        files = [data_url_bytes(f'{where} image {j}', url) for j, url in enumerate(row.get('images') or [])]
        out.append(RowImages(where, row.get('input_ids', []), files))
    return out


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
_COMPONENT_SLOTS: dict[str, JsonObject] = {
    'optimizer_cls': {'params': None},
    'scheduler_cls': {'optimizer': None},
    'template_cls': {'model_id': 'x'},
}


#: The Hugging Face projections megatron's LoRA adapts (``twinkle.model.megatron.lora.PROJECTIONS``),
#: by their block: what Tinker's ``train_attn`` and ``train_mlp`` name on a megatron model.
MEGATRON_PROJECTIONS = {
    'attn': ['k_proj', 'o_proj', 'q_proj', 'v_proj'],
    'mlp': ['down_proj', 'gate_proj', 'up_proj'],
}


def check_megatron_targets(lora: Mapping[str, Json]) -> None:
    """LoRA on a megatron model reaches the attention and MLP projections, not the output head."""
    targets = lora.get('target_modules')
    if isinstance(targets, list) and 'lm_head' in targets:
        accepted = MEGATRON_PROJECTIONS['attn'] + MEGATRON_PROJECTIONS['mlp']
        raise ConfigurationError(
            f'target_modules {targets} include the output head lm_head, which LoRA on backend: megatron does not '
            f"adapt; accepted: {accepted} or 'all-linear' (a Tinker training client: create it with "
            'train_unembed=False)'
        )


def _check_component(spec: type[Configure], kwargs: Mapping[str, Json]) -> None:
    """The component ``kwargs`` names is registered and its constructor takes the options."""
    field = spec.component_field
    registry = _REGISTRIES[field]
    name = kwargs.get(field, spec.model_fields[field].default)
    check_name(registry.kind, name, registry.names())
    slots = _COMPONENT_SLOTS.get(field, {})
    options = {k: v for k, v in kwargs.items() if k not in spec.model_fields and k not in slots}
    component = registry.get(name)
    _bind(f'{registry.kind} {component.__name__}', component, options, slots)


def _bind(what: str, target: Callable[..., object], kwargs: Mapping[str, Json], filled: Mapping[str, Json]) -> None:
    """``DataError`` unless ``target`` accepts ``kwargs`` (besides what the server fills in)."""
    signature = inspect.signature(target)
    try:
        signature.bind(**filled, **kwargs)
    except TypeError as e:
        accepted = [n for n, p in signature.parameters.items() if n not in filled and p.kind not in (p.VAR_POSITIONAL,)]
        raise DataError(f'{what}: {e}; it accepts {accepted}') from None


def check_name(kind: str, name: object, valid: list[str]) -> None:
    if not isinstance(name, str) or name not in valid:
        raise UnknownNameError(kind, name, valid)


def _feature(index: int, row: JsonObject, vocab: int) -> InputFeature:
    """A row the wire checked (``twinkle.wire.InputRow``: integer ids >= 0, labels, equal
    lengths), checked against the vocabulary."""
    bad = next((t for t in row['input_ids'] if t >= vocab), None)
    if bad is not None:
        raise DataError(f'input row {index} has token id {bad}, outside the vocabulary [0, {vocab})')
    bad = next((t for t in row['labels'] if t >= vocab), None)
    if bad is not None:
        raise DataError(f'input row {index} has label {bad}: labels are {IGNORE_INDEX} or token ids in [0, {vocab})')
    return cast(InputFeature, row)  # an InputRow's fields: input_ids, labels and the token fields it has


def _prompt(index: int, prompt: JsonObject, vocab: int) -> JsonObject:
    """A prompt the wire checked (``twinkle.wire.Prompt``), its token ids in the vocabulary;
    the template checks the roles of ``messages`` when it encodes them."""
    bad = next((t for t in prompt.get('input_ids') or [] if t >= vocab), None)
    if bad is not None:
        raise DataError(f'prompt {index} has token id {bad}, outside the vocabulary [0, {vocab})')
    return prompt


def encoded_prompt(template: Template, index: int, prompt: JsonObject) -> JsonObject:
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


class SavedWeightsSampler(Protocol):
    """What samples saved weights: the checks of a request, the adapter of a checkpoint, generation."""

    def sample_request(
        self, inputs: list[JsonObject], sampling_params: JsonObject | None
    ) -> tuple[list[JsonObject], SamplingParams]: ...

    def sampler_adapter(self, directory: Path, shown_as: str | None = None) -> str: ...

    def check_image_count(self, rows: list[JsonObject], count: int | None = None) -> None: ...

    def image_row(self, where: str, tokens: list[int], slots: Sequence[ImageSlot]) -> JsonObject: ...

    def generate(
        self, prompts: list[JsonObject], params: SamplingParams, adapter: str | None, weight_version: int = 0
    ) -> list[SampleResponse]: ...


@dataclass(frozen=True)
class SavedWeights:
    """A checkpoint's weights to sample: its folder, what the tenant calls it (errors name that,
    never the folder), and the optimizer step they were saved at (each sequence's ``weight_version``)."""

    directory: Path
    shown_as: str | None = None
    version: int = 0


def sample_saved(
    sampler: SavedWeightsSampler,
    template: Template,
    inputs: list[JsonObject],
    sampling_params: JsonObject | None,
    weights: SavedWeights | None,
) -> list[JsonObject]:
    """Sample the base model (``weights`` None) or saved weights; ``messages`` prompts are encoded
    with ``template``. One ``SampleResponse`` per prompt, as a dict."""
    prompts, params = sampler.sample_request(inputs, sampling_params)
    prompts = [encoded_prompt(template, index, prompt) for index, prompt in enumerate(prompts)]
    adapter = None if weights is None else sampler.sampler_adapter(weights.directory, weights.shown_as)
    version = 0 if weights is None else weights.version
    return responses_json(sampler.generate(prompts, params, adapter, version), inputs)


def responses_json(responses: list[SampleResponse], inputs: list[JsonObject]) -> list[JsonObject]:
    """The responses to ``inputs`` (the request's prompts, as the wire checked them) as JSON. A
    prompt with images gives each sequence's ``new_input_feature`` the prompt's ``images`` (data
    URLs) for its pixels, so the row trains as the wire takes it (``twinkle.wire.InputRow``)."""
    out = []
    for response, prompt in zip(responses, inputs, strict=True):
        data = asdict(response)
        for sequence in data['sequences']:
            feature = sequence['new_input_feature']
            if feature.pop('pixel_values', None) is not None:
                feature.pop('image_grid_thw', None)
                feature.pop('mm_token_type_ids', None)
                feature['images'] = prompt['images']
        out.append(data)
    return out


def sample_prompt(
    sampler: SavedWeightsSampler,
    prompt: list[int],
    params: SamplingParams,
    weights: SavedWeights | None,
    images: Images = (),
) -> SampleResponse:
    """Sample one prompt of token ids (checked; its image chunks ``images`` made pixels) from the
    base model (``weights`` None) or saved weights."""
    sampler.check_image_count([], count=len(images))
    row = sampler.image_row('the prompt', prompt, images)
    adapter = None if weights is None else sampler.sampler_adapter(weights.directory, weights.shown_as)
    return sampler.generate([row], params, adapter)[0]


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


def checkpoint_stamp(directory: Path) -> tuple[int, int] | None:
    """Which save a checkpoint directory holds: a save swaps in a new directory (another inode)."""
    try:
        status = directory.stat()
    except OSError:
        return None  # gone: loading it says so, naming the tenant's path
    return status.st_ino, status.st_mtime_ns


class SavedAdapters:
    """Adapters holding checkpoints' saved weights, by directory: loaded on first use and again
    once the directory holds a newer save; at most ``MAX_SAMPLER_ADAPTERS`` stay loaded, the
    least recently used unloaded first. ``load(adapter, directory)`` and ``unload(adapter)`` act
    on whatever samples (the model's own adapters, a vLLM engine's)."""

    def __init__(self, prefix: str, load: Callable[[str, Path], None], unload: Callable[[str], None]):
        self._prefix, self._load, self._unload = prefix, load, unload
        self._held: OrderedDict[str, tuple[tuple[int, int] | None, str]] = OrderedDict()  # directory -> (save, adapter)
        self._ids = itertools.count()

    def __contains__(self, directory: str) -> bool:
        return directory in self._held

    def adapter(self, directory: Path, shown_as: str | None = None) -> str:
        """The adapter of ``directory``'s weights; errors name ``shown_as`` (the tenant's path)."""
        key, stamp = str(directory), checkpoint_stamp(directory)
        held = self._held.get(key)
        if held is not None and held[0] == stamp:
            self._held.move_to_end(key)
            return held[1]
        self.forget(directory)
        if len(self._held) >= MAX_SAMPLER_ADAPTERS:
            _, (_, oldest) = self._held.popitem(last=False)
            self._unload(oldest)
        adapter = f'{self._prefix}{next(self._ids)}'
        with shown_to_tenant(directory, shown_as):
            self._load(adapter, directory)
        self._held[key] = (stamp, adapter)
        return adapter

    def forget(self, directory: Path) -> None:
        """Unload the adapter of ``directory``'s weights, if loaded (its checkpoint was deleted)."""
        held = self._held.pop(str(directory), None)
        if held is not None:
            self._unload(held[1])


__all__ = [
    'MAX_SAMPLER_ADAPTERS',
    'MAX_TOP_LOGPROBS',
    'Json',
    'JsonObject',
    'RequestChecks',
    'SavedAdapters',
    'SavedWeights',
    'checkpoint_stamp',
    'encoded_prompt',
    'sample_prompt',
    'sample_saved',
    'shown_to_tenant',
]
