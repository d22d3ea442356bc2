"""Several adapters' ``forward_backward`` calls as one pass over the base model.

Every call's rows are collated into one batch, laid out call after call; ``multi_lora`` sends
each row through its own adapter. Each adapter then gets its own loss over its own rows, and
one backward of the summed losses gives each adapter the gradient of its own loss alone (the
adapters share no parameter). Numbers do not depend on the neighbours: padding is masked, and
each adapter's loss is normalised over its own items.

Under a device mesh each rank runs its share of every call, and a share may be empty (a call of
one row on two ranks): that call then adds nothing to this rank's forward, loss or gradient, but
takes part in the pass's sums and counters, so every rank ends with the same numbers. Under FSDP2
a rank that holds no row at all still runs a forward (and a backward) with the others, because
the all-gathers of the sharded weights run in step on every rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from twinkle.data_format import IGNORE_INDEX, InputFeature, ModelOutput
from twinkle.errors import ConfigurationError, DataError
from twinkle.loss import LossOutput
from twinkle.model import multi_lora
from twinkle.model.base import AdapterCall
from twinkle.model.group import FULL, Pending, TrainGroup
from twinkle.model.passes import (
    accumulate,
    check_trainable,
    chunks,
    loss_sums,
    non_finite,
    record_call,
    with_logps,
)

if TYPE_CHECKING:
    from twinkle.model.transformers import TransformersModel


def forward_backward_mixed(
    model: TransformersModel, calls: Sequence[AdapterCall], forward_only: bool
) -> list[ModelOutput | DataError]:
    """``TransformersModel.forward_backward_mixed``: every call's rows through one forward, then
    one backward of the finite losses; a call with a non-finite loss gets its ``DataError``."""
    groups = [model._group(call.adapter_name) for call in calls]
    _check_mixable(groups, [batch_key(model, group.name) for group in groups])
    features = [_rows(model, group, call) for group, call in zip(groups, calls, strict=True)]
    for rows, call in zip(features, calls, strict=True):
        next(chunks(rows, None, call.loss_inputs))  # per-row loss inputs match the rows
    started = time.perf_counter()
    parts, logits = _mixed_forward(model, groups, features, forward_only)
    if forward_only:
        for group, rows, part in zip(groups, features, parts, strict=True):
            group.pending = None if part is None else Pending(*part, training=False, rows=len(rows))
        return [_empty_output() if part is None else with_logps(part[1]['logits'], part[0]) for part in parts]
    # Every loss first, then the metrics: a loss that raises leaves no adapter half-counted.
    losses = [
        None if part is None else model._loss_value(group, *part, call.loss_inputs)
        for group, call, part in zip(groups, calls, parts, strict=True)
    ]
    errors = non_finite(groups, losses, model._parallel.sum_)
    kept = [i for i, error in enumerate(errors) if error is None]
    failed = [group for group, error in zip(groups, errors, strict=True) if error is not None]
    for i in kept:
        part, loss = parts[i], losses[i]
        if part is not None and loss is not None:
            accumulate(groups[i], *part, loss, training=True)
    trained: list[ModelOutput] = []
    if kept:
        pass_ = _Pass([groups[i] for i in kept], [features[i] for i in kept], [parts[i] for i in kept], logits)
        trained = _mixed_backward(model, pass_, [losses[i] for i in kept], started, failed)
    outputs = iter(trained)
    return [error if error is not None else next(outputs) for error in errors]


def _rows(model: TransformersModel, group: TrainGroup, call: AdapterCall) -> list[InputFeature]:
    """The call's rows on this rank: under a device mesh a rank's share of a call may be empty."""
    if model._parallel.enabled and not call.inputs:
        return []
    return model._features(group, call.inputs)


def _empty_output() -> ModelOutput:
    """A forward-only call's output on a rank that holds none of its rows."""
    return ModelOutput(logps=torch.zeros(0, 0), num_tokens=0)


def batch_key(model: TransformersModel, adapter_name: str | None = None) -> tuple | None:
    """``TransformersModel.batch_key``: the adapter's collation (processor, padding side, pad
    token); None for rows that cannot be mixed (packed rows, the full model)."""
    group = model._group(adapter_name)
    processor = group.processor
    if group.name == FULL or processor.padding_free:
        return None
    return (type(processor), processor.padding_side, model._template_for(group).pad_token_id)


Part = tuple[dict, dict]


