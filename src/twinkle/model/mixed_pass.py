"""Several adapters' ``forward_backward`` calls as one pass over the base model.

Every call's rows are collated into one batch, laid out call after call; ``multi_lora`` sends
each row through its own adapter. Each adapter then gets its own loss over its own rows, and
one backward of the summed losses gives each adapter the gradient of its own loss alone (the
adapters share no parameter). Numbers do not depend on the neighbours: padding is masked, and
each adapter's loss is normalised over its own items.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from twinkle.data_format import InputFeature, ModelOutput
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
    features = [model._features(group, call.inputs) for group, call in zip(groups, calls, strict=True)]
    for rows, call in zip(features, calls, strict=True):
        next(chunks(rows, None, call.loss_inputs))  # per-row loss inputs match the rows
    started = time.perf_counter()
    parts = _mixed_forward(model, groups, features, forward_only)
    if forward_only:
        for group, rows, (part, out) in zip(groups, features, parts, strict=True):
            group.pending = Pending(part, out, training=False, rows=len(rows))
        return [with_logps(out['logits'], part) for part, out in parts]
    # Every loss first, then the metrics: a loss that raises leaves no adapter half-counted.
    losses = [
        model._loss_value(group, part, out, call.loss_inputs)
        for group, call, (part, out) in zip(groups, calls, parts, strict=True)
    ]
    errors = non_finite(groups, losses, model._parallel.sum_)
    kept = [i for i, error in enumerate(errors) if error is None]
    failed = [group for group, error in zip(groups, errors, strict=True) if error is not None]
    for i in kept:
        accumulate(groups[i], *parts[i], losses[i], training=True)
    trained: list[ModelOutput] = []
    if kept:
        trained = _mixed_backward(
            model,
            [groups[i] for i in kept],
            [features[i] for i in kept],
            [parts[i] for i in kept],
            [losses[i] for i in kept],
            started,
            failed,
        )
    outputs = iter(trained)
    return [error if error is not None else next(outputs) for error in errors]


def batch_key(model: TransformersModel, adapter_name: str | None = None) -> tuple | None:
    """``TransformersModel.batch_key``: the adapter's collation (processor, padding side, pad
    token); None for rows that cannot be mixed (packed rows, the full model)."""
    group = model._group(adapter_name)
    processor = group.processor
    if group.name == FULL or processor.padding_free:
        return None
    return (type(processor), processor.padding_side, model._template_for(group).pad_token_id)


def _mixed_forward(
    model: TransformersModel, groups: list[TrainGroup], features: list[list[InputFeature]], forward_only: bool
) -> list[tuple[dict, dict]]:
    """One forward of every call's rows; each call's (batch, outputs) part of it."""
    model._parallel.prepare(model.model, model.groups.values())
    model._set_mode(not forward_only)
    flat = [row for rows in features for row in rows]
    pad = model._template_for(groups[0]).pad_token_id
    batch = {k: v.to(model.device, non_blocking=True) for k, v in groups[0].processor(flat, pad).items()}
    multi_lora.assign_rows(model.model, [g.name for g, rows in zip(groups, features, strict=True) for _ in rows])
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        logits = model._logits(batch)
    # split, not slices: a slice's backward would write into zeros the size of all the logits
    sizes = [len(rows) for rows in features]
    columns = {k: v.split(sizes) for k, v in batch.items()}
    pieces = enumerate(logits.split(sizes))
    return [({k: v[i] for k, v in columns.items()}, {'logits': piece}) for i, piece in pieces]


def _mixed_backward(
    model: TransformersModel,
    groups: list[TrainGroup],
    features: list[list[InputFeature]],
    parts: list[tuple[dict, dict]],
    losses: list[LossOutput],
    started: float,
    failed: list[TrainGroup],
) -> list[ModelOutput]:
    """One backward of the summed losses: adapters share no parameter, so each gets the
    gradient of its own loss; then each group's counters, as ``forward_backward`` keeps them.
    The ``failed`` groups' rows were in the forward: the backward reaches their adapters with
    zeros (NaN, through non-finite weights), so their gradients are put back as they were."""
    for group, loss in zip(groups, losses, strict=True):
        check_trainable(group, loss)
    kept_grads = [(p, p.grad if p.grad is None else p.grad.clone()) for group in failed for p in group.params]
    torch.stack([loss.loss for loss in losses]).sum().backward()
    for param, grad in kept_grads:
        param.grad = grad
    sums_N = torch.stack([loss_sums(loss, part) for loss, (part, _) in zip(losses, parts, strict=True)])
    sums = model._parallel.sum_(sums_N).tolist()  # the pass's one sync
    elapsed = time.perf_counter() - started
    outputs = []
    for group, rows, loss, call_sums in zip(groups, features, losses, sums, strict=True):
        group.pending_items = group.pending_items + loss.num_items.detach()
        outputs.append(record_call(group, rows, call_sums, elapsed))
    return outputs


def _check_mixable(groups: list[TrainGroup], keys: list[tuple | None]) -> None:
    names = [group.name for group in groups]
    if not groups or len(set(names)) != len(names):
        raise ConfigurationError(f'a mixed pass needs one call per adapter, each adapter once; got {names}')
    if len(groups) > 1 and (None in keys or len(set(keys)) != 1):
        raise ConfigurationError(f'adapters {names} collate rows differently (processor, padding, pad token)')
