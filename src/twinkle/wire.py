"""The native API's wire: what a request to ``/twinkle/v1`` holds and what it answers, in one place.

The server validates each request against these models once, at its route; the client
(``twinkle_client``) builds its requests from them. No torch and no server here: a client needs
only pydantic to speak the API. A compute operation is ``POST /twinkle/v1/runs/{run_id}/ops/{name}``
with the body ``OPERATIONS[name]``; adding one is a model in that table and its handler on the
server (``ModelHost._<name>``, or the model's method of the same name).

>>> request = SetOptimizer(optimizer_cls='AdamW', options={'lr': 1e-4})
>>> request.arguments()
{'optimizer_cls': 'AdamW', 'lr': 0.0001}
>>> sorted(name for name, op in OPERATIONS.items() if op.setup)
['add_metric', 'set_loss', 'set_lr_scheduler', 'set_optimizer', 'set_processor', 'set_template']
>>> parse_twinkle_path('twinkle://run-1a2b3c/checkpoints/step-10')
('run-1a2b3c', 'step-10')
"""

from __future__ import annotations

import math
import re
from typing import Annotated, ClassVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    FailFast,
    Field,
    JsonValue,
    StrictBool,
    field_validator,
    model_validator,
)

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import DataError

#: InputFeature fields a row of ``inputs`` may hold.
FEATURE_FIELDS = ('input_ids', 'attention_mask', 'position_ids', 'labels', 'completion_mask')
#: peft ``LoraConfig`` fields a run's ``lora`` may set.
LORA_FIELDS = frozenset(
    {
        'r',
        'lora_alpha',
        'lora_dropout',
        'target_modules',
        'target_parameters',
        'bias',
        'use_rslora',
        'init_lora_weights',
    }
)
#: Fields of a prompt to sample from.
PROMPT_FIELDS = ('input_ids', 'messages', 'tools')
TWINKLE_SCHEME = 'twinkle://'
TINKER_SCHEME = 'tinker://'
#: The folder of a checkpoint path, and the kind of checkpoint it names.
PATH_FOLDERS = {
    'checkpoints': 'training',
    'weights': 'training',
    'sampler_weights': 'sampler',
    'external_weights': 'external',
}
_PATH_PART = re.compile(r'[A-Za-z0-9_-][A-Za-z0-9._:-]*')
#: The figures a model records at each optimizer step itself (a run's history).
STEP_FIGURES = ('step', 'loss', 'lr', 'grad_norm', 'tokens_per_s')
#: Names a run's history gives its own figures: a trainer's figures take others.
RESERVED_FIGURES = (*STEP_FIGURES, 'time')
_FIGURE_NAME = re.compile(r'[A-Za-z][A-Za-z0-9_./-]{0,63}')
#: Integers a 64-bit SQLite column or torch seed takes.
INT64 = 2**63


def _finite(value: JsonValue) -> JsonValue:
    """No NaN or infinity anywhere in ``value``: JSON has none, but Python's ``json`` writes them."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f'{value} is not a finite number')
    for item in value.values() if isinstance(value, dict) else value if isinstance(value, list) else ():
        _finite(item)
    return value


#: Any JSON value without NaN or infinity (``allow_inf_nan`` does not reach inside ``JsonValue``).
FiniteJson = Annotated[JsonValue, AfterValidator(_finite)]
#: A JSON object without NaN or infinity. Its validation, as that of every list and object of a
#: request (``fail_fast``), stops at the first bad value: a body of a million bad values is a 422
#: of one problem, answered in the time of one.
FiniteObject = Annotated[dict[str, FiniteJson], FailFast()]


def _whole(value: object) -> object:
    """A JSON number without a fraction (``2.0``) as the integer it is: JSON has one kind of number
    and JSON Schema's ``integer`` takes ``2.0``. Strict validation still refuses ``2.5``, ``'2'`` and ``true``."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _whole_numbers(values: object) -> object:
    """``_whole`` over a list, copied only when it holds a float (a list of a million ints is not)."""
    if isinstance(values, list) and float in map(type, values):  # a scan in C: ~20 ms per million
        return [_whole(value) for value in values]
    return values


