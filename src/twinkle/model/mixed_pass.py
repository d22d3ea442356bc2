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

import torch

from twinkle.data_format import IGNORE_INDEX, InputFeature, ModelOutput
from twinkle.errors import ConfigurationError, DataError
from twinkle.loss import LossOutput
from twinkle.model.base import AdapterCall
from twinkle.model.lora import multi as multi_lora
from twinkle.model.passes import (
    accumulate,
    carried,
    check_trainable,
    chunks,
    loss_sums,
    non_finite,
    record_call,
    with_logps,
)
from twinkle.model.runner import ModelRunner
from twinkle.model.train_group import FULL, Batch, Outputs, Pending, TrainGroup
from twinkle.processor.base import split_rows


def forward_backward_mixed(
    runner: ModelRunner,
    groups: list[TrainGroup],
    calls: Sequence[AdapterCall],
    forward_only: bool,
    max_tokens: int | None = None,
) -> list[ModelOutput | DataError]:
    """``TransformersModel.forward_backward_mixed``: every call's rows (``calls[i]`` is
    ``groups[i]``'s) through one forward, then one backward of the finite losses; a call with a
    non-finite loss gets its ``DataError``. ``max_tokens``: the padded tokens a forward may hold
    (``TransformersModel.mixed_forward_tokens``)."""
    _check_mixable(groups, [batch_key(runner, group) for group in groups])
    features = [_rows(runner, group, call) for group, call in zip(groups, calls, strict=True)]
    # Each call's loss inputs with those its rows carry (per-sequence inputs checked against the rows).
    loss_inputs = [next(chunks(rows, None, call.loss_inputs))[1] for rows, call in zip(features, calls, strict=True)]
    started = time.perf_counter()
    parts, logits = _mixed_forward(runner, groups, features, forward_only, max_tokens)
    if forward_only:
        for group, rows, part in zip(groups, features, parts, strict=True):
            group.pending.forward = (
                None if part is None else Pending(*part, training=False, rows=len(rows), carried=carried(rows))
            )
        return [
            _empty_output() if part is None else with_logps(part[1]['logits'], part[0], part[1].get('values'))
            for part in parts
        ]
    # Every loss first, then the metrics: a loss that raises leaves no adapter half-counted.
    losses = [
        None if part is None else runner.loss_value(group, *part, inputs)
        for group, inputs, part in zip(groups, loss_inputs, parts, strict=True)
    ]
    errors = non_finite(groups, losses, runner.parallel.sum_)
    kept = [i for i, error in enumerate(errors) if error is None]
    failed = [group for group, error in zip(groups, errors, strict=True) if error is not None]
    for i in kept:
        part, loss = parts[i], losses[i]
        if part is not None and loss is not None:
            accumulate(groups[i], *part, loss, training=True)
    trained: list[ModelOutput] = []
    if kept:
        pass_ = _Pass([groups[i] for i in kept], [features[i] for i in kept], [parts[i] for i in kept], logits)
        trained = _mixed_backward(runner, pass_, [losses[i] for i in kept], started, failed)
    outputs = iter(trained)
    return [error if error is not None else next(outputs) for error in errors]


def _rows(runner: ModelRunner, group: TrainGroup, call: AdapterCall) -> list[InputFeature]:
    """The call's rows on this rank: under a device mesh a rank's share of a call may be empty."""
    if runner.parallel.enabled and not call.inputs:
        return []
    return runner.features(group, call.inputs)


def _empty_output() -> ModelOutput:
    """A forward-only call's output on a rank that holds none of its rows."""
    return ModelOutput(logps=torch.zeros(0, 0), num_tokens=0)


#: What adapters that can share a pass have alike: their processor's class, its padding side and the pad token.
BatchKey = tuple[type, str, int]


def batch_key(runner: ModelRunner, group: TrainGroup) -> BatchKey | None:
    """``TransformersModel.batch_key``: the adapter's collation (processor, padding side, pad
    token); None for rows that cannot be mixed (packed rows, the full model)."""
    processor = runner.processor(group)
    if group.name == FULL or processor.padding_free:
        return None
    return (type(processor), processor.padding_side, runner.template_for(group).pad_token_id)


#: One call's share of a forward: its rows' batch and their outputs.
Part = tuple[Batch, Outputs]


