"""``MultiLoraTransformersModel``: the local ``TransformersModel`` API, run on a server.

Each adapter added is a training run on the server, holding its own optimizer, scheduler, loss
and step counters beside other tenants' adapters on the one base model. Calls block until the
server has run them and return what the local method returns (``forward_backward`` a
``ModelOutput``, ``calculate_metric`` a dict of floats, ``save`` a ``twinkle://`` path).

Nothing here imports torch, peft or transformers: a LoRA config is read by its fields (peft's
``LoraConfig``, a dict, or any object with them), and only ``export`` / ``upload_to_hub`` load the
training stack, inside the call.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from pydantic import JsonValue, TypeAdapter
from typing_extensions import NotRequired, TypedDict

from twinkle.data_format import ModelOutput
from twinkle.errors import ConfigurationError, DataError, MissingExtraError, UnknownNameError
from twinkle.wire import (
    FEATURE_FIELDS,
    LORA_FIELDS,
    OPERATIONS,
    CreateRun,
    LoadRequest,
    RunInfo,
    SaveRequest,
    parse_twinkle_path,
)
from twinkle_client.client import PREFIX, TwinkleClient, build, default_client
from twinkle_client.images import sent_images

#: A row of ``inputs``: its ``FEATURE_FIELDS`` (lists, tensors or arrays of ints) are sent, other keys stay here.
Row = Mapping[str, object]
#: What ``export`` and ``upload_to_hub`` need beyond the client (twinkle's training side).
TRAINING_PACKAGES = 'pip install torch peft transformers'


class LoraFields(Protocol):
    """A LoRA config as the client reads it: peft's ``LoraConfig``, or any object with its
    fields (``LORA_FIELDS``) as attributes; read, never imported, so the client needs no peft."""

    @property
    def r(self) -> int: ...


#: A LoRA config: an object with its fields, or a dict of them (``{'r': 8, 'target_modules': 'all-linear'}``).
LoraSpec = LoraFields | Mapping[str, object]


class ForwardResult(TypedDict):
    """What the server answers for ``forward_backward`` (and, with ``logps``, ``forward_only``)."""

    loss: float | None
    num_tokens: int
    logps: NotRequired[list[list[float]]]


_FORWARD = TypeAdapter(ForwardResult)
_NORM: TypeAdapter[float | None] = TypeAdapter(float | None)
_STEPPED = TypeAdapter(bool)
_LOSS = TypeAdapter(float)
_METRICS = TypeAdapter(dict[str, float])
_TEXT = TypeAdapter(str)


class MultiLoraTransformersModel:
    """Adapters trained on a twinkle server, one training run each. ``model_id`` is the base
    model they train: one of the server's (``GET /twinkle/v1/server`` lists them; an
    id with or without ``ms://`` / ``hf://``); None, the server's default."""

    def __init__(self, model_id: str | None = None, *, client: TwinkleClient | None = None):
        self.model_id = model_id
        self.client = client or default_client()
        self.runs: dict[str, str] = {}  # adapter name -> training run id

    # ---- adapters -------------------------------------------------------------------------------
    def add_adapter_to_model(
        self, adapter_name: str, config: LoraSpec, *, gradient_accumulation_steps: int = 1, seed: int | None = None
    ) -> str:
        """Create a training run for this adapter; returns its run id. ``config`` is peft's
        ``LoraConfig`` or a dict of its fields (``twinkle.wire.LORA_FIELDS``); ``seed`` fixes the
        adapter's initial weights."""
        if adapter_name in self.runs:
            raise ConfigurationError(f'adapter {adapter_name!r} already exists; adapters: {list(self.runs)}')
        fields = {
            'adapter_name': adapter_name,
            'lora': _lora_fields(config),
            'gradient_accumulation_steps': gradient_accumulation_steps,
            'seed': seed,
            'base_model': self.model_id,  # one of the server's base models (None: its default)
        }
        body = build(CreateRun, fields).model_dump(mode='json')
        run = RunInfo.model_validate(self.client.request('POST', f'{PREFIX}/runs', json=body))
        self.runs[adapter_name] = run.training_run_id
        return run.training_run_id

    def attach(self, run_id: str, adapter_name: str = 'default') -> None:
        """Continue an existing training run of this tenant under ``adapter_name``."""
        self.client.get_training_run(run_id)
        self.runs[adapter_name] = run_id

    # ---- the local API --------------------------------------------------------------------------
    def set_optimizer(self, optimizer_cls: str = 'AdamW', *, adapter_name: str | None = None, **kwargs: object) -> None:
        self._op('set_optimizer', adapter_name, optimizer_cls=_name(optimizer_cls), options=kwargs)

    def set_lr_scheduler(self, scheduler_cls: str, *, adapter_name: str | None = None, **kwargs: object) -> None:
        self._op('set_lr_scheduler', adapter_name, scheduler_cls=_name(scheduler_cls), options=kwargs)

    def set_loss(self, loss_cls: str, *, adapter_name: str | None = None, **kwargs: object) -> None:
        self._op('set_loss', adapter_name, loss_cls=_name(loss_cls), options=kwargs)

    def set_template(
        self, template_cls: str = 'Template', *, adapter_name: str | None = None, **kwargs: object
    ) -> None:
        self._op('set_template', adapter_name, template_cls=_name(template_cls), options=kwargs)

    def set_processor(
        self, processor_cls: str = 'InputProcessor', *, adapter_name: str | None = None, **kwargs: object
    ) -> None:
        self._op('set_processor', adapter_name, processor_cls=_name(processor_cls), options=kwargs)

    def add_metric(
        self, metric: str, *, is_training: bool = True, adapter_name: str | None = None, **kwargs: object
    ) -> None:
        self._op('add_metric', adapter_name, metric=_name(metric), is_training=is_training, options=kwargs)

    def forward_backward(
        self,
        *,
        inputs: Row | Iterable[Row],
        adapter_name: str | None = None,
        micro_batch_size: int | None = None,
        **loss_inputs: object,
    ) -> ModelOutput:
        """``loss_inputs`` (``advantages``, ``old_logps``...) go to the run's loss by name."""
        fields = {'inputs': wire_rows(inputs), 'micro_batch_size': micro_batch_size, 'loss_inputs': loss_inputs}
        result = _FORWARD.validate_python(self._op('forward_backward', adapter_name, **fields))
        return ModelOutput(loss=result['loss'], num_tokens=result['num_tokens'])

    def forward_only(
        self, *, inputs: Row | Iterable[Row], adapter_name: str | None = None, disable_lora: bool = False
    ) -> ModelOutput:
        answer = self._op('forward_only', adapter_name, inputs=wire_rows(inputs), disable_lora=disable_lora)
        result = _FORWARD.validate_python(answer)
        return ModelOutput(loss=result['loss'], num_tokens=result['num_tokens'], logps=result.get('logps'))

    def calculate_loss(self, *, adapter_name: str | None = None, **loss_inputs: object) -> float:
        """The loss of the last ``forward_only``: evaluation without a step (it feeds
        ``calculate_metric(is_training=False)``); ``loss_inputs`` go to the run's loss by name."""
        return _LOSS.validate_python(self._op('calculate_loss', adapter_name, loss_inputs=loss_inputs))

    def log_step_figures(self, figures: Mapping[str, float], *, adapter_name: str | None = None) -> None:
        """Figures of your own (a mean reward, say), recorded with the run's next optimizer step
        in its history, beside the loss, lr, grad norm and tokens/s the server records."""
        self._op('log_step_figures', adapter_name, figures=dict(figures))

    def clip_grad_norm(self, max_grad_norm: float = 1.0, *, adapter_name: str | None = None) -> float | None:
        return _NORM.validate_python(self._op('clip_grad_norm', adapter_name, max_grad_norm=max_grad_norm))

    def step(self, *, adapter_name: str | None = None) -> bool:
        return _STEPPED.validate_python(self._op('step', adapter_name))

    def zero_grad(self, *, adapter_name: str | None = None) -> None:
        self._op('zero_grad', adapter_name)

    def lr_step(self, *, adapter_name: str | None = None) -> None:
        self._op('lr_step', adapter_name)

    def clip_grad_and_step(self, max_grad_norm: float = 1.0, *, adapter_name: str | None = None) -> float | None:
        return _NORM.validate_python(self._op('clip_grad_and_step', adapter_name, max_grad_norm=max_grad_norm))

    def calculate_metric(self, is_training: bool = True, *, adapter_name: str | None = None) -> dict[str, float]:
        return _METRICS.validate_python(self._op('calculate_metric', adapter_name, is_training=is_training))

    def get_train_configs(self, *, adapter_name: str | None = None) -> str:
        return _TEXT.validate_python(self._op('get_train_configs', adapter_name))

    def save(self, name: str, *, adapter_name: str | None = None, save_optimizer: bool = False) -> str:
        """Save on the server; returns ``twinkle://<run id>/checkpoints/<name>``."""
        run_id = self._run(adapter_name)
        body = build(SaveRequest, {'name': name, 'save_optimizer': save_optimizer})
        return _TEXT.validate_python(self.client.call(f'{PREFIX}/runs/{run_id}/save', body))

    def load(self, path: str, *, adapter_name: str | None = None, load_optimizer: bool = False) -> str:
        """Load a ``twinkle://`` checkpoint of this tenant into the adapter."""
        run_id = self._run(adapter_name)
        body = build(LoadRequest, {'path': path, 'load_optimizer': load_optimizer})
        return _TEXT.validate_python(self.client.call(f'{PREFIX}/runs/{run_id}/load', body))

    def export(self, path: str, out_dir: str | Path, *, merge: bool = False, base_model: str | None = None) -> Path:
        """A checkpoint of this tenant as the local ``twinkle export`` writes it: the peft adapter,
        or with ``merge=True`` the base model with it merged in (the base: ``base_model``, else the
        one the checkpoint's run trained on, as the server names it: it must resolve here, as an
        embedded model, a hub id or a folder).

        It runs here, on torch, peft and transformers (the adapter is read and merged with peft),
        imported in this call only so that the client imports without them; where they are not
        installed, a ``MissingExtraError`` before anything is downloaded."""
        with _training_stack('export'):
            from twinkle.model.checkpoint.export import export_checkpoint

        with tempfile.TemporaryDirectory() as scratch:
            downloaded = self.client.download_checkpoint(path, Path(scratch) / 'checkpoint')
            if merge and base_model is None:  # the base model the checkpoint's run trained on
                base_model = self.client.get_training_run(parse_twinkle_path(path)[0]).base_model
            return export_checkpoint(downloaded, out_dir, merge=merge, base_model=base_model)

    def upload_to_hub(
        self, path: str, hub_id: str, *, merge: bool = False, token: str | None = None, private: bool = True
    ) -> str:
        """Export a checkpoint (``export``) and upload it to ``hf://org/name`` or ``ms://org/name``
        with the hub's own library; ``HubUnavailableError`` when the hub cannot be reached.

        Like ``export``, it needs torch, peft and transformers, imported in this call only;
        without them, a ``MissingExtraError`` before anything is downloaded."""
        with _training_stack('upload_to_hub'):
            from twinkle.model.checkpoint.export import push_to_hub

        with tempfile.TemporaryDirectory() as scratch:
            folder = self.export(path, Path(scratch) / 'export', merge=merge)
            return push_to_hub(folder, hub_id, token=token, private=private)

    # ---- internals ------------------------------------------------------------------------------
    def _run(self, adapter_name: str | None) -> str:
        if adapter_name is None:
            if len(self.runs) == 1:
                return next(iter(self.runs.values()))
            if not self.runs:
                raise ConfigurationError('add_adapter_to_model(...) first: a server model trains adapters')
            raise ConfigurationError(f'this model has several adapters; pass adapter_name= one of {list(self.runs)}')
        if adapter_name not in self.runs:
            raise UnknownNameError('adapter', adapter_name, list(self.runs))
        return self.runs[adapter_name]

    def _op(self, operation: str, adapter_name: str | None, **fields: object) -> JsonValue:
        """Run ``operation`` (its request built from ``twinkle.wire.OPERATIONS``) and wait for it."""
        run_id = self._run(adapter_name)
        return self.client.call(f'{PREFIX}/runs/{run_id}/ops/{operation}', build(OPERATIONS[operation], fields))


