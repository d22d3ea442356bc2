"""Moving the trainer's current weights into a sampler.

The trainer's side (``export_weights``) and the sampler's side (``apply_weights``) are plain
functions of the component, so the manager runs them the same way whether a component is in this
process or is a remote one on a Ray device group (``remote_group=``): then model rank 0 exports,
the export stays in Ray's object store, and every sampler actor loads it from there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle.errors import ConfigurationError
from twinkle.infra.ray.handle import RemoteHandle
from twinkle.model.lora import multi as multi_lora
from twinkle.model.train_group import FULL
from twinkle.model.transformers import TransformersModel
from twinkle.sampler.torch_sampler import TorchSampler
from twinkle.sampler.vllm_sampler import vLLMSampler
from twinkle.utils.logger import get_logger
from twinkle.utils.weights import canonical_name

logger = get_logger()


@dataclass
class SyncResult:
    """What one ``sync_weights`` moved."""

    weight_version: int
    tensors: int
    bytes: int
    seconds: float
    mode: str  # 'merged', 'adapter' or 'full'


@dataclass
class StagedWeights:
    """A trainer's weights as of ``stage_weights``, waiting for ``apply_staged``."""

    export: Any  # a WeightExport, or a reference to one in Ray's object store
    version: int
    seconds: float


@dataclass
class WeightExport:
    """What the trainer sends in one sync."""

    # 'merged', 'adapter' or 'full'.
    mode: str
    # Base (non-adapter) weights by name; empty when they have not changed since the last sync.
    base: dict[str, torch.Tensor] = field(default_factory=dict)
    # The merged matrices ('merged') or the adapter's tensors ('adapter').
    update: dict[str, torch.Tensor] = field(default_factory=dict)
    # The adapter's name and peft config ('adapter' mode).
    adapter_name: str | None = None
    config: Any = None

    def copied(self) -> WeightExport:
        """Its own copy of every tensor (an export holds views of the trainer's parameters)."""
        base = {name: t.clone() for name, t in self.base.items()}
        update = {name: t.clone() for name, t in self.update.items()}
        return WeightExport(self.mode, base, update, self.adapter_name, self.config)


class CheckpointEngineManager:
    """Keeps a sampler's weights equal to a trainer's.

    ``sync_weights(merge_and_sync=True)`` merges the LoRA adapter into the weights it wraps
    (``W + scale * B @ A``, computed aside: the trainer's model stays unmerged) and copies the
    merged matrices into the sampler's base model, which then samples without an adapter. With
    ``merge_and_sync=False`` the sampler keeps the adapter as an adapter: the first sync creates
    it there with the trainer's LoRA config, later syncs move only the adapter tensors (for a
    rank-``r`` LoRA a small fraction of the model). The first sync of either kind also copies
    every base weight, so a sampler built from other weights ends up equal to the trainer.
    A model without adapters always moves all its weights.

    After each sync the sampler's ``weight_version`` is the number of syncs so far; every
    sequence it samples records it. ``model`` and ``sampler`` may be remote (built with
    ``remote_group=`` in ray mode), on different device groups.
    """

    def __init__(self, model: TransformersModel | RemoteHandle, sampler: TorchSampler | vLLMSampler | RemoteHandle):
        _check_component('model', model, TransformersModel)
        _check_component('sampler', sampler, (TorchSampler, vLLMSampler))
        self.model = model
        self.sampler = sampler
        self.version = sampler.weight_version
        self._last_mode: str | None = None

    def sync_weights(self, merge_and_sync: bool = True, *, adapter_name: str | None = None) -> SyncResult:
        """Export the trainer's weights and load them into the sampler, now."""
        return self.apply_staged(self._stage(merge_and_sync, adapter_name, copy=False))

    def stage_weights(self, merge_and_sync: bool = True, *, adapter_name: str | None = None) -> StagedWeights:
        """The trainer's half of a sync: a snapshot of its weights as of now, numbered with the
        next version, for ``apply_staged`` to load into the sampler later. The trainer may step
        on meanwhile (an async loop stages after each step and lets the sampler's thread apply
        between its generations): a local export is copied, a remote one is already a copy in
        Ray's object store."""
        return self._stage(merge_and_sync, adapter_name, copy=True)

    def _stage(self, merge_and_sync: bool, adapter_name: str | None, copy: bool) -> StagedWeights:
        started = time.perf_counter()
        remote = isinstance(self.model, RemoteHandle)  # then the export travels: on the CPU, as any device reads it
        export = _run(self.model, export_weights, merge_and_sync, adapter_name, self._last_mode, remote, on_rank0=True)
        if copy and isinstance(export, WeightExport):
            export = export.copied()
        self.version += 1
        return StagedWeights(export, self.version, time.perf_counter() - started)

    def apply_staged(self, staged: StagedWeights) -> SyncResult:
        """The sampler's half: load ``staged`` (from ``stage_weights``); the sampler's samples
        then carry ``staged.version``."""
        started = time.perf_counter()
        mode, tensors, size = _run(self.sampler, apply_weights, staged.export, staged.version)
        # Until a first apply, exports carry the base weights too (the sampler may have none of them).
        self._last_mode = mode
        return SyncResult(
            weight_version=staged.version,
            tensors=tensors,
            bytes=size,
            seconds=staged.seconds + time.perf_counter() - started,
            mode=mode,
        )