#: An integer of a request: ``2`` or ``2.0`` (constraints go before the validator, inside ``Annotated``,
#: for the schema to state them).
Int = Annotated[int, BeforeValidator(_whole)]
#: Integers of a request (token ids, labels): ``2`` or ``2.0``; validation stops at the first bad one.
Ints = Annotated[list[int], Field(fail_fast=True), BeforeValidator(_whole_numbers)]

#: An image of a row or prompt: the bytes of its file (PNG, JPEG...) as a base64 data URL. The
#: server decodes it; paths and remote URLs are not taken (a server reads no client's path).
ImageURL = Annotated[str, Field(pattern=r'^data:image/[A-Za-z0-9.+-]+;base64,[A-Za-z0-9+/=\s]*$')]

#: An adapter or checkpoint name (the server's store checks it, and that a checkpoint's is not one of
#: its reserved folder names).
NAME_PATTERN = '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$'

# What the schema declares beyond the types, so that a request that fits the schema is served (the
# validators below check the same; the server checks what needs the model: ids in its vocabulary).
#: A token id.
TOKEN_ID: dict[str, JsonValue] = {'type': 'integer', 'minimum': 0}
#: A label: a token id, or IGNORE_INDEX where the row is not trained on.
LABEL: dict[str, JsonValue] = {'anyOf': [TOKEN_ID, {'const': IGNORE_INDEX}]}
#: A chat message of a prompt.
MESSAGE: dict[str, JsonValue] = {
    'type': 'object',
    'required': ['role', 'content'],
    'properties': {'role': {'type': 'string'}, 'content': {'anyOf': [{'type': 'string'}, {'type': 'null'}]}},
}
#: The fields of a run's ``lora``.
LORA_NAMES: dict[str, JsonValue] = {'enum': [name for name in sorted(LORA_FIELDS)]}
#: A prompt has its token ids or its messages; its images go with its token ids.
PROMPT: dict[str, JsonValue] = {
    'anyOf': [{'required': [name], 'properties': {name: {'type': 'array'}}} for name in ('input_ids', 'messages')],
    'dependentSchemas': {'images': {'required': ['input_ids'], 'properties': {'input_ids': {'type': 'array'}}}},
}
#: The name of a figure of the trainer's own.
FIGURE_NAME: dict[str, JsonValue] = {'pattern': f'^{_FIGURE_NAME.pattern}$', 'not': {'enum': list(RESERVED_FIGURES)}}


#: The header of a compute request that may wait this many seconds for room in its tenant's queue
#: instead of being refused with a 429 when the queue is full (``limits.max_queued_per_tenant``).
QUEUE_HEADER = 'X-Twinkle-Queue'
#: The longest such wait, in seconds.
MAX_QUEUE_WAIT_S = 600.0
#: The header that names one compute request (``TwinkleClient`` sends a UUID per call, the same on each
#: retry of it): the request sent again with the same key runs no second time, it is answered the
#: first one's future (``twinkle.server.api.idempotency``).
IDEMPOTENCY_HEADER = 'Idempotency-Key'
#: The binary body of the native API (``twinkle.server.api.binary``): a request sent with this
#: ``Content-Type`` is read as MessagePack, and one that ``Accept``-s it is answered in it.
MSGPACK = 'application/msgpack'
#: Every spelling of MessagePack's media type the server takes.
MSGPACK_TYPES = frozenset({MSGPACK, 'application/x-msgpack', 'application/vnd.msgpack'})


class Wire(BaseModel):
    """Strict JSON: no unknown fields, no '1' for 1 or 1 for true, no NaN or infinity."""

    model_config = ConfigDict(extra='forbid', strict=True, allow_inf_nan=False)


