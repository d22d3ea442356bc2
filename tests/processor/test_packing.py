"""Packing: rows of skewed lengths laid end to end (first-fit-decreasing), trained padding-free.

A packed batch gives the loss and gradients of the same rows padded (1e-5), with gradient
accumulation too, and attention never crosses from one packed row into another."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from peft import LoraConfig
from transformers import AutoConfig

from twinkle import assets
from twinkle.dataloader import DataLoader
from twinkle.dataset import IterableDataset, PackedStream, PackingDataset
from twinkle.dataset.packing import first_fit_decreasing, pack
from twinkle.errors import ConfigurationError, DataError
from twinkle.loss import CrossEntropyLoss
from twinkle.model import AdapterCall, TransformersModel
from twinkle.model.runner import packs_by_default

TOL = 1e-5
LENGTHS = [40, 7, 23, 5, 31, 12, 9, 3, 18, 27, 6, 14]


def rows(seed: int = 0, lengths: list[int] = LENGTHS) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        ids = torch.randint(5, 3000, (length,), generator=generator).tolist()
        out.append({'input_ids': ids, 'labels': [*ids[1:], -100]})
    return out


def model(name: str = 'tiny-qwen3', gradient_accumulation_steps: int = 1) -> TransformersModel:
    trainer = TransformersModel(model_id=assets.tiny_model(name), device='cpu')
    torch.manual_seed(0)
    trainer.add_adapter_to_model(
        'a',
        LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False),
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
    return trainer


def grads(trainer: TransformersModel) -> list[torch.Tensor]:
    group = trainer.groups['a']
    # A layer the forward does not reach (tiny-qwen3.5 has some) has no gradient: zero, in both runs.
    return [torch.zeros_like(p) if p.grad is None else p.grad / group.pending.items for p in group.params]


def test_first_fit_decreasing_places_every_row_once_within_the_length():
    bins = first_fit_decreasing(LENGTHS, 48)
    assert sorted(i for b in bins for i in b) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in b) <= 48 for b in bins)
    assert len(bins) == -(-sum(LENGTHS) // 48)  # as few sequences as the tokens need, here
    with pytest.raises(DataError, match='row 0 has 40 tokens, more than max_length=32'):
        first_fit_decreasing(LENGTHS, 32)


def test_each_packed_row_keeps_its_own_positions_and_labels():
    packed = pack(rows(), 48)
    for sequence in packed:
        assert len(sequence['input_ids']) <= 48
        starts = [i for i, p in enumerate(sequence['position_ids']) if p == 0]
        ends = [*starts[1:], len(sequence['input_ids'])]
        for start, end in zip(starts, ends, strict=True):  # each row: positions 0.., last label ignored
            assert sequence['position_ids'][start:end] == list(range(end - start))
            assert sequence['labels'][end - 1] == -100


# tiny-qwen3.5's linear-attention layers run once per packed sequence (twinkle.model.packed_recurrence).
@pytest.mark.parametrize('name', ['tiny-qwen3', 'tiny-qwen3.5'])
def test_a_packed_batch_gives_the_loss_and_gradients_of_the_rows_padded(name):
    padded = model(name)
    packed = copy.deepcopy(padded)
    packed.set_processor('InputProcessor', padding_free=True, adapter_name='a')
    batch = rows()
    loss = padded.forward_backward(inputs=batch, adapter_name='a').loss
    packed_rows = list(PackingDataset(batch, max_length=48))
    assert len(packed_rows) < len(batch)
    assert packed.forward_backward(inputs=packed_rows, adapter_name='a').loss == pytest.approx(loss, rel=TOL)
    for got, want in zip(grads(packed), grads(padded), strict=True):
        assert torch.allclose(got, want, rtol=TOL, atol=TOL * float(want.abs().max()))


def test_gradient_accumulation_over_packed_batches_stays_exact():
    padded, packed = model(gradient_accumulation_steps=2), model(gradient_accumulation_steps=2)
    padded.padding_free = False  # rows padded, as an adapter with its own padded processor has them
    for trainer in (padded, packed):
        trainer.set_optimizer('AdamW', lr=1e-2, adapter_name='a')
    packed.set_processor('InputProcessor', padding_free=True, adapter_name='a')
    halves = [rows(1, LENGTHS[:6]), rows(2, LENGTHS[6:])]
    for half in halves:
        padded.forward_backward(inputs=half, adapter_name='a')
        packed.forward_backward(inputs=list(PackingDataset(half, max_length=64)), adapter_name='a')
    norms = [trainer.clip_grad_and_step(adapter_name='a') for trainer in (padded, packed)]
    assert norms[1] == pytest.approx(norms[0], rel=TOL)
    for got, want in zip(packed.groups['a'].params, padded.groups['a'].params, strict=True):
        assert torch.allclose(got, want, atol=TOL)


def test_attention_never_crosses_from_one_packed_row_into_another():
    """The row changed is packed first (the longest): causal attention alone would carry the
    change into the rows after it."""
    trainer = model()
    trainer.set_processor('InputProcessor', padding_free=True, adapter_name='a')
    changed_row, second, third = rows(3, [11, 9, 7])
    changed = {**changed_row, 'input_ids': [token + 1 for token in changed_row['input_ids']]}
    logits = []
    for first in (changed_row, changed):
        sequence = pack([second, first, third], 64)
        assert len(sequence) == 1 and sequence[0]['input_ids'][:11] == first['input_ids']  # longest first
        logits.append(trainer.forward_only(inputs=sequence, adapter_name='a').logits[0])
    assert not torch.allclose(logits[0][:11], logits[1][:11], atol=TOL)
    assert torch.allclose(logits[0][11:], logits[1][11:], atol=TOL)  # the other two rows: unchanged


def test_packed_rows_need_the_padding_free_collator():
    trainer = model()
    trainer.padding_free = False
    with pytest.raises(DataError, match=r'position_ids restart.*padding_free=True'):
        trainer.forward_backward(inputs=pack(rows(), 48), adapter_name='a')
    trainer.padding_free = True  # forward_backward packs, so packed rows train
    assert trainer.forward_backward(inputs=pack(rows(), 48), adapter_name='a').loss > 0


class ShapeRecorder(CrossEntropyLoss):
    """Cross entropy that records the shape of the logits it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, inputs, outputs, **kwargs):
        self.shapes.append(tuple(outputs['logits'].shape[:2]))
        return super().__call__(inputs, outputs, **kwargs)


