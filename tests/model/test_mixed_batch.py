"""``TransformersModel.forward_backward_mixed``: three adapters of different ranks in one pass.

The reference for each adapter is the same model running that adapter's rows alone with
``forward_backward`` / ``forward_only``; a mixed pass must give each adapter the same loss,
gradient and logprobs (1e-5, fp32) and leave the same counters.
"""

from __future__ import annotations

import copy
import doctest

import pytest
import torch
from peft import LoraConfig

from twinkle.errors import ConfigurationError, DataError
from twinkle.model import AdapterCall, TransformersModel, mixed_pass
from twinkle.model.mixed_pass import length_buckets

TOL = 1e-5
# Different ranks, alphas and target layers; 'b' adapts attention only.
ADAPTERS = {
    'a': LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False),
    'b': LoraConfig(
        r=8, lora_alpha=4, target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'], init_lora_weights=False
    ),
    'c': LoraConfig(r=16, lora_alpha=32, target_modules=['up_proj', 'down_proj'], init_lora_weights=False),
}


def _rows(seed: int, lengths: list[int]) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for length in lengths:
        ids = torch.randint(0, 4000, (length,), generator=gen).tolist()
        rows.append({'input_ids': ids, 'labels': [-100] * 2 + ids[2:]})
    return rows


# Each adapter's own rows, of lengths that differ within and across adapters (so the mixed batch pads).
ROWS = {'a': _rows(1, [9, 14]), 'b': _rows(2, [20]), 'c': _rows(3, [5, 11, 7])}