# ---- runs and checkpoints -----------------------------------------------------------------------------
class CreateRun(Wire):
    """``POST /twinkle/v1/runs``: a training run, one LoRA adapter on the server's base model."""

    adapter_name: str = Field('default', json_schema_extra={'pattern': NAME_PATTERN})
    #: peft ``LoraConfig`` fields (``LORA_FIELDS``); the server checks the values it allows.
    lora: FiniteObject = Field(default_factory=dict, json_schema_extra={'propertyNames': LORA_NAMES})
    gradient_accumulation_steps: Int = Field(1, gt=0)
    #: One of the server's base models (``GET /server``); None: its default.
    base_model: str | None = None
    #: Draw the adapter's initial weights from this seed (reproducible runs); torch takes 64 bits.
    seed: Annotated[int, Field(ge=-INT64, lt=2 * INT64), BeforeValidator(_whole)] | None = None


class SaveRequest(Wire):
    """``POST /twinkle/v1/runs/{run_id}/save``."""

    name: str = Field(json_schema_extra={'pattern': NAME_PATTERN})
    save_optimizer: StrictBool = False


class LoadRequest(Wire):
    """``POST /twinkle/v1/runs/{run_id}/load``: a ``twinkle://<run_id>/checkpoints/<name>`` of this tenant."""

    path: str
    load_optimizer: StrictBool = False


class Answer(BaseModel):
    """A response: extra fields the server adds later are kept, so an older client still reads it."""

    model_config = ConfigDict(extra='allow')


class RunFields(BaseModel):
    """What a training run is, declared once: the server's record of a run (``twinkle.server.store.Run``)
    and its answer (``RunInfo``) both hold these fields."""

    id: str
    tenant_id: str
    base_model: str
    adapter_name: str
    #: The LoRA / optimizer configuration the run was created with, as the client sent it.
    config: dict[str, JsonValue]
    created_at: float
    last_request_at: float
    #: 'active', 'released' or 'deleted'.
    status: str
    #: The Tinker session that created the run (None for runs of the native API).
    session_id: str | None = None


class RunRestore(Answer):
    """A time the server brought the run back with less than it had: a model worker died and the
    run continued from its last saved state (at most ``save_state_every_steps - 1`` acknowledged
    optimizer steps behind), or it had only a checkpoint of weights alone (a fresh optimizer)."""

    time: float = Field(description='Unix time the run came back')
    step: int = Field(description='The optimizer step it continued from')
    checkpoint: str | None = Field(
        description="The twinkle:// path of the checkpoint it came from; null: the server's own saved state"
    )
    fresh_optimizer: bool = Field(description='Its optimizer started afresh (the checkpoint held weights alone)')
    lost_steps: int = Field(description='Recorded optimizer steps after `step` it lost (its history forgets them)')


class RunInfo(RunFields, Answer):
    training_run_id: str
    #: The last time the run came back with less than it had (None: never).
    restored_from: RunRestore | None = None


class RunList(Answer):
    runs: list[RunInfo]
    total: int


class CheckpointFields(BaseModel):
    """What a saved checkpoint is, declared once: the server's record (``twinkle.server.store.Checkpoint``,
    which adds where its files are) and its answer (``CheckpointInfo``) both hold these fields."""

    id: str
    run_id: str
    tenant_id: str
    name: str
    #: 'training', 'sampler' or 'external'.
    kind: str
    size_bytes: int
    created_at: float
    #: A published checkpoint may be loaded (never listed, changed or deleted) by other tenants.
    public: bool = False
    #: Unix time after which the checkpoint is deleted (None: kept until deleted).
    expires_at: float | None = None


class CheckpointInfo(CheckpointFields, Answer):
    twinkle_path: str


class CheckpointList(Answer):
    checkpoints: list[CheckpointInfo]


class RunStep(Answer):
    """A run's figures at one optimizer step; a figure the step did not have is absent."""

    step: int
    time: float = Field(description='Unix time the step was recorded')
    loss: float | None = Field(None, description="Mean loss of the step's forward_backward calls")
    lr: float | None = None
    grad_norm: float | None = Field(None, description='Gradient norm before clipping')
    tokens_per_s: float | None = None


class RunHistory(Answer):
    """A run's steps after ``after``, oldest first; ask again with ``after`` = the last step for more."""

    run_id: str
    steps: list[RunStep]
    #: The times the run came back with less than it had, oldest first (its steps after each were forgotten).
    restores: list[RunRestore] = Field(default_factory=list)


