"""The three parts of a ``TrainGroup``: the stepper's accumulation window, the runner's pending
step and the group that composes them with the user's spec (``model/train_group.py``)."""

from __future__ import annotations

import pytest
import torch

from twinkle.errors import CheckpointError
from twinkle.model.train_group import Accumulation, AdapterSpec, PendingStep, TrainGroup


def test_a_window_of_two_backwards_is_at_its_boundary_once_per_operation():
    window = Accumulation(gradient_accumulation_steps=2)
    window.count_backward(3)
    assert not window.at_boundary('clip')  # 1 backward of 2
    window.count_backward(1)
    assert window.at_open_boundary()
    assert window.at_boundary('clip') and not window.at_boundary('clip')  # once at the boundary
    assert not window.at_open_boundary()  # clip ran there
    assert window.boundary_done() == ['clip']
    assert window.count_step() == 1
    # 2 backwards, 3 + 1 rows, 1 step.
    assert (window.micro_step, window.consumed_train_samples, window.optim_step) == (2, 4, 1)


def test_a_restored_window_takes_the_checkpoints_counters_and_refuses_unknown_operations():
    window = Accumulation()
    window.restore_counters({'cur_step': 6, 'optim_step': 2, 'consumed_train_samples': 12}, accumulation_steps=3)
    assert (window.gradient_accumulation_steps, window.micro_step, window.optim_step) == (3, 6, 2)
    window.mark_done(['clip', 'step'])
    assert not window.at_boundary('step') and window.at_boundary('zero_grad')
    with pytest.raises(CheckpointError, match=r"unknown boundary operations \['jump'\]"):
        window.mark_done(['jump'])


def test_the_pending_step_divides_the_gradient_by_its_items_once_and_closes():
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([4.0, 8.0])
    closed = []
    pending = PendingStep()
    pending.when_closed(lambda: closed.append(True))
    pending.add_items(torch.tensor(3))
    pending.add_items(torch.tensor(1))
    pending.normalize([param])
    pending.normalize([param])  # a second call divides nothing
    assert param.grad.tolist() == [1.0, 2.0]  # [4, 8] / (3 + 1) items
    pending.close([param])
    assert param.grad is None and closed == [True]
    assert (pending.items, pending.normalized) == (0, False)


def test_a_group_composes_its_parts_under_its_specs_name():
    param = torch.nn.Parameter(torch.ones(1))
    group = TrainGroup(AdapterSpec('a'), [param])
    assert group.name == 'a' and group.window.micro_step == 0 and group.pending.forward is None
    moved = torch.nn.Parameter(torch.ones(1))
    group.rebind({id(param): moved})
    assert group.params == [moved]
