"""torchrun mode: two real processes (gloo, CPU) against one process with the same global batch.

``dist_train.py`` runs four scenarios (LoRA and full-parameter, data parallel and FSDP2) once
under ``torch.distributed.run --nproc_per_node=2`` and once in this process; the module fixture
runs both, and the tests compare what they wrote.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_train import GLOBAL_BATCH, SCENARIOS, main, rows
from server_helpers import here_and_under_torchrun

import twinkle
from twinkle import DeviceMesh
from twinkle.dataloader import DataLoader
from twinkle.errors import ConfigurationError, StateError
from twinkle.loss import LossOutput
from twinkle.metric import Accuracy, CompletionRewardMetric, GRPOMetric, LossMetric, TrainMetric
from twinkle.model import TransformersModel

SCRIPT = Path(__file__).with_name('dist_train.py')
TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def local_again():
    yield
    twinkle.initialize(mode='local', seed=None)


@pytest.fixture(scope='module')
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path, Path]:
    """(one process's results, two ranks' results, their output folders)."""
    one, two = tmp_path_factory.mktemp('one'), tmp_path_factory.mktemp('two')
    results = here_and_under_torchrun(SCRIPT, main, one, two)
    return results[0], results[1], one, two


def assert_floats_close(actual: list, expected: list) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert (got is None) == (want is None), (actual, expected)
        if want is not None:
            assert abs(got - want) <= TOLERANCE * max(1.0, abs(want)), (actual, expected)


@pytest.mark.integration
@pytest.mark.parametrize('scenario', SCENARIOS)
def test_two_ranks_give_the_losses_and_metrics_of_one_process(runs, scenario):
    # Each rank ran 2 rows of every batch of 4; the loss is the token mean over all 4 rows, and
    # the step divides the summed gradient by the token count of both ranks: the numbers of one
    # process with the whole batch, up to float rounding.
    one, two = runs[0][scenario], runs[1][scenario]
    assert_floats_close(two['losses'], one['losses'])
    assert_floats_close(two['grad_norms'], one['grad_norms'])  # None between accumulation boundaries
    for kind in ('train_metrics', 'eval_metrics'):
        assert two[kind].keys() == one[kind].keys()
        assert_floats_close(list(two[kind].values()), list(one[kind].values()))
    if SCENARIOS[scenario][0] == 'lora':
        # Two more steps after saving; after load() into the trained (sharded) model; after
        # resume_from_checkpoint() into a fresh one: all the same, and the same as one process.
        for key in ('continued', 'reloaded', 'resumed'):
            assert_floats_close(two[key], one['continued'])
        # Saved with gradients waiting for a step, resumed: the same, here and under torchrun.
        for results in (one, two):
            assert_floats_close(results['pending_resumed'], one['pending_continued'])
        assert_floats_close(two['pending_continued'], one['pending_continued'])


@pytest.mark.integration
@pytest.mark.parametrize('scenario', SCENARIOS)
def test_the_torchrun_checkpoint_loads_in_one_process_with_the_same_logits(runs, scenario, tiny_model_dir):
    one, two, one_dir, two_dir = runs
    # Rank 0 alone wrote, atomically: no staging folder of the other rank is left behind.
    written = [sorted(p.name for p in (folder / scenario).iterdir()) for folder in (one_dir, two_dir)]
    assert written[1] == written[0]
    batch = [rows()[i] for i in range(GLOBAL_BATCH)]

    def logits(checkpoint: str) -> torch.Tensor:
        if SCENARIOS[scenario][0] == 'full':
            return TransformersModel(model_id=checkpoint).forward_only(inputs=batch).logits
        model = TransformersModel(model_id=tiny_model_dir)
        model.add_adapter_to_model('alice', checkpoint)
        return model.forward_only(inputs=batch).logits

    expected = logits(one[scenario]['checkpoint'])
    torch.testing.assert_close(logits(two[scenario]['checkpoint']), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.integration
@pytest.mark.parametrize('scenario', SCENARIOS)
def test_the_model_says_how_it_is_spread(runs, scenario):
    # One process: no mesh. Two ranks: data parallel over the runtime's mesh of 2, or FSDP2
    # sharding over a mesh of 2 (the scenario's own), whose forwards every rank runs in step.
    assert runs[0][scenario]['layout'] == {'world_size': 1, 'uses_fsdp': False}
    assert runs[1][scenario]['layout'] == {'world_size': 2, 'uses_fsdp': SCENARIOS[scenario][1] == 'fsdp'}


@pytest.mark.integration
def test_fsdp2_refuses_an_adapter_after_it_sharded_the_model(runs):
    one, two = runs[0], runs[1]
    assert one['fsdp-lora']['late_adapter'] == 'added'  # one process: nothing is sharded
    assert two['dp-lora']['late_adapter'] == 'added'  # data parallel: broadcast from rank 0
    assert "adapter 'late' comes after the first forward" in two['fsdp-lora']['late_adapter']
    assert 'add every adapter before training' in two['fsdp-lora']['late_adapter']


# ---- bad layouts fail before any work -----------------------------------------------------------
def test_a_mesh_that_does_not_fit_the_processes_fails_before_starting(monkeypatch):
    monkeypatch.setenv('WORLD_SIZE', '2')
    mesh = DeviceMesh.from_sizes(fsdp_size=2, dp_size=2, device_type='cpu')
    with pytest.raises(ConfigurationError, match=r'world_size 4 but 2 process.*torchrun --nproc_per_node=4'):
        twinkle.initialize(mode='local', global_device_mesh=mesh)
    assert not dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the error of a machine without CUDA')
def test_a_cuda_mesh_without_cuda_fails_before_starting(monkeypatch):
    for name, value in (('WORLD_SIZE', '2'), ('RANK', '0'), ('LOCAL_RANK', '0')):
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match="device_type='cuda', but local rank 0 has no cuda device"):
        twinkle.initialize(mode='local', global_device_mesh=DeviceMesh.from_sizes(dp_size=2))
    assert not dist.is_initialized()


def test_the_global_batch_must_divide_over_the_data_ranks(monkeypatch):
    monkeypatch.setenv('WORLD_SIZE', '2')

    def dataset() -> list:
        raise AssertionError('the dataset was built before the batch size was checked')

    mesh = DeviceMesh.from_sizes(dp_size=2, device_type='cpu')
    with pytest.raises(ConfigurationError, match=r'batch_size=3 is the global batch .* 2 data ranks.*multiple of 2'):
        DataLoader(dataset, batch_size=3, device_mesh=mesh)


def test_a_model_mesh_needs_its_processes_and_only_fsdp_dp_ep_and_ulysses(tiny_model_dir):
    with pytest.raises(StateError, match='no process group is up: launch with torchrun --nproc_per_node=2'):
        TransformersModel(model_id=tiny_model_dir, device_mesh=DeviceMesh.from_sizes(dp_size=2, device_type='cpu'))
    with pytest.raises(
        ConfigurationError, match=r"over \['fsdp', 'dp', 'ep', 'ulysses'\] only; .* asks for \{'tp': 2\}"
    ):
        TransformersModel(model_id=tiny_model_dir, device_mesh=DeviceMesh.from_sizes(tp_size=2, device_type='cpu'))


# ---- the pieces, in one process ------------------------------------------------------------------
def test_each_data_rank_reads_its_contiguous_slice_of_the_global_batch(monkeypatch):
    # 10 rows in batches of 4: [4, 4, 2] globally; each of 2 ranks takes 2, 2, 1 in a row.
    data = [{'i': i} for i in range(10)]
    whole = DataLoader(data, batch_size=4, shuffle=True, data_seed=3)
    expected = [[row['i'] for row in batch] for batch in whole]
    monkeypatch.setenv('WORLD_SIZE', '2')
    mesh = DeviceMesh.from_sizes(dp_size=2, device_type='cpu')
    shares = []
    for rank in (0, 1):
        monkeypatch.setenv('RANK', str(rank))
        loader = DataLoader(data, batch_size=4, shuffle=True, data_seed=3, device_mesh=mesh)
        shares.append([[row['i'] for row in batch] for batch in loader])
        assert loader.get_state() == whole.get_state()  # global samples, the same on every rank
    assert [first + second for first, second in zip(*shares, strict=True)] == expected
    assert [len(batch) for batch in shares[0]] == [2, 2, 1]
    # 9 rows: a last batch of 1 cannot give both ranks a row, so it is dropped.
    assert len(DataLoader(data[:9], batch_size=4, device_mesh=mesh)) == 2


def test_merged_metrics_equal_one_metric_fed_every_rank():
    # Rank A: 3 loss items summing to 6 and 1 of 2 tokens right; rank B: 1 item of 2, 2 of 2
    # right. Together: loss 8 / 4 = 2, accuracy 3 / 4.
    def loss(total: float, items: int) -> LossOutput:
        return LossOutput(loss=torch.tensor(total), num_items=torch.tensor(items))

    labels_a, labels_b = torch.tensor([[0, 1]]), torch.tensor([[1, 1]])
    logits = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])  # argmax 0 at both positions
    rank_a, rank_b = [LossMetric(), Accuracy()], [LossMetric(), Accuracy()]
    for metric in rank_a:
        metric.accumulate(inputs={'labels': labels_a}, outputs={'logits': logits}, loss=loss(6.0, 3))
    for metric in rank_b:
        metric.accumulate(inputs={'labels': labels_b}, outputs={'logits': 1 - logits}, loss=loss(2.0, 1))
    for mine, theirs in zip(rank_a, rank_b, strict=True):
        mine.merge(theirs.state())
    assert rank_a[0].calculate() == {'loss': 2.0} and rank_a[1].calculate() == {'accuracy': 0.75}

    grpo_a, grpo_b = GRPOMetric(), GRPOMetric()
    grpo_a.accumulate(inputs={}, outputs={}, loss=LossOutput(torch.tensor(0.0), torch.tensor(1), metrics={}))
    grpo_b.sums = {'clipped': torch.tensor(1.0), 'tokens': torch.tensor(4.0)}
    grpo_a.merge(grpo_b.state())
    assert grpo_a.calculate() == {'clip_frac': 0.25}

    rewards_a, rewards_b = CompletionRewardMetric(), CompletionRewardMetric()
    rewards_a.accumulate(rewards=[1.0], completion_lengths=[3])
    rewards_b.accumulate(rewards=[0.0], completion_lengths=[5])
    rewards_a.merge(rewards_b.state())
    expected = {'total_reward': 0.5, 'total_reward_std': 0.7071067811865476, 'completion_length': 4.0}
    assert rewards_a.calculate() == expected

    # Ranks run side by side: 100 + 300 tokens over the slower rank's 2 s.
    train_a, train_b = TrainMetric(), TrainMetric()
    train_a.accumulate(num_tokens=100, elapsed_s=1.0)
    train_b.accumulate(num_tokens=300, elapsed_s=2.0)
    train_a.merge(train_b.state())
    assert train_a.calculate()['tokens_per_s'] == 200.0