class FileLinks(Answer):
    """A checkpoint's weight files, each with a link that works without an API key until ``expires``."""

    urls: dict[str, str] = Field(description='file path in the checkpoint -> its download link')
    expires: float = Field(description='Unix time the links stop working')


class Deleted(Answer):
    deleted: bool


class FutureInfo(Answer):
    id: str
    tenant_id: str
    run_id: str | None
    op: str
    #: 'pending', 'running', 'done' or 'failed'.
    status: str
    result: JsonValue = None
    error: str | None = None
    #: Of a failure: 'user' (fix the request) or 'server'.
    category: str | None = None
    created_at: float
    finished_at: float | None = None


class FutureAccepted(Answer):
    """A compute request was queued; ``GET /twinkle/v1/futures/{future_id}`` follows it. A request
    sent with ``?wait=`` seconds is answered once its future settles or the wait ends: ``future``
    is then the future as it stands (settled: its result or error, with no poll to follow)."""

    future_id: str
    future: FutureInfo | None = None


class ServerInfo(Answer):
    #: The default base model (a run that names none trains it).
    base_model: str
    #: Every hosted base model, the default first (a server older than this field: none listed).
    base_models: list[str] = Field(default_factory=list)
    limits: dict[str, JsonValue]
    tenant: str


class UsageFigures(Answer):
    """What was used in a window (``GET /twinkle/v1/usage``), and what is stored now."""

    #: Tokens of forward and forward_backward requests.
    tokens_trained: int
    #: Prompt tokens sampled from (once per prompt).
    prompt_tokens_sampled: int
    #: Tokens sampled.
    tokens_sampled: int
    #: Seconds of a model worker (a pass shared by several requests split evenly).
    compute_seconds: float
    checkpoints_saved: int
    #: Checkpoints kept now, and their bytes.
    checkpoints_stored: int
    bytes_stored: int
    #: The window's cost by the server's prices (null: a kind used is not priced).
    cost_usd: float | None
    #: A month's cost of keeping what is stored now (null: storage is not priced).
    storage_usd_per_month: float | None


class RunUsage(UsageFigures):
    #: None: sampling without a run.
    run_id: str | None
    #: None: a run with checkpoints kept but no usage in the window.
    base_model: str | None


class TenantUsage(Answer):
    tenant: str
    runs: list[RunUsage]
    total: UsageFigures


class UsageReport(Answer):
    """Usage in the UTC hours that start in ``[since, until)`` (unix seconds): the caller's, or
    every tenant's for the admin key."""

    since: float
    until: float
    tenants: list[TenantUsage]


# ---- operations ---------------------------------------------------------------------------------------
class InputRow(Wire):
    """One encoded row to train or score on: token ids with labels (``IGNORE_INDEX`` where not
    trained). Other keys of a dataset's row (``messages``, ``user_data``...) are dropped."""

    model_config = ConfigDict(extra='ignore')

    input_ids: Ints = Field(min_length=1, json_schema_extra={'items': TOKEN_ID})
    labels: Ints = Field(json_schema_extra={'items': LABEL})
    attention_mask: Ints | None = None
    position_ids: Ints | None = None
    completion_mask: Ints | None = None
    #: A vision-language model's row: its images in order, one per run of image pad tokens in
    #: ``input_ids`` (as many pads as the image has merged patches, as ``VisionTemplate`` encodes).
    images: list[ImageURL] | None = Field(None, min_length=1, fail_fast=True)

    @model_validator(mode='after')
    def _aligned(self) -> InputRow:
        length = len(self.input_ids)
        for key in FEATURE_FIELDS:
            values = getattr(self, key)
            if values is not None and len(values) != length:
                raise ValueError(f'{key} has {len(values)} values; it must be as long as input_ids ({length})')
        if any(t < 0 for t in self.input_ids):
            raise ValueError('input_ids must be token ids >= 0')
        if any(t < 0 and t != IGNORE_INDEX for t in self.labels):
            raise ValueError(f'labels must be token ids >= 0 or {IGNORE_INDEX} (not trained on)')
        return self

    def feature(self) -> dict[str, JsonValue]:
        """The row as the model takes it: the fields it has."""
        return self.model_dump(exclude_none=True)


