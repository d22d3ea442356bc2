"""Several adapters clipped and stepped together (``clip_grad_and_step_many``) give the numbers
of the same adapters stepped one by one, bit for bit, and step together when they can."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig

from twinkle.errors import ConfigurationError
from twinkle.model import StepCall, TransformersModel
from twinkle.model.optim import multi_step as multi_step_module
from twinkle.model.optim.offload import OptimizerOffloader

# name: (rank, optimizer, its options, max_grad_norm, gradient_accumulation_steps)
ADAPTERS: dict[str, tuple[int, str, dict[str, float], float, int]] = {
    'a': (4, 'AdamW', {'lr': 1e-3, 'weight_decay': 0.01}, 1.0, 1),
    'b': (8, 'AdamW', {'lr': 1e-3, 'weight_decay': 0.01}, math.inf, 1),  # same hyperparameters, no clipping
    'c': (2, 'Adam', {'lr': 5e-4}, 0.05, 1),  # Adam's coupled weight decay, clipped hard
    'd': (4, 'AdamW', {'lr': 2e-3, 'betas': (0.8, 0.95)}, 1.0, 2),  # steps every second call
    'e': (4, 'SGD', {'lr': 1e-2}, 1.0, 1),  # cannot be stepped together: steps alone
    # a's settings with torch's own default kernel instead of the fused one: stepped beside the
    # others, with the kernel it steps with alone.
    'f': (4, 'AdamW', {'lr': 1e-3, 'weight_decay': 0.01, 'fused': False}, 1.0, 1),
}
ROWS = {name: [[1 + i, 5 + 2 * i, 9 + i, 3, 7 + i] for i in range(2)] for name in ADAPTERS}


def build(tiny_model_dir: str, offload_to: str | None = None) -> TransformersModel:
    torch.manual_seed(0)
    model = TransformersModel(tiny_model_dir, device='cpu')
    if offload_to is not None:
        model.offloader = OptimizerOffloader('cpu', offload_to, max_in_memory=2)
    for name, (rank, optimizer, options, _, accumulation) in ADAPTERS.items():
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules='all-linear', init_lora_weights=False)
        model.add_adapter_to_model(name, lora, gradient_accumulation_steps=accumulation)
        model.set_optimizer(optimizer, adapter_name=name, **options)
    return model


def train(model: TransformersModel, steps: int, together: bool) -> list[list[tuple[float | None, bool]]]:
    """``steps`` rounds of forward_backward then clip_grad_and_step for every adapter."""
    log = []
    for step in range(steps):
        for name, rows in ROWS.items():
            inputs = [{'input_ids': [(t + step) % 50 for t in row], 'labels': row} for row in rows]
            model.forward_backward(inputs=inputs, adapter_name=name)
        calls = [StepCall(name, spec[3]) for name, spec in ADAPTERS.items()]
        if together:
            log.append([(r.grad_norm, r.stepped) for r in model.clip_grad_and_step_many(calls)])
        else:
            log.append([_one(model, call) for call in calls])
    return log


def _one(model: TransformersModel, call: StepCall) -> tuple[float | None, bool]:
    norm = model.clip_grad_norm(call.max_grad_norm, adapter_name=call.adapter_name)
    stepped = model.step(adapter_name=call.adapter_name)
    model.zero_grad(adapter_name=call.adapter_name)
    model.lr_step(adapter_name=call.adapter_name)
    return norm, stepped


def weights(model: TransformersModel) -> dict[str, list[torch.Tensor]]:
    return {name: [p.detach().clone() for p in model.groups[name].params] for name in ADAPTERS}


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many optimizers each multi-tensor update stepped."""
    sizes: list[int] = []
    real = multi_step_module.step_together

    def spy(optimizers: list[torch.optim.Optimizer]) -> None:
        sizes.append(len(optimizers))
        real(optimizers)

    monkeypatch.setattr(multi_step_module, 'step_together', spy)
    return sizes


