"""Optimizer state offloading: spilled and moved state comes back bit for bit, and training with the
LRU offloader gives exactly the numbers of training without it."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from twinkle.errors import CheckpointError, ConfigurationError, StateError, UnknownNameError
from twinkle.model.optim import offload
from twinkle.model.optim.offload import (
    OptimizerOffloader,
    load_spilled_optimizer_state,
    move_optimizer_state,
    spill_optimizer_state,
)

# nn.Linear(4, 3): 12 weights + 3 biases, float32; AdamW keeps exp_avg and exp_avg_sq for each.
ADAMW_STATE_BYTES = 2 * (12 + 3) * 4


def make(seed: int) -> tuple[nn.Linear, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed)).to(next(model.parameters()).device)
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def assert_same(a: object, b: object) -> None:
    """Recursive exact equality: tensors by torch.equal (dtype and device too), the rest by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def assert_params_same(a: nn.Module, b: nn.Module) -> None:
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)


def test_assert_same_can_fail():
    with pytest.raises(AssertionError):
        assert_same({'a': torch.zeros(2)}, {'a': torch.tensor([0.0, 1e-30])})
    with pytest.raises(AssertionError):
        assert_same({'step': torch.tensor(1.0)}, {'step': torch.tensor(1.0, dtype=torch.float64)})


def test_spill_round_trip_is_bit_identical(tmp_path: Path):
    reference, ref_opt = make(0)
    spilled, opt = make(0)
    path = tmp_path / 'spill' / 'tenant.pt'
    initial = copy.deepcopy(reference.state_dict())
    for step in range(3):
        train_step(reference, ref_opt, step)
        train_step(spilled, opt, step)
        before = copy.deepcopy(opt.state_dict())
        written = spill_optimizer_state(opt, path)
        assert written == path.stat().st_size > ADAMW_STATE_BYTES
        assert len(opt.state) == 0 and not opt.state_dict()['state']
        assert path.exists() and not path.with_suffix('.tmp').exists()
        load_spilled_optimizer_state(opt, path, 'cpu')
        assert not path.exists()
        assert_same(opt.state_dict(), before)
        assert_same(opt.state_dict(), ref_opt.state_dict())
    assert_params_same(spilled, reference)
    assert not torch.equal(reference.weight, initial['weight'])  # training moved the weights
    assert ref_opt.state_dict()['state'][0]['step'].item() == 3


def test_lost_state_would_be_noticed(tmp_path: Path):
    # What the round trip test guards against: restarting AdamW from empty state changes the weights.
    reference, ref_opt = make(0)
    fresh, opt = make(0)
    for step in range(3):
        train_step(reference, ref_opt, step)
        train_step(fresh, opt, step)
        opt.state.clear()
    assert not torch.equal(reference.weight, fresh.weight)


def test_spill_failure_leaves_no_file_and_keeps_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    model, opt = make(0)
    train_step(model, opt, 0)
    path = tmp_path / 'tenant.pt'
    before = copy.deepcopy(opt.state_dict())

    def half_written(obj: object, f: Path) -> None:
        Path(f).write_bytes(b'partial')
        raise OSError('disk full')

    monkeypatch.setattr(offload.torch, 'save', half_written)
    with pytest.raises(CheckpointError, match='disk full'):
        spill_optimizer_state(opt, path)
    assert list(tmp_path.iterdir()) == []
    assert_same(opt.state_dict(), before)


def test_load_refuses_to_overwrite_and_reports_missing_file(tmp_path: Path):
    model, opt = make(0)
    path = tmp_path / 'tenant.pt'
    with pytest.raises(CheckpointError, match=re.escape('tenant.pt')):
        load_spilled_optimizer_state(opt, path, 'cpu')
    train_step(model, opt, 0)
    spill_optimizer_state(opt, path)
    train_step(model, opt, 1)  # a step after the spill starts fresh state, which the file must not clobber
    with pytest.raises(StateError):
        load_spilled_optimizer_state(opt, path, 'cpu')
    assert path.exists()