class Prompt(Wire):
    """A prompt to sample from: encoded ``input_ids``, or ``messages`` the run's template encodes.
    Other keys of a dataset's row (``user_data``...) are dropped."""

    model_config = ConfigDict(extra='ignore', json_schema_extra=PROMPT)

    input_ids: Ints | None = Field(None, min_length=1, json_schema_extra={'items': TOKEN_ID})
    messages: list[FiniteObject] | None = Field(
        None, min_length=1, fail_fast=True, json_schema_extra={'items': MESSAGE}
    )
    tools: list[FiniteObject] | None = Field(None, fail_fast=True)
    #: A vision-language model's prompt given as ``input_ids``: its images, as ``InputRow.images``.
    images: list[ImageURL] | None = Field(None, min_length=1, fail_fast=True)

    @field_validator('messages')
    @classmethod
    def _turns(cls, messages: list[dict[str, JsonValue]] | None) -> list[dict[str, JsonValue]] | None:
        for turn, message in enumerate(messages or []):
            content = message.get('content', ...)
            if not isinstance(message.get('role'), str) or not (content is None or isinstance(content, str)):
                raise ValueError(f'message {turn} needs a string role and a string (or null) content')
        return messages

    @model_validator(mode='after')
    def _something(self) -> Prompt:
        if self.input_ids is None and self.messages is None:
            raise ValueError("a prompt needs 'input_ids' or 'messages'")
        if any(t < 0 for t in self.input_ids or []):
            raise ValueError('input_ids must be token ids >= 0')
        if self.images is not None and self.input_ids is None:
            raise ValueError("a prompt's images go with its input_ids (image pad tokens expanded), not with messages")
        return self


class Operation(Wire):
    """A request of ``POST /twinkle/v1/runs/{run_id}/ops/{name}``."""

    #: Recorded per run and replayed when a released adapter comes back.
    setup: ClassVar[bool] = False

    def arguments(self) -> dict[str, JsonValue]:
        """The keyword arguments of the model method of the same name (JSON values)."""
        return self.model_dump(exclude_none=True)


class Configure(Operation):
    """Picks a component by its registered name and builds it with ``options``."""

    setup = True
    #: The field that names the component: the first one a subclass declares (``optimizer_cls``...).
    component_field: ClassVar[str]
    #: The component's constructor arguments (``lr``, ``betas``...), checked by the server against it.
    options: FiniteObject = Field(default_factory=dict)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: object) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls.component_field = next(name for name in cls.model_fields if name not in Configure.model_fields)

    @model_validator(mode='after')
    def _options_apart(self) -> Configure:
        clash = sorted(set(self.options) & set(type(self).model_fields))
        if clash:
            raise ValueError(f'options {clash} are fields of the request itself; set them there')
        return self

    def arguments(self) -> dict[str, JsonValue]:
        return {**self.model_dump(exclude={'options'}), **self.options}


class SetOptimizer(Configure):
    optimizer_cls: str = 'AdamW'


class SetLrScheduler(Configure):
    scheduler_cls: str


class SetLoss(Configure):
    loss_cls: str


class SetTemplate(Configure):
    """The tokenizer is always the base model's: a ``model_id`` option is ignored."""

    template_cls: str = 'Template'


class SetProcessor(Configure):
    processor_cls: str = 'InputProcessor'


class AddMetric(Configure):
    metric: str
    is_training: StrictBool = True


