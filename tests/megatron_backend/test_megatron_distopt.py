"""megatron's DistributedDataParallel and distributed optimizer (``MegatronModel(distributed_optimizer=True)``).

``dist_distopt.py`` trains the full model with AdamW (clipped, under a warmup schedule) from the same weights
on the same global batch: in one process, and on two data-parallel ranks (real ``torch.distributed.run``
processes over gloo) with the project's per-parameter reduction and with megatron's ZeRO-1. Every figure must
be the one process's within 1e-5 (the same arithmetic, summed in another order over the ranks).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip('megatron.core')

from safetensors.torch import load_file

HERE = Path(__file__).parent
SAME = 1e-5


@pytest.fixture(scope='module')
def runs(tmp_path_factory: pytest.TempPathFactory, torchrun: Callable[..., str]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp('megatron-distopt')
    folders = {}
    for layout, ranks in (('tp1', 1), ('dp2', 2)):
        folders[layout] = root / layout
        folders[layout].mkdir()
        torchrun(HERE / 'dist_distopt.py', ranks, folders[layout], layout)
    return folders


def results(folder: Path) -> dict:
    return json.loads((folder / 'results.json').read_text())


def assert_close(got: float, want: float) -> None:
    assert abs(got - want) <= SAME * max(1.0, abs(want)), (got, want)


def assert_weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
    for name, value in want.items():
        assert (got[name] - value).abs().max().item() <= SAME * max(1.0, value.abs().max().item()), name


@pytest.mark.parametrize('run', ['distopt', 'plain'])
def test_two_adamw_steps_at_dp2_give_the_one_process_figures_and_weights(runs, run):
    one, other = results(runs['tp1'])['one'], results(runs['dp2'])[run]
    # Clipping and the schedule act: the norm is above the clip, the warmup's first rate is half the second.
    assert one['grad_norms'][0] > 1.0
    assert one['lrs'] == pytest.approx([5e-4, 1e-3])
    assert other['lrs'] == pytest.approx(one['lrs'])
    for key in ('losses', 'grad_norms'):
        for got, want in zip(other[key], one[key], strict=True):
            assert_close(got, want)
    assert one['loss_after'] < one['losses'][0]
    assert_close(other['loss_after'], one['loss_after'])
    weights = load_file(str(runs['dp2'] / f'{run}-weights.safetensors'))
    assert_weights_close(weights, load_file(str(runs['tp1'] / 'one-weights.safetensors')))


def test_distributed_optimizer_equals_the_per_parameter_reduction_at_dp2(runs):
    got = load_file(str(runs['dp2'] / 'distopt-weights.safetensors'))
    assert_weights_close(got, load_file(str(runs['dp2'] / 'plain-weights.safetensors')))
    plain, distopt = results(runs['dp2'])['plain'], results(runs['dp2'])['distopt']
    for key in ('losses', 'grad_norms'):
        for a, b in zip(distopt[key], plain[key], strict=True):
            assert_close(a, b)


def test_each_rank_holds_about_half_the_optimizer_state(runs):
    plain, distopt = results(runs['dp2'])['plain'], results(runs['dp2'])['distopt']
    # AdamW's two float32 moments of every weight on each rank, and one step count per tensor...
    assert plain['state_bytes'][0] == plain['state_bytes'][1] > 0
    for rank in range(2):
        # ...against a 1/dp shard of each flat buffer (its padding, and a step count per shard, aside).
        assert distopt['state_bytes'][rank] / plain['state_bytes'][rank] == pytest.approx(0.5, abs=0.02)


def test_a_full_save_writes_the_whole_hugging_face_weights(runs):
    saved = load_file(str(runs['dp2'] / 'full' / 'model.safetensors'))
    assert_weights_close(saved, load_file(str(runs['dp2'] / 'distopt-weights.safetensors')))
    assert_weights_close(saved, load_file(str(runs['tp1'] / 'one-weights.safetensors')))


def test_the_switch_refuses_what_it_cannot_do(runs):
    alone = results(runs['tp1'])['refused']
    assert 'dp_size=1' in alone['dp1'] and 'dp_size >= 2' in alone['dp1']
    refused = results(runs['dp2'])['refused']
    assert "adapter 'a'" in refused['adapter'] and 'distributed_optimizer=False' in refused['adapter']
    assert "'RMSprop'" in refused['optimizer'] and "['AdamW', 'Adam']" in refused['optimizer']
    assert "['amsgrad']" in refused['argument'] and "'weight_decay'" in refused['argument']
    assert 'waiting for a step' in refused['mid_window'] and 'after clip_grad_and_step' in refused['mid_window']
    assert 'dtype=torch.bfloat16' in refused['dtype'] and 'leave dtype unset' in refused['dtype']
    assert not (runs['dp2'] / 'mid-window').exists()


def test_a_checkpoint_from_before_the_first_step_restores_a_fresh_optimizer(runs):
    # Saved with no optimizer state yet; restored by a model that has stepped since and holds other rows'
    # gradients in megatron's buffers: its next step is a new model's first (weights equal).
    assert results(runs['dp2'])['step_zero']['weights_diff'] <= SAME


def test_a_run_resumed_from_the_gathered_optimizer_state_continues_exactly(runs):
    # Saved after 2 steps with megatron's sharded state gathered to rank 0; a new model resumes it, and its
    # third step is the one the saved model took. The loss is the same forward on the same saved weights;
    # the weights after the step check the restored state (AdamW's moments, step and lr).
    resume = results(runs['dp2'])['resume']
    assert resume['optim_step'] == 2
    assert_close(resume['resumed'], resume['continued'])
    assert resume['weights_diff'] <= SAME