def test_spill_of_a_never_stepped_optimizer(tmp_path: Path):
    _, opt = make(0)
    path = tmp_path / 'idle.pt'
    spill_optimizer_state(opt, path)
    load_spilled_optimizer_state(opt, path, 'cpu')
    assert len(opt.state) == 0 and not path.exists()


def test_move_to_cpu_on_cpu_keeps_values():
    model, opt = make(0)
    assert move_optimizer_state(opt, 'cpu') == 0  # never stepped: nothing to move
    train_step(model, opt, 0)
    before = copy.deepcopy(opt.state_dict())
    step = opt.state[model.weight]['step']
    assert move_optimizer_state(opt, 'cpu') == ADAMW_STATE_BYTES
    assert move_optimizer_state(opt, torch.device('cpu')) == ADAMW_STATE_BYTES
    assert_same(opt.state_dict(), before)
    assert opt.state[model.weight]['step'] is step


def test_offloader_lru_on_cpu_matches_reference(tmp_path: Path):
    names = ['a', 'b', 'c', 'd']
    reference = {name: make(seed) for seed, name in enumerate(names)}
    offloaded = {name: make(seed) for seed, name in enumerate(names)}
    offloader = OptimizerOffloader(torch.device('cpu'), tmp_path, max_on_device=1, max_in_memory=2)
    step = 0

    def train(name: str) -> None:
        nonlocal step
        train_step(*reference[name], step)
        offloader.touch(name, offloaded[name][1])
        train_step(*offloaded[name], step)
        step += 1

    for name in names:
        train(name)
    # max_on_device means nothing on a CPU device: the two in memory are both on 'device'.
    assert [offloader.where(name) for name in names] == ['disk', 'disk', 'device', 'device']
    assert sorted(p.name for p in tmp_path.iterdir()) == ['a.pt', 'b.pt']
    assert len(offloaded['a'][1].state) == 0 and len(offloaded['b'][1].state) == 0
    stats = offloader.stats()
    assert stats['count'] == {'device': 2, 'cpu': 0, 'disk': 2}
    assert stats['bytes']['device'] == 2 * ADAMW_STATE_BYTES and stats['bytes']['cpu'] == 0
    assert stats['bytes']['disk'] == (tmp_path / 'a.pt').stat().st_size + (tmp_path / 'b.pt').stat().st_size

    train('a')  # a comes back, the least recently used in memory (c) goes to disk
    assert [offloader.where(name) for name in names] == ['device', 'disk', 'disk', 'device']
    assert sorted(p.name for p in tmp_path.iterdir()) == ['b.pt', 'c.pt']
    for _ in range(3):
        for name in names:
            train(name)
    for name in names:
        assert_params_same(offloaded[name][0], reference[name][0])
        offloader.touch(name, offloaded[name][1])
        assert_same(offloaded[name][1].state_dict(), reference[name][1].state_dict())
    assert offloaded['d'][1].state_dict()['state'][0]['step'].item() == 4


def test_offloader_without_limits_keeps_everything_on_device(tmp_path: Path):
    offloader = OptimizerOffloader('cpu', tmp_path, None, None)
    for seed, name in enumerate(['x', 'y', 'z']):
        model, opt = make(seed)
        offloader.touch(name, opt)
        train_step(model, opt, seed)
    assert offloader.stats() == {
        'count': {'device': 3, 'cpu': 0, 'disk': 0},
        'bytes': {'device': 3 * ADAMW_STATE_BYTES, 'cpu': 0, 'disk': 0},
    }
    assert list(tmp_path.iterdir()) == []


def test_forget_deletes_the_spill_file(tmp_path: Path):
    offloader = OptimizerOffloader('cpu', tmp_path, max_in_memory=1)
    models = {name: make(seed) for seed, name in enumerate(['old', 'new'])}
    for name, (model, opt) in models.items():
        offloader.touch(name, opt)
        train_step(model, opt, 0)
    assert offloader.where('old') == 'disk' and (tmp_path / 'old.pt').exists()
    offloader.forget('old')
    assert not (tmp_path / 'old.pt').exists()
    with pytest.raises(UnknownNameError, match="'old'"):
        offloader.where('old')
    offloader.forget('old')  # twice is fine
    _, other = make(5)
    with pytest.raises(StateError, match="'new'"):
        offloader.touch('new', other)