class ForwardBackward(Operation):
    inputs: list[InputRow] = Field(min_length=1, fail_fast=True)
    #: Run ``inputs`` in chunks of this many rows (one accumulation step either way).
    micro_batch_size: Annotated[int, Field(gt=0), BeforeValidator(_whole)] | None = None
    #: Per-row inputs of the loss (``advantages``, ``old_logps``...), passed to it by name.
    loss_inputs: FiniteObject = Field(default_factory=dict)

    @model_validator(mode='after')
    def _loss_inputs_apart(self) -> ForwardBackward:
        clash = sorted(set(self.loss_inputs) & {'inputs', 'micro_batch_size', 'adapter_name'})
        if clash:
            raise ValueError(f'loss_inputs {clash} are not loss inputs')
        return self

    def arguments(self) -> dict[str, JsonValue]:
        data: dict[str, JsonValue] = {'inputs': [row.feature() for row in self.inputs], **self.loss_inputs}
        if self.micro_batch_size is not None:
            data['micro_batch_size'] = self.micro_batch_size
        return data


class ForwardOnly(Operation):
    inputs: list[InputRow] = Field(min_length=1, fail_fast=True)
    #: Score with the base model alone, the adapter off.
    disable_lora: StrictBool = False

    def arguments(self) -> dict[str, JsonValue]:
        return {'inputs': [row.feature() for row in self.inputs], 'disable_lora': self.disable_lora}


class CalculateLoss(Operation):
    """The loss of the run's last ``forward_only`` (or forward): evaluation without a step; it
    feeds the evaluation metrics that ``calculate_metric(is_training=False)`` reads."""

    #: Per-row inputs of the loss (``advantages``, ``old_logps``...), passed to it by name.
    loss_inputs: FiniteObject = Field(default_factory=dict)

    @model_validator(mode='after')
    def _loss_inputs_apart(self) -> CalculateLoss:
        if 'adapter_name' in self.loss_inputs:
            raise ValueError("loss_inputs ['adapter_name'] is not a loss input")
        return self

    def arguments(self) -> dict[str, JsonValue]:
        return dict(self.loss_inputs)


class LogStepFigures(Operation):
    """Figures of the trainer's own (a mean reward, say), recorded with the run's next optimizer
    step in its history (``GET /twinkle/v1/runs/{id}/history``)."""

    figures: dict[str, float] = Field(
        min_length=1, max_length=32, fail_fast=True, json_schema_extra={'propertyNames': FIGURE_NAME}
    )

    @field_validator('figures')
    @classmethod
    def _own_figures(cls, figures: dict[str, float]) -> dict[str, float]:
        for name in figures:
            if name in RESERVED_FIGURES:
                raise ValueError(f'{name!r} is a figure the model records itself; the model records {RESERVED_FIGURES}')
            if not _FIGURE_NAME.fullmatch(name):
                raise ValueError(f'figure name {name[:64]!r}: 1 to 64 of A-Z a-z 0-9 _ . / -, starting with a letter')
        return figures


class Sample(Operation):
    inputs: list[Prompt] = Field(min_length=1, fail_fast=True)
    #: ``twinkle.data_format.SamplingParams`` fields; the server checks them.
    sampling_params: dict[str, FiniteJson] | None = Field(None, fail_fast=True)
    #: Sample the base model, every adapter off.
    base_model: StrictBool = False


class SampleWeights(Wire):
    """``POST /twinkle/v1/sample``: sample without a training run, the base model (``base_model``,
    None: the server's default) or saved weights (``model_path``: a ``twinkle://`` checkpoint of
    this tenant, or a published one), as ``Sample`` does for a run."""

    base_model: str | None = None
    model_path: str | None = None
    inputs: list[Prompt] = Field(min_length=1, fail_fast=True)
    sampling_params: dict[str, FiniteJson] | None = Field(None, fail_fast=True)


class ClipGradNorm(Operation):
    max_grad_norm: float = Field(1.0, gt=0)
    norm_type: float = 2.0


class ClipGradAndStep(Operation):
    max_grad_norm: float = Field(1.0, gt=0)


class CalculateMetric(Operation):
    is_training: StrictBool = True


class Step(Operation):
    pass


class ZeroGrad(Operation):
    pass


class LrStep(Operation):
    pass


class GetTrainConfigs(Operation):
    pass