@dataclass
class _Pass:
    """The kept calls of a pass: their groups, rows and (batch, outputs) parts (None where this
    rank holds none of a call's rows), and the logits of the whole forward (None if none ran)."""

    groups: list[TrainGroup]
    features: list[list[InputFeature]]
    parts: list[Part | None]
    logits: torch.Tensor | None


def _mixed_forward(
    model: TransformersModel, groups: list[TrainGroup], features: list[list[InputFeature]], forward_only: bool
) -> tuple[list[Part | None], torch.Tensor | None]:
    """One forward of every call's rows: each call's (batch, outputs) part of it (None for a call
    with no rows here), and the logits of the whole batch (None when this rank ran no forward)."""
    model._parallel.prepare(model.model, model.groups.values())
    model._set_mode(not forward_only)
    flat = [row for rows in features for row in rows]
    names = [g.name for g, rows in zip(groups, features, strict=True) for _ in rows]
    pad = model._template_for(groups[0]).pad_token_id
    if not flat:
        if not model._parallel.fsdp:
            return [None] * len(groups), None
        # No row here, but FSDP2's all-gathers run on every rank: one padding token, trained on nothing.
        flat, names = [{'input_ids': [pad], 'labels': [IGNORE_INDEX]}], [groups[0].name]
    batch = {k: v.to(model.device, non_blocking=True) for k, v in groups[0].processor(flat, pad).items()}
    multi_lora.assign_rows(model.model, names)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        logits = model._logits(batch)
    # split, not slices: a slice's backward would write into zeros the size of all the logits
    sizes = [len(rows) for rows in features]
    if sum(sizes) == 0:
        return [None] * len(groups), logits
    columns = {k: v.split(sizes) for k, v in batch.items()}
    pieces = logits.split(sizes)
    parts: list[Part | None] = [
        ({k: v[i] for k, v in columns.items()}, {'logits': piece}) if sizes[i] else None
        for i, piece in enumerate(pieces)
    ]
    return parts, logits


def _mixed_backward(
    model: TransformersModel,
    pass_: _Pass,
    losses: list[LossOutput | None],
    started: float,
    failed: list[TrainGroup],
) -> list[ModelOutput]:
    """One backward of the summed losses: adapters share no parameter, so each gets the
    gradient of its own loss; then each group's counters, as ``forward_backward`` keeps them.
    The ``failed`` groups' rows were in the forward: the backward reaches their adapters with
    zeros (NaN, through non-finite weights), so their gradients are put back as they were."""
    here = [loss for loss in losses if loss is not None]
    for group, loss in zip(pass_.groups, losses, strict=True):
        if loss is not None:
            check_trainable(group, loss)
    kept_grads = [(p, p.grad if p.grad is None else p.grad.clone()) for group in failed for p in group.params]
    if here:
        torch.stack([loss.loss for loss in here]).sum().backward()
    elif model._parallel.fsdp and pass_.logits is not None:
        (pass_.logits.sum() * 0).backward()  # FSDP2's backward all-gathers run on every rank
    for param, grad in kept_grads:
        param.grad = grad
    sums_N = torch.stack(
        [
            _sums(model, loss, part, len(rows))
            for loss, part, rows in zip(losses, pass_.parts, pass_.features, strict=True)
        ]
    )
    sums = model._parallel.sum_(sums_N).tolist()  # the pass's one sync
    elapsed = time.perf_counter() - started
    outputs = []
    for group, rows, loss, call_sums in zip(pass_.groups, pass_.features, losses, sums, strict=True):
        if loss is not None:
            group.pending_items = group.pending_items + loss.num_items.detach()
        outputs.append(record_call(group, rows, call_sums, elapsed))
    return outputs


def _sums(model: TransformersModel, loss: LossOutput | None, part: Part | None, rows: int) -> torch.Tensor:
    """``loss_sums`` of a call on this rank (zeros where it has no rows here)."""
    if loss is None or part is None:
        return torch.zeros(4, device=model.device)
    return loss_sums(loss, part[0], rows)


def _check_mixable(groups: list[TrainGroup], keys: list[tuple | None]) -> None:
    names = [group.name for group in groups]
    if not groups or len(set(names)) != len(names):
        raise ConfigurationError(f'a mixed pass needs one call per adapter, each adapter once; got {names}')
    if len(groups) > 1 and (None in keys or len(set(keys)) != 1):
        raise ConfigurationError(f'adapters {names} collate rows differently (processor, padding, pad token)')