@pytest.mark.slow
@pytest.mark.parametrize('offload', [False, True], ids=['in-memory', 'offloaded'])
def test_stepping_together_gives_the_numbers_of_one_by_one(
    tiny_model_dir: str, tmp_path, fused_calls: list[int], offload: bool
) -> None:
    one_by_one = build(tiny_model_dir, str(tmp_path / 'a') if offload else None)
    together = build(tiny_model_dir, str(tmp_path / 'b') if offload else None)
    expected = train(one_by_one, 4, together=False)
    assert fused_calls == []
    got = train(together, 4, together=True)
    assert got == expected  # norms exactly equal, the same steps taken
    for name, params in weights(one_by_one).items():
        assert all(torch.equal(a, b) for a, b in zip(params, weights(together)[name], strict=True)), name
    for name in ADAPTERS:
        assert together.groups[name].window.optim_step == one_by_one.groups[name].window.optim_step
    # Round 1 makes the optimizers' state one by one. Then a, b, c and f step together, and d
    # with them from its second step (round 4); e's SGD steps alone. Offloaded (max_in_memory=2),
    # the adapters ready to step go two at a time, the pairs with state together.
    assert fused_calls == ([2, 2, 2, 2] if offload else [4, 4, 5])


def test_a_non_finite_gradient_skips_that_step_alone(tiny_model_dir: str) -> None:
    model = build(tiny_model_dir)
    train(model, 1, together=True)  # the optimizers' state exists: the next round steps together
    for name, rows in ROWS.items():
        model.forward_backward(inputs=[{'input_ids': row, 'labels': row} for row in rows], adapter_name=name)
    poisoned = model.groups['b'].params[0]
    assert poisoned.grad is not None
    poisoned.grad[0, 0] = float('nan')
    before = weights(model)
    results = model.clip_grad_and_step_many([StepCall(name, ADAPTERS[name][3]) for name in ('a', 'b', 'c')])
    assert [r.stepped for r in results] == [True, False, True]
    assert results[1].grad_norm is not None and math.isnan(results[1].grad_norm)
    after = weights(model)
    assert all(torch.equal(x, y) for x, y in zip(before['b'], after['b'], strict=True))
    assert not torch.equal(before['a'][0], after['a'][0])
    assert all(p.grad is None for p in model.groups['b'].params)  # zeroed like a stepped adapter


def test_an_adapter_steps_once_per_call(tiny_model_dir: str) -> None:
    model = build(tiny_model_dir)
    with pytest.raises(ConfigurationError, match='once per call'):
        model.clip_grad_and_step_many([StepCall('a'), StepCall('a')])


def test_adam_takes_the_fused_kernel_unless_a_kernel_is_chosen(tiny_model_dir: str) -> None:
    model = build(tiny_model_dir)
    kernels = {name: model.groups[name].optimizer.defaults.get('fused') for name in ADAPTERS}
    assert kernels == {'a': True, 'b': True, 'c': True, 'd': True, 'e': None, 'f': False}
    model.set_optimizer('AdamW', adapter_name='a', foreach=False)
    assert not model.groups['a'].optimizer.defaults['fused']


def test_the_fused_kernel_trains_as_torchs_default_one(tiny_model_dir: str) -> None:
    """The same Adam arithmetic in one pass: after 4 steps the weights agree with the default
    kernel's to float32 rounding (measured 6e-8 here), not bit for bit."""
    models = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = TransformersModel(tiny_model_dir, device='cpu')
        lora = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)
        model.add_adapter_to_model('a', lora)
        model.set_optimizer('AdamW', adapter_name='a', lr=1e-3, weight_decay=0.01, fused=fused)
        for step in range(4):
            rows = [{'input_ids': [(t + step) % 50 for t in row], 'labels': row} for row in ROWS['a']]
            model.forward_backward(inputs=rows, adapter_name='a')
            model.clip_grad_and_step(1.0, adapter_name='a')
        models[fused] = model.groups['a'].params
    for fused, default in zip(models[True], models[False], strict=True):
        assert not torch.equal(fused, torch.zeros_like(fused))
        torch.testing.assert_close(fused, default, rtol=0, atol=1e-6)