@pytest.fixture(scope='module')
def base(tiny_model_dir: str) -> TransformersModel:
    model = TransformersModel(model_id=tiny_model_dir)
    for index, (name, config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(index)
        model.add_adapter_to_model(name, config)
    return model


def _grads(model: TransformersModel, name: str) -> list[torch.Tensor]:
    """The gradient the optimizer will see: summed over the loss items, divided by their count."""
    group = model.groups[name]
    return [p.grad / group.pending.items for p in group.params]


def _worst(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(xs, ys, strict=True))


@pytest.mark.slow
def test_each_adapter_gets_what_it_would_get_alone(base: TransformersModel) -> None:
    alone, mixed = copy.deepcopy(base), copy.deepcopy(base)
    losses = {name: alone.forward_backward(inputs=ROWS[name], adapter_name=name).loss for name in ADAPTERS}
    outputs = mixed.forward_backward_mixed([AdapterCall(name, ROWS[name]) for name in ADAPTERS])
    worst_grad = 0.0
    for (name, loss), output in zip(losses.items(), outputs, strict=True):
        assert abs(output.loss - loss) <= TOL, name
        grads = _grads(mixed, name)
        assert all(g.abs().max() > 0 for g in grads)  # each layer of the adapter was trained
        worst_grad = max(worst_grad, _worst(grads, _grads(alone, name)))
        for counter in ('micro_step', 'consumed_train_samples'):
            assert getattr(mixed.groups[name].window, counter) == getattr(alone.groups[name].window, counter)
        assert output.num_tokens == sum(len(r['input_ids']) - 2 for r in ROWS[name])
    print(f'mixed vs alone: max |grad diff| {worst_grad:.2e}')
    assert worst_grad <= TOL
    # One optimizer step each: the adapters end up equal too.
    for name in ADAPTERS:
        alone.clip_grad_and_step(adapter_name=name)
        mixed.clip_grad_and_step(adapter_name=name)
        assert _worst(mixed.groups[name].params, alone.groups[name].params) <= TOL


@pytest.mark.slow
def test_a_tenant_sees_the_same_numbers_whoever_shares_its_pass(base: TransformersModel) -> None:
    # 'b' alone, beside 'a', and beside 'a' and 'c' in another order.
    results = []
    for neighbours in ([], ['a'], ['c', 'a']):
        model = copy.deepcopy(base)
        calls = [AdapterCall(n, ROWS[n]) for n in neighbours] + [AdapterCall('b', ROWS['b'])]
        loss = model.forward_backward_mixed(calls)[-1].loss
        results.append((loss, _grads(model, 'b')))
    (loss0, grads0), rest = results[0], results[1:]
    assert all(abs(loss - loss0) <= TOL and _worst(grads, grads0) <= TOL for loss, grads in rest)


@pytest.mark.slow
def test_forward_only_logprobs_match_alone(base: TransformersModel) -> None:
    model = copy.deepcopy(base)
    outputs = model.forward_backward_mixed([AdapterCall(n, ROWS[n]) for n in ADAPTERS], forward_only=True)
    for name, output in zip(ADAPTERS, outputs, strict=True):
        alone = model.forward_only(inputs=ROWS[name], adapter_name=name).logps
        for i, row in enumerate(ROWS[name]):
            n = len(row['input_ids'])
            assert (output.logps[i, :n] - alone[i, :n]).abs().max().item() <= TOL
            assert not output.logps[i, n:].any()  # the mixed batch's extra padding holds nothing
    assert all(p.grad is None for name in ADAPTERS for p in model.groups[name].params)


def test_mixing_refuses_one_adapter_twice_and_unmixable_processors(base: TransformersModel) -> None:
    model = copy.deepcopy(base)
    with pytest.raises(ConfigurationError, match=r"each adapter once; got \['a', 'a'\]"):
        model.forward_backward_mixed([AdapterCall('a', ROWS['a']), AdapterCall('a', ROWS['a'])])
    model.set_processor('InputProcessor', padding_free=True, adapter_name='c')
    with pytest.raises(ConfigurationError, match='collate rows differently'):
        model.forward_backward_mixed([AdapterCall('a', ROWS['a']), AdapterCall('c', ROWS['c'])])
    assert model.batch_key('c') is None and model.batch_key('a') == model.batch_key('b')


def test_a_loss_that_raises_leaves_every_adapter_untouched(base: TransformersModel) -> None:
    # 'b' is set to a loss that needs advantages and gets none: the pass fails before any
    # metric or gradient is counted, so the scheduler can run each request alone afterwards.
    model = copy.deepcopy(base)
    model.set_loss('GRPOLoss', adapter_name='b')
    with pytest.raises(DataError, match='GRPOLoss needs advantages'):
        model.forward_backward_mixed([AdapterCall('a', ROWS['a']), AdapterCall('b', ROWS['b'])])
    assert model.calculate_metric(adapter_name='a').get('loss') is None
    assert all(p.grad is None for name in ('a', 'b') for p in model.groups[name].params)
    assert (model.groups['a'].window.micro_step, model.groups['b'].window.micro_step) == (0, 0)


@pytest.mark.slow
def test_calls_of_far_apart_lengths_get_forwards_of_their_own_and_the_same_numbers(base: TransformersModel) -> None:
    # 'a' brings two rows of about 300 tokens, 'b' and 'c' rows of at most 20: padding 'b' to 300
    # would add 280 tokens (over BUCKET_FREE_TOKENS) and 45 % more than separate forwards, so 'a'
    # runs in one forward and 'b' with 'c' in another (length_buckets); each still gets its numbers alone.
    rows = {**ROWS, 'a': _rows(4, [300, 290])}
    assert length_buckets([300, 20, 11], [2, 1, 3]) == [[0], [1, 2]]
    alone, mixed = copy.deepcopy(base), copy.deepcopy(base)
    losses = {name: alone.forward_backward(inputs=rows[name], adapter_name=name).loss for name in ADAPTERS}
    widths: list[int] = []
    hook = mixed.model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(kwargs['input_ids'].shape[1]), with_kwargs=True
    )
    try:
        outputs = mixed.forward_backward_mixed([AdapterCall(name, rows[name]) for name in ADAPTERS])
    finally:
        hook.remove()
    assert sorted(widths) == [20, 300]  # two forwards, each padded to its own longest row
    for (name, loss), output in zip(losses.items(), outputs, strict=True):
        assert abs(output.loss - loss) <= TOL, name
        assert _worst(_grads(mixed, name), _grads(alone, name)) <= TOL, name


def test_length_buckets_examples_and_the_cpu_token_cap(base: TransformersModel) -> None:
    assert doctest.testmod(mixed_pass).failed == 0
    # On a CPU a forward holds at most CPU_FORWARD_TOKENS padded tokens: 3 calls of 8 rows of 100
    # tokens (800 each) make forwards of 2 calls and 1; a call over the cap is never split.
    assert base.mixed_forward_tokens == mixed_pass.CPU_FORWARD_TOKENS == 2048
    assert length_buckets([100, 100, 100], [8, 8, 8], 2048) == [[0, 1], [2]]
    assert length_buckets([400, 100], [8, 1], 2048) == [[0], [1]]
    assert length_buckets([100, 100, 100], [8, 8, 8], None) == [[0, 1, 2]]
