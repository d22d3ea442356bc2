"""Optimizer and scheduler tables, and the warmup schedules worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from twinkle.errors import ConfigurationError, UnknownNameError
from twinkle.model.optim.registry import SCHEDULERS, build_optimizer, build_scheduler


def lrs(name: str, steps: int, **kwargs) -> list[float]:
    optimizer = build_optimizer('SGD', [torch.nn.Parameter(torch.zeros(2))], {'lr': 1.0})
    scheduler = build_scheduler(name, optimizer, kwargs)
    values = []
    for _ in range(steps):
        values.append(optimizer.param_groups[0]['lr'])
        optimizer.step()
        scheduler.step()
    return values


def test_cosine_warmup_by_hand():
    # warmup 3: (s+1)/4 -> .25 .5 .75; then cos over 4 steps: 0.5(1+cos(pi*p)), p = 0, .25, .5, .75
    expected = [0.25, 0.5, 0.75, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]
    assert lrs('CosineWarmupScheduler', 7, num_warmup_steps=3, num_training_steps=7) == pytest.approx(expected)


def test_linear_warmup_by_hand_with_a_floor():
    # warmup 1: 0.5; then 1 - p over 4 steps, floored at 0.2: 0.2 + 0.8 (1 - p), p = 0, .25, .5, .75, 1
    expected = [0.5, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    got = lrs('LinearWarmupScheduler', 7, num_warmup_steps=1, num_training_steps=5, min_lr_ratio=0.2)
    assert got == pytest.approx(expected)


def test_torch_schedulers_and_optimizers_are_registered_by_name():
    assert {'CosineAnnealingLR', 'LinearLR', 'StepLR', 'CosineWarmupScheduler'} <= set(SCHEDULERS.names())
    assert lrs('StepLR', 3, step_size=2, gamma=0.1) == pytest.approx([1.0, 1.0, 0.1])


def test_bad_names_and_arguments_list_the_accepted_ones():
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(UnknownNameError, match=r"Unknown optimizer 'adamw'.*'AdamW'"):
        build_optimizer('adamw', params, {})
    with pytest.raises(ConfigurationError, match=r"does not take \['betas2'\].*'betas'"):
        build_optimizer('AdamW', params, {'betas2': (0.9, 0.9)})
    with pytest.raises(ConfigurationError, match='num_training_steps > 0'):
        lrs('CosineWarmupScheduler', 1, num_warmup_steps=0, num_training_steps=0)