def test_padding_free_packs_forward_backward_and_gives_the_padded_numbers():
    """With ``padding_free`` an adapter without a processor of its own has its ``forward_backward``
    rows packed into one row (no padding computed), with the padded rows' loss and gradients;
    ``forward`` keeps the rows padded."""
    default, padded = model(), model()
    assert not padded.padding_free and not default.groups['a'].spec.processor_set  # off by default under sdpa
    default.padding_free = True
    recorders = {}
    for trainer in (default, padded):
        recorders[id(trainer)] = ShapeRecorder()
        trainer.set_loss(recorders[id(trainer)], adapter_name='a')
    batch = rows(5)
    loss = padded.forward_backward(inputs=batch, adapter_name='a').loss
    assert default.forward_backward(inputs=batch, adapter_name='a').loss == pytest.approx(loss, rel=TOL)
    assert recorders[id(default)].shapes == [(1, sum(LENGTHS))]
    assert recorders[id(padded)].shapes == [(len(LENGTHS), max(LENGTHS))]
    for got, want in zip(grads(default), grads(padded), strict=True):
        assert torch.allclose(got, want, rtol=TOL, atol=TOL * float(want.abs().max()))
    assert default.forward(inputs=batch, adapter_name='a').logits.shape[:2] == (len(LENGTHS), max(LENGTHS))


def test_padding_free_is_on_by_default_under_flash_attention_only():
    """Packing pays where the attention kernel takes each packed sequence on its own (flash
    attention's variable-length kernels); under sdpa and eager a packed row is attended with a mask
    over all its tokens, so the default leaves its rows padded."""
    config = AutoConfig.from_pretrained(assets.tiny_model('tiny-qwen3'))
    for kernel, packs in [('flash_attention_2', True), ('kernels-community/flash-attn3', True),
                          ('sdpa', False), ('eager', False)]:  # fmt: skip
        config._attn_implementation = kernel
        assert packs_by_default(config) is packs, kernel
    assert TransformersModel(assets.tiny_model('tiny-qwen3'), device='cpu', padding_free=True).padding_free
    with pytest.raises(ConfigurationError, match=r"padding_free must be True or False; got 'yes'"):
        TransformersModel(assets.tiny_model('tiny-qwen3'), device='cpu', padding_free='yes')  # type: ignore[arg-type]


def test_a_data_loader_takes_a_packing_dataset():
    packed = PackingDataset(rows(), max_length=48, buffer_size=6)
    assert packed.source_rows == len(LENGTHS) and 0 < packed.fill <= 1
    batches = list(DataLoader(packed, batch_size=2))
    assert sum(len(r['input_ids']) for b in batches for r in b) == sum(LENGTHS)