#: Every operation of ``POST /twinkle/v1/runs/{run_id}/ops/{name}``, by name.
OPERATIONS: dict[str, type[Operation]] = {
    'set_optimizer': SetOptimizer,
    'set_lr_scheduler': SetLrScheduler,
    'set_loss': SetLoss,
    'set_template': SetTemplate,
    'set_processor': SetProcessor,
    'add_metric': AddMetric,
    'forward_backward': ForwardBackward,
    'forward_only': ForwardOnly,
    'calculate_loss': CalculateLoss,
    'sample': Sample,
    'clip_grad_norm': ClipGradNorm,
    'step': Step,
    'zero_grad': ZeroGrad,
    'lr_step': LrStep,
    'clip_grad_and_step': ClipGradAndStep,
    'calculate_metric': CalculateMetric,
    'log_step_figures': LogStepFigures,
    'get_train_configs': GetTrainConfigs,
}


# ---- checkpoint paths -----------------------------------------------------------------------------
def parse_twinkle_path(path: str) -> tuple[str, str]:
    """Split ``twinkle://<run_id>/checkpoints/<name>`` into ``(run_id, name)``.

    >>> parse_twinkle_path('twinkle://run-1a2b3c/checkpoints/step-10')
    ('run-1a2b3c', 'step-10')
    """
    run_id, _, name = parse_checkpoint_path(path)
    if path != f'{TWINKLE_SCHEME}{run_id}/checkpoints/{name}':
        raise DataError(f'Invalid checkpoint path {path!r}: expected twinkle://<run_id>/checkpoints/<name>')
    return run_id, name


def parse_checkpoint_path(path: str) -> tuple[str, str, str]:
    """``(run_id, kind, name)`` of a checkpoint path of either API: ``twinkle://<run>/checkpoints/<name>``,
    ``tinker://<run>/weights/<name>`` (kind 'training'), ``tinker://<run>/sampler_weights/<name>``
    (kind 'sampler') or ``tinker://<run>/external_weights/<name>`` (kind 'external'; ``twinkle://``
    works with these folders too).

    >>> parse_checkpoint_path('tinker://s-1:train:0/sampler_weights/step-10')
    ('s-1:train:0', 'sampler', 'step-10')
    """
    scheme = next((s for s in (TWINKLE_SCHEME, TINKER_SCHEME) if isinstance(path, str) and path.startswith(s)), None)
    parts = path[len(scheme) :].split('/') if scheme else []
    valid = (
        len(parts) == 3
        and parts[1] in PATH_FOLDERS
        and all(_PATH_PART.fullmatch(part) and '..' not in part for part in (parts[0], parts[2]))
    )
    if not valid:
        raise DataError(
            f'Invalid checkpoint path {path!r}: expected twinkle://<run_id>/checkpoints/<name>, '
            'tinker://<run_id>/weights/<name>, tinker://<run_id>/sampler_weights/<name> or '
            'tinker://<run_id>/external_weights/<name>, where run_id and name '
            'use A-Z, a-z, 0-9, ".", "_", "-", ":" and do not start with "."'
        )
    return parts[0], PATH_FOLDERS[parts[1]], parts[2]


__all__ = [
    'FEATURE_FIELDS',
    'IDEMPOTENCY_HEADER',
    'LORA_FIELDS',
    'MAX_QUEUE_WAIT_S',
    'MSGPACK',
    'MSGPACK_TYPES',
    'OPERATIONS',
    'PROMPT_FIELDS',
    'QUEUE_HEADER',
    'STEP_FIGURES',
    'CheckpointFields',
    'CheckpointInfo',
    'CheckpointList',
    'Configure',
    'CreateRun',
    'Deleted',
    'FileLinks',
    'FutureAccepted',
    'FutureInfo',
    'InputRow',
    'LoadRequest',
    'Operation',
    'Prompt',
    'RunFields',
    'RunHistory',
    'RunInfo',
    'RunList',
    'RunRestore',
    'RunStep',
    'RunUsage',
    'SampleWeights',
    'SaveRequest',
    'ServerInfo',
    'TenantUsage',
    'UsageFigures',
    'UsageReport',
    'parse_checkpoint_path',
    'parse_twinkle_path',
]
