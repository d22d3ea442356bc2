"""What a Tinker training client's requests do to the model, on the scheduler's worker thread.

A datum is ``model_input`` tokens (N) with loss inputs of shape (N,): position i predicts
``target_tokens[i]``. That is twinkle's own layout (labels shifted in advance), so a datum
becomes the row ``{'input_ids': tokens, 'labels': target_tokens}`` and its other loss inputs go
to :class:`~twinkle.loss.tinker.TinkerLoss` one entry per row. Gradients add up over every
``forward_backward`` until ``optim_step``, which is AdamW with decoupled weight decay.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol, cast

import torch
from tinker import types

from twinkle.data_format import InputFeature
from twinkle.errors import ConfigurationError, DataError, SequenceTooLongError, StateError, TwinkleError
from twinkle.loss.tinker import TinkerLoss
from twinkle.model import AdapterCall, OptimizerStep, StepCall, TransformersModel
from twinkle.server.config import ServerConfig
from twinkle.server.execution.checks.images import ImageSlot
from twinkle.server.execution.checks.requests import JsonObject, Outcome
from twinkle.server.execution.tinker.codec import Datum, ForwardBackwardCall, forward_backward_output


class LoraTargets(Protocol):
    """Where a model's LoRA layers can go (a ``Host``, or the ``ModelGroup`` in front of one)."""

    def lora_targets(self, attn: bool, mlp: bool, unembed: bool) -> list[str]: ...

    def expert_targets(self) -> list[str]: ...


def lora_config(host: LoraTargets, lora: types.LoraConfig, alpha: float) -> JsonObject:
    """The peft ``LoraConfig`` fields of a Tinker ``LoraConfig``: rank, no dropout, and the
    linear layers its ``train_attn`` / ``train_mlp`` / ``train_unembed`` switches name; on a
    mixture of experts ``train_mlp`` trains the expert stacks too (``target_parameters``)."""
    targets = host.lora_targets(lora.train_attn, lora.train_mlp, lora.train_unembed)
    stacks = host.expert_targets() if lora.train_mlp else []
    if not targets and not stacks:
        raise ConfigurationError(
            'the LoRA config trains nothing: set at least one of train_attn, train_mlp, train_unembed'
        )
    config: JsonObject = {'r': lora.rank, 'lora_alpha': alpha, 'lora_dropout': 0.0}
    config['target_modules'] = targets or None
    if stacks:
        config['target_parameters'] = stacks
    return config


class TinkerTarget(Protocol):
    """What a Tinker pass needs of its host: the model, its shape and limits, and its share of a request."""

    model: TransformersModel
    config: ServerConfig
    vocab_size: int
    context: int | None

    def whole_request_share(self) -> float: ...

    def check_image_count(self, rows: list[JsonObject], count: int | None = None) -> None: ...

    def image_row(self, where: str, tokens: list[int], slots: Sequence[ImageSlot]) -> JsonObject: ...


def forward_backward_many(
    host: TinkerTarget, requests: list[tuple[str, ForwardBackwardCall]]
) -> list[bytes | TwinkleError]:
    """Several models' ``forward_backward`` calls (all forward-only, or none) as one pass, each
    datum through its own model's adapter; one ``ForwardBackwardOutput`` per call. A call whose
    loss turns out not finite (known only after the pass) gets its error in place of an output,
    so the others keep theirs and nothing is run twice."""
    forward_only = requests[0][1].forward_only
    if any(call.forward_only != forward_only for _, call in requests):
        raise ConfigurationError('a mixed pass is all forward-only or all forward_backward')
    model, calls, losses, rows = host.model, [], [], []
    for adapter, call in requests:
        loss = TinkerLoss(call.loss_fn, _numbers(call.loss_fn_config))
        loss.share = host.whole_request_share()  # a group's ranks run the request whole; data shard 0 trains on it
        datums, loss_inputs = datum_rows(host, call)
        model.set_loss(loss, adapter_name=adapter)
        calls.append(AdapterCall(adapter, datums, {} if forward_only else loss_inputs))
        losses.append((loss, loss_inputs))
        rows.append(datums)
    outputs = model.forward_backward_mixed(calls, forward_only=forward_only)
    results: list[bytes | TwinkleError] = []
    for adapter_call, output, (loss, loss_inputs), datums in zip(calls, outputs, losses, rows, strict=True):
        if isinstance(output, TwinkleError):  # its loss was not finite: nothing of it was accumulated
            results.append(output)
            continue
        try:
            if forward_only:
                model.calculate_loss(adapter_name=adapter_call.adapter_name, **loss_inputs)
            logps = output.logps if forward_only else loss.last_logps
            if logps is None:
                raise StateError(f'the loss kept no logprobs for model {adapter_call.adapter_name!r}')
            results.append(_output(datums, logps, loss))
        except TwinkleError as error:
            results.append(error)
    return results


