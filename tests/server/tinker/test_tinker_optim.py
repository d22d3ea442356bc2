"""The hyperparameters a Tinker ``optim_step`` carries reach the optimizer through the model's
``set_optimizer_hyperparams``, not by the server writing into the optimizer: checked on AdamW's
first step, worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig
from tinker import types

from twinkle.errors import ConfigurationError, DataError, StateError
from twinkle.model import TransformersModel
from twinkle.model.optim.registry import build_optimizer, set_hyperparams


def first_adamw_step(param: torch.Tensor, grad: torch.Tensor, lr: float, eps: float, decay: float) -> torch.Tensor:
    """AdamW's first step: the bias-corrected moments are g and g², so the update is
    ``lr * g / (|g| + eps)`` after the decoupled decay ``param * (1 - lr * decay)``, whatever the betas."""
    return param * (1 - lr * decay) - lr * grad / (grad.abs() + eps)


def test_new_hyperparameters_drive_the_next_step_and_biases_keep_no_decay():
    weight, bias = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    groups = [{'params': [weight]}, {'params': [bias], 'weight_decay': 0.0}]  # as set_optimizer groups them
    optimizer = build_optimizer('AdamW', groups, {'lr': 1e-5})
    weight.grad, bias.grad = torch.full((2, 2), 0.002), torch.full((2,), -0.004)
    set_hyperparams(optimizer, {'lr': 0.5, 'betas': [0.5, 0.6], 'eps': 0.001, 'weight_decay': 0.2})
    optimizer.step()
    # eps = 0.001 is half of |g| = 0.002: the update is 0.5 * 2/3, after the decay 1 - 0.5 * 0.2 = 0.9
    torch.testing.assert_close(weight.detach(), torch.full((2, 2), 0.9 - 0.5 * 2 / 3))
    torch.testing.assert_close(bias.detach(), torch.full((2,), 1 + 0.5 * 4 / 5))  # no decay on a bias
    assert optimizer.param_groups[0]['betas'] == (0.5, 0.6)


@pytest.mark.parametrize(
    ('values', 'named'),
    [
        ({'lr': -1.0}, r'lr=-1.0 is refused; accepted lr: a number >= 0'),
        ({'lr': 'fast'}, "lr='fast'"),
        ({'eps': -1e-8}, 'eps=-1e-08'),
        ({'weight_decay': float('nan')}, 'weight_decay=nan'),
        ({'betas': (0.9, 1.0)}, r'betas=\(0.9, 1.0\) is refused; accepted betas: two numbers in \[0, 1\)'),
        ({'betas': (0.9,)}, r'betas=\(0.9,\)'),
    ],
)
def test_a_bad_hyperparameter_is_named_with_what_is_accepted(values, named):
    optimizer = build_optimizer('AdamW', [torch.nn.Parameter(torch.ones(2, 2))], {'lr': 1e-3})
    with pytest.raises(ConfigurationError, match=named):
        set_hyperparams(optimizer, values)
    assert optimizer.param_groups[0]['lr'] == 1e-3  # nothing changed


def test_an_optimizer_without_the_hyperparameter_says_which_it_has():
    optimizer = build_optimizer('SGD', [torch.nn.Parameter(torch.ones(2))], {'lr': 1e-3})
    with pytest.raises(ConfigurationError, match=r"SGD has no hyperparameters \['betas'\].*'momentum'"):
        set_hyperparams(optimizer, {'betas': (0.9, 0.99)})


def test_the_tinker_optim_step_is_adamw_with_the_requests_hyperparameters(tiny_model_dir):
    from twinkle.server.execution.tinker.compute import optim_steps

    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model('a', LoraConfig(r=2, target_modules=['q_proj']))
    with pytest.raises(StateError, match='set_optimizer'):
        model.set_optimizer_hyperparams(adapter_name='a', lr=0.1)
    model.set_optimizer('AdamW', lr=1e-5, adapter_name='a')
    model.forward_backward(inputs=[{'input_ids': [3, 5, 7, 9], 'labels': [5, 7, 9, 11]}], adapter_name='a')
    model.clip_grad_norm(math.inf, adapter_name='a')  # the gradient as the step sees it: divided by its tokens
    params = [p for p in model.model.parameters() if p.requires_grad]
    before = [(p.detach().clone(), p.grad.clone()) for p in params]
    adam = types.AdamParams(learning_rate=0.01, beta1=0.5, beta2=0.6, eps=1e-3, weight_decay=0.1)
    assert optim_steps(model, [('a', adam)]) == [{'metrics': {}}]  # no clipping asked: no norm to report
    for param, (value, grad) in zip(params, before, strict=True):
        torch.testing.assert_close(param.detach(), first_adamw_step(value, grad, 0.01, 1e-3, 0.1))


def test_optim_steps_of_several_models_equal_their_steps_alone(tiny_model_dir):
    # Three models' optim_steps as one update (two share hyperparameters, one has its own; one
    # clips, one does not), against twins stepped one at a time: the same weights, bit for bit.
    from twinkle.server.execution.tinker.compute import optim_steps

    model = TransformersModel(tiny_model_dir, device='cpu')
    adams = {
        'a': types.AdamParams(learning_rate=0.01, grad_clip_norm=0.1),
        'b': types.AdamParams(learning_rate=0.01),
        'c': types.AdamParams(learning_rate=0.003, beta1=0.5, eps=1e-6, weight_decay=0.1, grad_clip_norm=1.0),
    }
    for name in adams:
        for twin in (name, f'{name}-alone'):
            torch.manual_seed(len(name))
            model.add_adapter_to_model(twin, LoraConfig(r=2, target_modules='all-linear', init_lora_weights=False))
            model.set_optimizer('AdamW', lr=1e-5, adapter_name=twin)
    for step in range(3):
        for twin in model.adapter_names:
            row = [3 + step, 5, 7 + ord(twin[0]) % 50, 9]  # twins train on the same row
            model.forward_backward(inputs=[{'input_ids': row, 'labels': [*row[1:], 2]}], adapter_name=twin)
        together = optim_steps(model, list(adams.items()))
        alone = [optim_steps(model, [(f'{name}-alone', adam)])[0] for name, adam in adams.items()]
        assert together == alone
    for name in adams:
        pairs = zip(model.groups[name].params, model.groups[f'{name}-alone'].params, strict=True)
        assert all(torch.equal(p, q) for p, q in pairs), name


def out_of_memory(optimizers: object) -> None:
    raise MemoryError('the update did not fit')


def test_a_shared_step_that_fails_after_clipping_fails_every_request(tiny_model_dir, monkeypatch):
    # Once gradients may be clipped, a failure must reach each tenant as an error: rerunning
    # each request alone would step unclipped gradients, or none (its boundary is used up).
    from twinkle.model.optim import multi_step
    from twinkle.server.execution.tinker.compute import optim_steps

    model = TransformersModel(tiny_model_dir, device='cpu')
    for name in ('a', 'b'):
        model.add_adapter_to_model(name, LoraConfig(r=2, target_modules=['q_proj']))
        model.set_optimizer('AdamW', lr=1e-3, adapter_name=name)
    adam = types.AdamParams(learning_rate=1e-3, grad_clip_norm=1.0)
    row = [{'input_ids': [3, 5, 7, 9], 'labels': [5, 7, 9, 11]}]
    for _ in range(2):  # the first step makes the optimizers' state; the second steps them together
        for name in ('a', 'b'):
            model.forward_backward(inputs=row, adapter_name=name)
        if model.groups['a'].window.optim_step:
            monkeypatch.setattr(multi_step, 'step_together', out_of_memory)
        results = optim_steps(model, [('a', adam), ('b', adam)])
    assert [type(result) for result in results] == [MemoryError, MemoryError]
    with pytest.raises(DataError, match='beta1'):  # a bad request raises before anything changes
        optim_steps(model, [('a', adam), ('b', types.AdamParams(learning_rate=1e-3, beta1=1.5))])