@dataclass
class _Pass:
    """The kept calls of a pass: their groups, rows and (batch, outputs) parts (None where this
    rank holds none of a call's rows), and the first forward's logits (its label logprobs on the
    fused output layer; None if none ran): a rank with no loss backpropagates zeros through them."""

    groups: list[TrainGroup]
    features: list[list[InputFeature]]
    parts: list[Part | None]
    logits: torch.Tensor | None


def _mixed_forward(
    runner: ModelRunner,
    groups: list[TrainGroup],
    features: list[list[InputFeature]],
    forward_only: bool,
    max_tokens: int | None,
) -> tuple[list[Part | None], torch.Tensor | None]:
    """The forward of every call's rows: each call's (batch, outputs) part of it (None for a call
    with no rows here), and the logits of the first forward (None when this rank ran none).

    Calls of similar lengths share a forward (``length_buckets``), so a short call is not padded
    to a long neighbour's length; under FSDP2 (whose all-gathers run in step on every rank) and
    with gradient checkpointing (whose recompute sees the last row assignment) it is one forward."""
    runner.prepare(training=not forward_only)
    pad = runner.template_for(groups[0]).pad_token_id
    if not any(features):
        if not runner.parallel.lockstep:
            return [None] * len(groups), None
        # No row here, but the other ranks' collectives (FSDP2's all-gathers, megatron's token
        # dispatch) need this one: one padding token, trained on nothing.
        dummy: list[InputFeature] = [{'input_ids': [pad], 'labels': [IGNORE_INDEX]}]
        return [None] * len(groups), _forward(runner, groups, [dummy], [0], forward_only)[1]
    lengths = [max((len(row['input_ids']) for row in rows), default=0) for rows in features]
    sizes = [len(rows) for rows in features]
    one = runner.parallel.lockstep or runner.checkpointing
    buckets = [list(range(len(groups)))] if one else length_buckets(lengths, sizes, max_tokens)
    parts: list[Part | None] = [None] * len(groups)
    first: torch.Tensor | None = None
    for bucket in buckets:
        pieces, logits = _forward(runner, groups, features, bucket, forward_only)
        first = logits if first is None else first
        for i, part in zip(bucket, pieces, strict=True):
            parts[i] = part
    return parts, first


def _forward(
    runner: ModelRunner,
    groups: list[TrainGroup],
    features: list[list[InputFeature]],
    calls: list[int],
    forward_only: bool,
) -> tuple[list[Part | None], torch.Tensor]:
    """One forward of the rows of ``calls`` (indices into ``groups`` and ``features``), laid out
    call after call: each call's part (None for one with no rows) and the batch's logits (its
    label logprobs where the calls' losses run on the fused output layer, ``runner.fused_reads``)."""
    flat = [row for i in calls for row in features[i]]
    names = [groups[i].name for i in calls for _ in features[i]]
    batch = runner.collate(groups[calls[0]], flat)
    multi_lora.assign_rows(runner.model, names)
    heads = [groups[i].spec.value_head for i in calls]
    metrics = [metric for i in calls for metric in groups[i].spec.train_metrics]
    fused = None if forward_only else runner.fused_reads([groups[i].spec.loss for i in calls], metrics)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        outputs = runner.outputs(batch, hidden_state=any(head is not None for head in heads), fused=fused)
    # split, not slices: a slice's backward would write into zeros the size of all the logits
    sizes = [len(features[i]) for i in calls]
    columns = split_rows(batch, sizes)  # each call's rows, with their own images
    pieces = {k: torch.split(v, sizes, dim=1 if k == 'router_logits' else 0) for k, v in outputs.items()}
    parts: list[Part | None] = []
    for j, head in enumerate(heads):
        part = {k: v[j] for k, v in pieces.items() if k != 'hidden_state'}
        if head is not None and sizes[j]:
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                part['values'] = head(pieces['hidden_state'][j])
        parts.append((columns[j], part) if sizes[j] else None)
    return parts, outputs['logps' if fused else 'logits']