def _output(rows: list[InputFeature], logps: torch.Tensor, loss: TinkerLoss) -> bytes:
    outputs = [{'logprobs': logps[i, : len(row['input_ids'])].float().cpu()} for i, row in enumerate(rows)]
    metrics = {name: float(value) for name, value in loss.last_metrics.items()}
    if not all(math.isfinite(v) for v in metrics.values()):
        raise DataError(f'the loss is not finite ({metrics}): check the loss inputs for NaN or extreme values')
    return forward_backward_output(outputs, metrics)


def datum_rows(
    host: TinkerTarget, call: ForwardBackwardCall
) -> tuple[list[InputFeature], dict[str, list[torch.Tensor]]]:
    """Rows for the model and per-row loss inputs, checked: tokens in the vocabulary, inputs as
    long as the datum, lengths within the context and the request within the token limit."""
    if not call.data:
        raise DataError('forward_backward needs at least one datum')
    rows, total = [], 0
    inputs: dict[str, list[torch.Tensor]] = {}
    host.check_image_count([], count=sum(len(datum.images) for datum in call.data))
    for index, datum in enumerate(call.data):
        rows.append(_row(host, index, datum))
        total += len(datum.tokens)
        for name, value in datum.loss_fn_inputs.items():
            if name != 'target_tokens':
                inputs.setdefault(name, []).append(value.reshape(-1).float())
    limit = host.config.limits.max_tokens_per_request
    if total > limit:
        raise DataError(f'the request holds {total} tokens, over the limit of {limit} per request')
    missing = [name for name, values in inputs.items() if len(values) != len(rows)]
    if missing:
        raise DataError(f'loss inputs {missing} are given for some datums but not all')
    return rows, inputs


def _row(host: TinkerTarget, index: int, datum: Datum) -> InputFeature:
    """A datum as a row (its image chunks made pixels), checked: loss inputs as long as its
    tokens, finite, and token ids and targets in the vocabulary."""
    tokens, inputs = datum.tokens, datum.loss_fn_inputs
    length = len(tokens)
    if length == 0:
        raise DataError(f'datum {index} has no tokens')
    if host.context is not None and length > host.context:
        raise SequenceTooLongError(f'datum {index} has {length} tokens, over the model context of {host.context}')
    if 'target_tokens' not in inputs:
        raise DataError(f'datum {index} has no target_tokens among its loss_fn_inputs {sorted(inputs)}')
    for name, value in inputs.items():
        if value.numel() != length:
            raise DataError(f'datum {index}: loss input {name!r} has {value.numel()} values for {length} tokens')
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise DataError(f'datum {index}: loss input {name!r} holds NaN or infinite values')
    targets = inputs['target_tokens'].reshape(-1).long().tolist()
    row = host.image_row(f'datum {index}', list(tokens), datum.images)
    for what, ids in (('token id', row['input_ids']), ('target token', targets)):
        bad = next((t for t in ids if not 0 <= t < host.vocab_size), None)
        if bad is not None:
            raise DataError(f'datum {index} has {what} {bad}, outside the vocabulary [0, {host.vocab_size})')
    return cast(InputFeature, {**row, 'labels': targets})


def optim_steps(model: TransformersModel, requests: list[tuple[str, types.AdamParams]]) -> list[Outcome]:
    """Several models' ``optim_step`` as one optimizer update (``clip_grad_and_step_many``): the
    numbers of each model's step taken alone. Every request is checked before any is applied;
    a failure after that fails every request (none is run again: gradients may be clipped)."""
    for _, params in requests:
        check_adam(params)
    calls = [StepCall(adapter, p.grad_clip_norm if p.grad_clip_norm > 0 else math.inf) for adapter, p in requests]
    try:
        for adapter, params in requests:
            model.set_optimizer_hyperparams(
                adapter_name=adapter, lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                weight_decay=params.weight_decay,
            )  # fmt: skip
        return [_step_metrics(result) for result in model.clip_grad_and_step_many(calls)]
    except Exception as error:
        return [error] * len(requests)


def _step_metrics(result: OptimizerStep) -> JsonObject:
    norm = result.grad_norm
    metrics: JsonObject = {'grad_norm:mean': norm} if norm is not None and math.isfinite(norm) else {}
    if not result.stepped:
        metrics['skipped_steps:sum'] = 1.0
    return {'metrics': metrics}


def check_adam(params: types.AdamParams) -> None:
    values = params.model_dump()
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    if bad:
        raise DataError(f'optim_step: {bad} must be finite numbers')
    if params.learning_rate < 0 or params.eps <= 0 or params.weight_decay < 0 or params.grad_clip_norm < 0:
        raise DataError(
            f'optim_step: learning_rate, weight_decay and grad_clip_norm must be >= 0 and eps > 0; got {values}'
        )
    if not (0 <= params.beta1 < 1 and 0 <= params.beta2 < 1):
        raise DataError(f'optim_step: beta1 and beta2 must be in [0, 1); got {params.beta1}, {params.beta2}')


def _numbers(config: Mapping[str, float | str]) -> dict[str, float]:
    text = {k: v for k, v in config.items() if isinstance(v, str)}
    if text:
        raise ConfigurationError(f'loss_fn_config values must be numbers; got text for {sorted(text)}')
    return {k: v for k, v in config.items() if not isinstance(v, str)}