def export_weights(
    model: TransformersModel,
    merge_and_sync: bool,
    adapter_name: str | None,
    last_mode: str | None,
    to_cpu: bool = False,
) -> WeightExport:
    """The trainer's side of a sync. Base weights move on the first sync, and when the mode
    changes (a merged sync leaves merged matrices in the sampler's base model that an adapter
    sync must not build on); otherwise frozen base weights have not changed since the last one.
    ``to_cpu``: copies on the CPU (for another process, whose devices may differ)."""
    group = model.train_group(adapter_name)
    mode = 'full' if group.name == FULL else 'merged' if merge_and_sync else 'adapter'
    export = WeightExport(mode)
    if mode == 'full' or mode != last_mode:
        export.base = _base_weights(model)
    if mode == 'merged':
        export.update = _merged_weights(model, group.name)
    elif mode == 'adapter':
        export.update = _adapter_weights(model, group.name)
        export.adapter_name, export.config = group.name, group.spec.config
    if to_cpu:
        export.base = {name: t.cpu() for name, t in export.base.items()}
        export.update = {name: t.cpu() for name, t in export.update.items()}
    return export


def apply_weights(sampler: TorchSampler | vLLMSampler, export: WeightExport, version: int) -> tuple[str, int, int]:
    """The sampler's side of a sync; returns ``(mode, tensors, bytes)`` moved. Base and merged
    weights go in as one load (a vLLM engine reloads once)."""
    if export.mode == 'merged':
        sampler.load_weights({**export.base, **export.update})
        sampler.default_adapter = None
    elif export.base:
        sampler.load_weights(export.base)
    if export.adapter_name is not None:  # an adapter export: export_weights names its adapter
        sampler.load_adapter_weights(export.adapter_name, export.update, config=export.config)
        sampler.default_adapter = export.adapter_name
    sampler.weight_version = version
    sampler.reset_prefix_cache()
    moved = [*export.base.values(), *export.update.values()]
    return export.mode, len(moved), sum(t.numel() * t.element_size() for t in moved)


def _check_component(role: str, component: object, expected: type | tuple[type, ...]) -> None:
    kind = component.remote_class if isinstance(component, RemoteHandle) else type(component)
    if not issubclass(kind, expected):
        names = ' or '.join(e.__name__ for e in (expected if isinstance(expected, tuple) else (expected,)))
        raise ConfigurationError(f'{role} must be a {names} (built here or with remote_group=); got {kind.__name__}')


def _run(component: Any, fn: Any, *args: Any, on_rank0: bool = False) -> Any:
    """``fn(component, *args)``, here or on a remote component's actors. A remote export
    (``on_rank0``) stays in the object store: the sampler's actors fetch it from there."""
    if isinstance(component, RemoteHandle):
        return component.remote_execute(fn, *args, dispatch='rank0' if on_rank0 else 'all', lazy=on_rank0)
    return fn(component, *args)


def _base_weights(model: TransformersModel) -> dict[str, torch.Tensor]:
    return {canonical_name(name): p.detach() for name, p in model.model.named_parameters() if '.lora_' not in name}


def _merged_weights(model: TransformersModel, adapter_name: str) -> dict[str, torch.Tensor]:
    weights = {}
    with torch.no_grad():
        for path, layer in multi_lora.multi_lora_layers(model.model).items():
            if adapter_name in layer.adapters:
                for suffix, merged in layer.merged_stacks(adapter_name).items():
                    weights[canonical_name(f'{path}.{suffix}')] = merged
    return weights


def _adapter_weights(model: TransformersModel, adapter_name: str) -> dict[str, torch.Tensor]:
    if adapter_name not in model.adapter_names:
        raise ConfigurationError(f'merge_and_sync=False needs an adapter on the model; it has {model.adapter_names}')
    return {k: v.detach() for k, v in multi_lora.peft_state_dict(model.model, adapter_name).items()}