#: Calls of different lengths share a forward while padding them to its length costs at most this
#: share more tokens than forwards of their own would ...
BUCKET_SLACK = 0.1
#: ... or at most this many padded tokens: a forward has a cost of its own (kernels, layers
#: walked), so a few short rows are cheaper padded into a neighbour's forward than alone.
BUCKET_FREE_TOKENS = 256
#: Padded tokens per forward past which a CPU gets slower per token. On 2 cores, small-qwen3
#: trains 64 rows of about 100 tokens in 5.6-6.4 s as forwards of 8 rows, 6.2 s of 16, 7.0 s of
#: 32 and 11 s as one forward (``aten::mm`` and ``aten::mul`` on activations that no longer fit
#: in the caches); an accelerator is the other way round, so it gets no cap.
CPU_FORWARD_TOKENS = 2048


def forward_token_cap(device: torch.device) -> int | None:
    """The default ``TransformersModel.mixed_forward_tokens`` on ``device``."""
    return CPU_FORWARD_TOKENS if device.type == 'cpu' else None


def length_buckets(
    lengths: Sequence[int],
    sizes: Sequence[int],
    max_tokens: int | None = None,
    slack: float = BUCKET_SLACK,
    free: int = BUCKET_FREE_TOKENS,
) -> list[list[int]]:
    """Calls grouped into forwards: ``lengths[i]`` is call ``i``'s longest row and ``sizes[i]``
    its rows (calls without rows are left out). From the longest call down, a call joins the
    current forward when the padding that adds (to that forward's length) is at most ``free``
    tokens, or the forward's padded tokens stay within ``slack`` of what separate forwards of its
    calls would pad to, and the forward stays within ``max_tokens`` padded tokens; otherwise it
    starts a forward of its own (a call is never split, however long).

    >>> length_buckets([100, 30, 95, 32], [8, 8, 8, 8])  # two lengths of batch: two forwards
    [[0, 2], [3, 1]]
    >>> length_buckets([100, 30, 64], [1, 1, 1])  # single rows: padding them is cheaper
    [[0, 2, 1]]
    >>> length_buckets([100, 100, 100], [8, 8, 8], max_tokens=2000)
    [[0, 1], [2]]
    """
    order = sorted((i for i in range(len(lengths)) if sizes[i]), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    width, rows, separate = 0, 0, 0
    for i in order:
        alone = lengths[i] * sizes[i]
        joined = width * (rows + sizes[i])
        cheap = (width - lengths[i]) * sizes[i] <= free or joined <= (1 + slack) * (separate + alone)
        if buckets and cheap and (max_tokens is None or joined <= max_tokens):
            buckets[-1].append(i)
            rows, separate = rows + sizes[i], separate + alone
            continue
        buckets.append([i])
        width, rows, separate = lengths[i], sizes[i], alone
    return buckets


def _mixed_backward(
    runner: ModelRunner,
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
        torch.autograd.backward(torch.stack([loss.loss for loss in here]).sum())
    elif runner.parallel.lockstep and pass_.logits is not None:
        torch.autograd.backward(pass_.logits.sum() * 0)  # the backward's collectives run on every rank
    for param, grad in kept_grads:
        param.grad = grad
    sums_N = torch.stack(
        [
            _sums(runner, loss, part, len(rows))
            for loss, part, rows in zip(losses, pass_.parts, pass_.features, strict=True)
        ]
    )
    sums = runner.parallel.sum_(sums_N).tolist()  # the pass's one sync
    elapsed = time.perf_counter() - started
    outputs = []
    for group, rows, loss, call_sums in zip(pass_.groups, pass_.features, losses, sums, strict=True):
        if loss is not None:
            group.pending.add_items(loss.num_items)
        outputs.append(record_call(group, rows, call_sums, elapsed))
    return outputs


def _sums(runner: ModelRunner, loss: LossOutput | None, part: Part | None, rows: int) -> torch.Tensor:
    """``loss_sums`` of a call on this rank (zeros where it has no rows here)."""
    if loss is None or part is None:
        return torch.zeros(4, device=runner.device)
    return loss_sums(loss, part[0], rows)


def _check_mixable(groups: list[TrainGroup], keys: list[BatchKey | None]) -> None:
    names = [group.name for group in groups]
    if not groups or len(set(names)) != len(names):
        raise ConfigurationError(f'a mixed pass needs one call per adapter, each adapter once; got {names}')
    if len(groups) > 1 and (None in keys or len(set(keys)) != 1):
        raise ConfigurationError(f'adapters {names} collate rows differently (processor, padding, pad token)')