@contextmanager
def _training_stack(operation: str) -> Iterator[None]:
    """Around an import of the training side: a missing package is a ``MissingExtraError`` that
    names it and what to install (the client itself installs without them)."""
    try:
        yield
    except ImportError as error:
        raise MissingExtraError(
            f"{operation} needs twinkle's training side, and {error.name or 'a package'!r} is not importable here "
            f'({error}): {TRAINING_PACKAGES}'
        ) from None


def _lora_fields(config: object) -> dict[str, object]:
    """The ``LORA_FIELDS`` a config sets (None: not sent), sets sorted into lists. A dict names
    fields on purpose, so an unknown key is refused; an object (peft's ``LoraConfig``) is read by
    attribute, its other fields left here."""
    if isinstance(config, Mapping):
        unknown = sorted(str(key) for key in config if key not in LORA_FIELDS)
        if unknown:
            raise ConfigurationError(f'unknown LoRA field(s) {unknown}; accepted fields are {sorted(LORA_FIELDS)}')
        values = {key: config.get(key) for key in LORA_FIELDS}
    elif hasattr(config, 'r'):
        values = {key: getattr(config, key, None) for key in LORA_FIELDS}
    else:
        raise ConfigurationError(
            f'a LoRA config is a peft LoraConfig, a dict of {sorted(LORA_FIELDS)} or an object with them; '
            f'got {config!r}'
        )
    return {
        key: sorted(value) if isinstance(value, (set, frozenset)) else value
        for key, value in sorted(values.items())
        if value is not None
    }


def _name(spec: object) -> str:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, type):
        return spec.__name__  # a class travels by its registered name
    raise ConfigurationError(f'a server component is named by a string; got {spec!r}')


def wire_rows(inputs: Row | Iterable[Row]) -> list[dict[str, object]]:
    """The rows as this client sends them: their InputFeature fields as lists of ints (from lists,
    tensors or arrays), and a row with images (encoded by ``VisionTemplate``) its images as data
    URLs; other keys stay here."""
    rows = [inputs] if isinstance(inputs, Mapping) else list(inputs)
    out: list[dict[str, object]] = []
    for index, row in enumerate(rows):
        fields: dict[str, object] = {key: _ints(key, row[key]) for key in FEATURE_FIELDS if key in row}
        images = sent_images(index, row)
        if images is not None:
            fields['images'] = images
        out.append(fields)
    return out


def _ints(key: str, values: object) -> list[int]:
    if not isinstance(values, Iterable):
        raise DataError(f'{key} must be a sequence of token ids; got {type(values).__name__}')
    return [int(v) for v in values]