@pytest.mark.parametrize('loss_type', ['grpo', 'token_mean'])
def test_a_packed_grpo_batch_gives_the_loss_and_gradients_of_the_rows_padded(loss_type):
    """The rows carry their advantages and sampler logprobs; packing moves them with the rows
    (first-fit-decreasing reorders the rows), and the loss reads them per packed sequence."""
    batch = rows(4)
    for index, row in enumerate(batch):
        prompt = len(row['input_ids']) // 2
        row['labels'] = [-100] * prompt + row['labels'][prompt:]
        trained = sum(label != -100 for label in row['labels'])
        row['advantages'] = (-1.0) ** index * (0.5 + index / 10)
        row['old_logps'] = [-2.0 - 0.01 * (index + t) for t in range(trained)]
    padded = model()
    padded.set_loss('GRPOLoss', adapter_name='a', loss_type=loss_type, epsilon=0.2)
    packed = copy.deepcopy(padded)
    packed.set_processor('InputProcessor', padding_free=True, adapter_name='a')
    plain = [{'input_ids': r['input_ids'], 'labels': r['labels']} for r in batch]
    loss = padded.forward_backward(
        inputs=plain,
        adapter_name='a',
        advantages=[r['advantages'] for r in batch],
        old_logps=[r['old_logps'] for r in batch],
    ).loss
    packed_rows = list(PackingDataset(batch, max_length=48))
    assert packed.forward_backward(inputs=packed_rows, adapter_name='a').loss == pytest.approx(loss, rel=TOL)
    for got, want in zip(grads(packed), grads(padded), strict=True):
        assert torch.allclose(got, want, rtol=TOL, atol=TOL * float(want.abs().max()))


def test_a_packed_stream_packs_buffer_by_buffer_and_resumes_mid_buffer(tmp_path, monkeypatch):
    path = tmp_path / 'encoded.jsonl'
    encoded = rows(5, [int(n) for n in torch.randint(3, 40, (60,), generator=torch.Generator().manual_seed(5))])
    path.write_text('\n'.join(json.dumps(row) for row in encoded))

    def packed_stream() -> PackedStream:
        return PackedStream(IterableDataset(path), max_length=48, buffer_size=7)

    sequences = list(packed_stream())
    assert all(len(s['input_ids']) <= 48 for s in sequences)
    assert sorted(t for s in sequences for t in s['input_ids']) == sorted(t for r in encoded for t in r['input_ids'])
    assert sum(s['packed_rows'] for s in sequences) == 60
    whole = [b for b in DataLoader(packed_stream(), batch_size=2)]
    first = DataLoader(packed_stream(), batch_size=2)
    taken = list(itertools.islice(first, 5))
    assert first.get_state()['streams']['0.0']['handed'] not in (0, None)  # stopped inside a buffer
    resumed = DataLoader(packed_stream(), batch_size=2)
    resumed.load_state(json.loads(json.dumps(first.get_state())))
    assert taken + list(resumed) == whole


def test_rl_fields_carried_by_rows_reach_the_loss_in_a_mixed_pass_and_calculate_loss():
    batch = rows(6, [12, 9, 15])
    for index, row in enumerate(batch):
        row['advantages'] = [1.0, -0.5, 2.0][index]
    trainer = model()
    trainer.add_adapter_to_model('b', LoraConfig(r=2, target_modules='all-linear'))
    for name in ('a', 'b'):
        trainer.set_loss('GRPOLoss', adapter_name=name)
    alone = copy.deepcopy(trainer)
    given = alone.forward_backward(inputs=batch, adapter_name='a', advantages=[1.0, -0.5, 2.0]).loss
    mixed = trainer.forward_backward_mixed(
        [AdapterCall('a', batch), AdapterCall('b', rows(7, [8]), {'advantages': [1.0]})]
    )
    assert mixed[0].loss == pytest.approx(given, rel=TOL)
    trainer.forward_only(inputs=batch, adapter_name='a')
    assert trainer.calculate_loss(adapter_name='a') == pytest.approx(given, rel=1e-4)


def test_packing_refuses_rows_that_disagree_on_a_field_and_keeps_routing_records():
    first, second = rows(8, [5, 6])
    with pytest.raises(DataError, match="1 of the 2 rows packed together have 'advantages'"):
        pack([{**first, 'advantages': 1.0}, second], 64)
    routed = [
        {**row, 'routed_experts': [[[i, i + 1]]] * len(row['input_ids'])} for i, row in enumerate((first, second))
    ]
    (sequence,) = pack(routed, 64)
    assert len(sequence['routed_experts']) == 11