@pytest.mark.parametrize('name', ['../evil', 'a b', '', 'x.pt', 'ü'])
def test_bad_name_raises_configuration_error(tmp_path: Path, name: str):
    offloader = OptimizerOffloader('cpu', tmp_path, max_in_memory=1)
    _, opt = make(0)
    with pytest.raises(ConfigurationError, match=re.escape(repr(name))):
        offloader.touch(name, opt)
    with pytest.raises(ConfigurationError, match=re.escape(repr(name))):
        offloader.forget(name)
    assert offloader.stats()['count'] == {'device': 0, 'cpu': 0, 'disk': 0}


@pytest.mark.parametrize('limit', [0, -1, 1.5, True])
def test_bad_limit_raises_configuration_error(tmp_path: Path, limit: object):
    with pytest.raises(ConfigurationError, match='max_in_memory'):
        OptimizerOffloader('cpu', tmp_path, max_in_memory=limit)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_offloader_three_tiers_on_cuda(tmp_path: Path):
    names = ['a', 'b', 'c']
    reference = {name: make(seed) for seed, name in enumerate(names)}
    offloaded = {name: make(seed) for seed, name in enumerate(names)}
    for model, _ in [*reference.values(), *offloaded.values()]:
        model.cuda()
    offloader = OptimizerOffloader('cuda', tmp_path, max_on_device=1, max_in_memory=2)
    for step in range(3):
        for name in names:
            train_step(*reference[name], step)
            offloader.touch(name, offloaded[name][1])
            x = offloaded[name][1].state
            assert all(v.is_cuda for s in x.values() for k, v in s.items() if k != 'step')
            train_step(*offloaded[name], step)
        assert [offloader.where(name) for name in names] == ['disk', 'cpu', 'device']
        assert all(v.device.type == 'cpu' for s in offloaded['b'][1].state.values() for v in s.values())
    for name in names:
        offloader.touch(name, offloaded[name][1])
        assert_params_same(offloaded[name][0], reference[name][0])
        assert_same(offloaded[name][1].state_dict(), reference[name][1].state_dict())


def test_a_model_with_an_offloader_trains_exactly_as_one_without(tiny_model_dir: str, tmp_path: Path) -> None:
    # Three adapters stepped in turn with room for one optimizer state in memory: every step
    # first brings its adapter's state back from disk, and the weights match a plain model's.
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    rows = [{'input_ids': list(range(5, 25)), 'labels': list(range(5, 25))}]
    models = []
    for offloading in (False, True):
        model = TransformersModel(model_id=tiny_model_dir)
        if offloading:
            model.offloader = OptimizerOffloader('cpu', tmp_path / 'spill', max_in_memory=1)
        for index, name in enumerate(('a', 'b', 'c')):
            torch.manual_seed(index)
            model.add_adapter_to_model(name, LoraConfig(r=4, target_modules='all-linear'))
            model.set_optimizer('AdamW', lr=1e-2, adapter_name=name)
        for _ in range(3):
            for name in ('a', 'b', 'c'):
                model.forward_backward(inputs=rows, adapter_name=name)
                model.clip_grad_and_step(adapter_name=name)
        models.append(model)
    plain, offloaded = models
    assert [offloaded.offloader.where(n) for n in ('a', 'b', 'c')] == ['disk', 'disk', 'device']
    assert sorted(p.name for p in (tmp_path / 'spill').iterdir()) == ['a.pt', 'b.pt']
    for name in ('a', 'b', 'c'):
        for p, q in zip(plain.groups[name].params, offloaded.groups[name].params, strict=True):
            assert torch.equal(p, q)
    offloaded.remove_adapter('a')  # its spill file goes with it
    assert sorted(p.name for p in (tmp_path / 'spill').iterdir()) == ['b.pt']
