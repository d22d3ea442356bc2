"""A ``forward_backward`` datum's provenance, checked against the sequences the server recorded
when it sampled them (``record_stability_info``), and what ``stable_reinforce`` reads of them.

The codec has checked that a datum's spans tile its fields. For ``stable_reinforce``, which reads
the records, each span must also name a sequence this tenant sampled in the training model's own
Tinker session, not expired, with the span inside that sequence's prompt or sampled tokens and the
datum's tokens equal to the recorded ones there: the ``model_input`` tokens for
``model_input_spans``, the ``target_tokens`` for ``loss_fn_input_spans``. Any other datum is
refused with a 400 naming it and the span, before the request is accepted. Each request that names
a sequence starts its day again.

Other losses read no record, so their spans are only decoded: tinker-cookbook attaches provenance
to every datum whose actions carry a ``sequence_id``, and every sampled sequence carries one,
recorded or not (the SDK's default is not to record).

For ``stable_reinforce`` every datum needs spans; the server then adds the loss inputs
``RECORDED_LOGPROBS`` (the sampler's logprob of each target a sampled span covers, as recorded)
and ``RECORDED_MASK`` (1 there, 0 at prompt positions), so the loss never reads a sampler
logprob the client could have changed.
"""

from __future__ import annotations

import dataclasses

import torch

from twinkle.errors import DataError
from twinkle.loss.tinker import RECORDED_LOGPROBS, RECORDED_MASK
from twinkle.server.execution.tinker.codec import Datum, ForwardBackwardCall, Span
from twinkle.server.store import Run, SampledRecord, Store, Tenant

STABLE_REINFORCE = 'stable_reinforce'


def checked_call(store: Store, who: Tenant, run: Run, call: ForwardBackwardCall) -> ForwardBackwardCall:
    """``call`` as it is, or for ``stable_reinforce`` with every datum's spans checked (``DataError``
    naming the first bad one) and the recorded sampler logprobs added to its loss inputs."""
    if call.loss_fn != STABLE_REINFORCE:
        return call
    _check_stable_inputs(call)
    named = [span.sequence_id for datum in call.data for span in _all_spans(datum)]
    records = store.sequences.get(who.id, named)
    now = store.sequences.now()
    data = [_checked(index, datum, records, run.session_id, now) for index, datum in enumerate(call.data)]
    store.sequences.touch(named)
    return dataclasses.replace(call, data=data)


def _check_stable_inputs(call: ForwardBackwardCall) -> None:
    for index, datum in enumerate(call.data):
        if datum.loss_fn_input_spans is None:
            raise DataError(
                f'datum {index} has no provenance spans; {STABLE_REINFORCE} needs them on every datum '
                '(Datum.with_provenance, naming sequences sampled with record_stability_info=True)'
            )
        own = sorted({RECORDED_LOGPROBS, RECORDED_MASK} & set(datum.loss_fn_inputs))
        if own:
            raise DataError(
                f'datum {index} sends loss inputs {own}; {STABLE_REINFORCE} takes them from the sampled '
                'sequences its spans name, never from the request'
            )


def _all_spans(datum: Datum) -> list[Span]:
    return [*(datum.model_input_spans or []), *(datum.loss_fn_input_spans or [])]


def _checked(index: int, datum: Datum, records: dict[str, SampledRecord], session_id: str | None, now: float) -> Datum:
    """The datum with its spans checked and the recorded sampler logprobs among its loss inputs."""
    if datum.model_input_spans is None or datum.loss_fn_input_spans is None:  # refused by _check_stable_inputs
        raise DataError(f'datum {index} has no provenance spans')
    given = datum.loss_fn_inputs.get('target_tokens')
    targets = given.reshape(-1).long().tolist() if given is not None else []
    where = f'datum {index}'
    _check_field(f'{where} model_input_spans', datum.model_input_spans, datum.tokens, records, session_id, now)
    _check_field(f'{where} loss_fn_input_spans', datum.loss_fn_input_spans, targets, records, session_id, now)
    logprobs, mask = _recorded(datum.loss_fn_input_spans, records)
    if not any(mask):
        raise DataError(
            f'{where}: no loss_fn_input_spans span is sampled_tokens; {STABLE_REINFORCE} has nothing to train'
        )
    inputs = {**datum.loss_fn_inputs, RECORDED_LOGPROBS: torch.tensor(logprobs), RECORDED_MASK: torch.tensor(mask)}
    return dataclasses.replace(datum, loss_fn_inputs=inputs)


def _check_field(
    field: str,
    spans: list[Span],
    tokens: list[int],
    records: dict[str, SampledRecord],
    session_id: str | None,
    now: float,
) -> None:
    """Each span of one field against its sequence's recorded prompt or sampled tokens."""
    position = 0
    for number, span in enumerate(spans):
        where = f'{field}[{number}] ({span.kind} span of sequence {span.sequence_id!r})'
        source = _source(where, span, records.get(span.sequence_id), session_id, now)
        if span.offset + span.length > len(source):
            raise DataError(
                f'{where} covers positions [{span.offset}, {span.offset + span.length}) of the {span.kind} '
                f'tokens, but the sequence has {len(source)}'
            )
        claimed = tokens[position : position + span.length]
        recorded = source[span.offset : span.offset + span.length]
        if claimed != recorded:
            at = next(i for i, (a, b) in enumerate(zip(claimed, recorded, strict=True)) if a != b)
            raise DataError(
                f'{where}: token {claimed[at]} at datum position {position + at} is not the recorded '
                f'{recorded[at]} at {span.kind} position {span.offset + at}'
            )
        position += span.length


def _source(where: str, span: Span, record: SampledRecord | None, session_id: str | None, now: float) -> list[int]:
    if record is None:
        raise DataError(f'{where} names no sequence this server recorded (sample with record_stability_info=True)')
    if record.session_id != session_id:
        raise DataError(f"{where} names a sequence of another session than this training model's")
    if record.expired(now):
        raise DataError(f'{where} names a sequence that has expired: unused by training for more than a day')
    return record.prompt if span.kind == 'prompt' else record.tokens


def _recorded(spans: list[Span], records: dict[str, SampledRecord]) -> tuple[list[float], list[float]]:
    """The recorded sampler logprob at each target position a sampled span covers (0 elsewhere),
    and the mask of those positions."""
    logprobs: list[float] = []
    mask: list[float] = []
    for span in spans:
        sampled = span.kind == 'sampled'
        if sampled:
            logprobs += records[span.sequence_id].logprobs[span.offset : span.offset + span.length]
        else:
            logprobs += [0.0] * span.length
        mask += [1.0 if sampled else 0.0] * span.length
    return logprobs, mask


__all__ = ['checked_call']
