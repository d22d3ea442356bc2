"""What a pass over an adapter's rows does with its results, shared by ``forward_backward`` and
the mixed pass: micro-batch chunks, label logprobs, metrics, and the call's counters."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from twinkle.data_format import IGNORE_INDEX, RL_ROW_FIELDS, InputFeature, ModelOutput
from twinkle.errors import ConfigurationError, DataError, StateError
from twinkle.loss import LossOutput
from twinkle.model.train_group import Batch, Outputs, TrainGroup


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ConfigurationError(f'{name} must be a positive integer; got {value!r}')


def check_trainable(group: TrainGroup, loss: LossOutput) -> None:
    """``StateError`` unless the loss can train the group (it requires grad)."""
    if not loss.loss.requires_grad:
        raise StateError(f'the loss of adapter {group.name!r} does not require grad: nothing would be trained')


def check_finite(group: TrainGroup, loss: LossOutput, sum_: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``DataError`` if the loss is NaN or infinite (``non_finite`` of one call)."""
    (error,) = non_finite([group], [loss], sum_)
    if error is not None:
        raise error


def non_finite(
    groups: Sequence[TrainGroup], losses: Sequence[LossOutput | None], sum_: Callable[[torch.Tensor], torch.Tensor]
) -> list[DataError | None]:
    """For each loss, a ``DataError`` if it is NaN or infinite, else None: checked before its
    backward and its metrics, so nothing of a failed call is accumulated. ``sum_`` sums over the
    ranks (``ModelParallel.sum_``): under a mesh every rank gets every rank's verdict (a loss of
    None: the call has no rows on this rank)."""
    device = groups[0].params[0].device if groups and groups[0].params else None
    flags = [torch.zeros((), device=device) if loss is None else ~torch.isfinite(loss.loss.detach()) for loss in losses]
    bad = sum_(torch.stack(flags).float()).tolist()
    verdicts = zip(groups, losses, bad, strict=True)
    return [_non_finite_error(group, loss) if count > 0 else None for group, loss, count in verdicts]


def _non_finite_error(group: TrainGroup, loss: LossOutput | None) -> DataError:
    value = math.nan if loss is None else float(loss.loss.detach())
    where = value if loss is not None and not math.isfinite(value) else 'on another rank'
    return DataError(
        f'the loss of adapter {group.name!r} is not finite ({where}): its weights or these inputs hold NaN or '
        'infinite values (a learning rate too high, say); nothing of this call was accumulated'
    )


def chunks(
    features: list[InputFeature], size: int | None, loss_inputs: dict[str, Any]
) -> Iterator[tuple[list[InputFeature], dict[str, Any]]]:
    """Split rows, and the per-sequence loss inputs beside them, into micro-batches of ``size``
    rows. A row is one sequence, a packed row several (``sequences_in``); a loss input given
    per sequence follows its rows. Loss inputs the rows carry themselves (a packed row's
    ``advantages``, say) are gathered when not given (``RL_ROW_FIELDS``)."""
    loss_inputs = {**carried(features), **loss_inputs}
    splitting = size is not None and size < len(features)
    if not splitting and not any(isinstance(value, Sequence) for value in loss_inputs.values()):
        yield features, loss_inputs  # nothing given per sequence: no need to count them
        return
    counts = [sequences_in(feature) for feature in features]
    total = sum(counts)
    for key, value in loss_inputs.items():
        if isinstance(value, Sequence) and len(value) != total:
            where = f'{len(features)} rows' if total == len(features) else f'{total} sequences in {len(features)} rows'
            raise DataError(f'loss input {key!r} has {len(value)} entries for {where}')
    if size is None or not splitting:
        yield features, loss_inputs
        return
    check_positive('micro_batch_size', size)
    offsets = [0, *itertools.accumulate(counts)]
    for start in range(0, len(features), size):
        end = min(start + size, len(features))
        first, last = offsets[start], offsets[end]
        part = {k: v[first:last] if isinstance(v, Sequence) else v for k, v in loss_inputs.items()}
        yield features[start:end], part


def sequences_in(feature: InputFeature) -> int:
    """The sequences a row holds: one, or as many as its ``position_ids`` restart (packed)."""
    if 'packed_rows' in feature:
        return feature['packed_rows']
    positions = feature.get('position_ids')
    if positions is None:
        return 1
    starts = positions.count(0) if isinstance(positions, (list, tuple)) else sum(1 for p in positions if p == 0)
    return max(1, starts)


def carried(features: Sequence[InputFeature]) -> dict[str, list[Any]]:
    """The ``RL_ROW_FIELDS`` every row carries, per sequence in order (a packed row's are lists
    of its sequences' values)."""
    carried = {}
    for name in RL_ROW_FIELDS:
        if not features or not all(name in feature for feature in features):
            continue
        values: list[Any] = []
        for feature in features:
            value = feature[name]  # type: ignore[literal-required]
            values.extend(value if 'packed_rows' in feature else [value])
        carried[name] = values
    return carried


def label_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The log-probability of each label token ([batch, seq]; 0 where the label is ignored), without gradient."""
    with torch.no_grad():
        logps = torch.log_softmax(logits.detach().float(), dim=-1)
        return logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (labels != IGNORE_INDEX)


def with_logps(logits: torch.Tensor, batch: Batch, values: torch.Tensor | None = None) -> ModelOutput:
    """Logits plus the log-probability of each label token (0 where the label is ignored), and a
    value head's values (detached) where the adapter has one."""
    labels = batch['labels']
    trained = int((labels != IGNORE_INDEX).sum())
    detached = None if values is None else values.detach()
    return ModelOutput(logits=logits, logps=label_logps(logits, labels), num_tokens=trained, values=detached)


def accumulate(group: TrainGroup, batch: Batch, outputs: Outputs, loss: LossOutput, training: bool) -> None:
    """Feed a loss to the group's training (or evaluation) metrics, and a training loss's own
    statistics to the step log (a server's run history records them per step)."""
    for metric in group.spec.train_metrics if training else group.spec.eval_metrics:
        metric.accumulate(inputs=batch, outputs=outputs, loss=loss)
    if training:
        group.step_log.on_loss(loss)


def loss_sums(loss: LossOutput, batch: Batch, rows: int) -> torch.Tensor:
    """[loss sum, loss items, trained tokens, rows] of one backward, summed over ranks by the caller."""
    trained = (batch['labels'] != IGNORE_INDEX).sum()
    counts = torch.tensor([float(rows)], device=trained.device)
    return torch.cat([torch.stack([loss.loss.detach().float(), loss.num_items.float(), trained.float()]), counts])


def record_call(
    group: TrainGroup, rows: Sequence[InputFeature], sums: Sequence[float], elapsed_s: float, row_share: float = 1.0
) -> ModelOutput:
    """Count one ``forward_backward`` call (one accumulation micro step) on ``group``; its
    output from ``sums`` = ``loss_sums`` of the call, over every rank (so the samples consumed
    are the global batch's on every rank, as one process counts them). ``row_share`` 0: this
    rank's rows are counted by another rank of its group (Ulysses), so its tokens are not."""
    total, items, trained, global_rows = sums
    group.window.count_backward(int(global_rows))
    tokens = sum(len(f['input_ids']) for f in rows)
    group.stats.accumulate(num_tokens=round(tokens * row_share), elapsed_s=elapsed_s)
    loss = total / max(items, 1.0)
    group.step_log.on_call(loss, tokens, elapsed_s)
    return ModelOutput(loss=loss, num_tokens=int(trained))
