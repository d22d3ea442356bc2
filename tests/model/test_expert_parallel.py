"""Expert parallel: two real processes (gloo, CPU) each holding half of tiny-qwen3-moe's experts
against one process holding them all, with the same global batches.

``dist_experts.py`` trains two adapters (one on every linear layer and expert stack, one on the
experts' ``down_proj``), one at a time and then in a mixed pass, under ``ep_size=2`` with data
parallel and with FSDP2 for the rest of the model. Tokens cross between the ranks with
``all_to_all``; the losses, gradients and saved adapters must be one process's (1e-5 relative).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_experts import ADAPTERS, main
from safetensors.torch import load_file
from server_helpers import here_and_under_torchrun

import twinkle
from twinkle.errors import ConfigurationError
from twinkle.model.parallel.experts import ExpertShard

SCRIPT = Path(__file__).with_name('dist_experts.py')
TOLERANCE = 1e-5
#: Saved weights after the Adam steps, absolutely: Adam divides each gradient by its running RMS, so
#: an element whose gradient is a near-cancelling sum (rounded differently over two ranks than in
#: one process, and with other thread counts) can move by a few percent of lr=1e-3 differently per
#: step (1.9e-5 seen); a wrong gather or a swapped expert differs by the weights themselves (~1e-3).
WEIGHT_TOLERANCE = 5e-5
EXPERT_PARALLEL = ('ep', 'ep-fsdp')


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


def assert_close(actual: list, expected: list) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert abs(got - want) <= TOLERANCE * max(1.0, abs(want)), (actual, expected)


def assert_tensors_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tolerance: float = TOLERANCE
) -> None:
    assert actual.keys() == expected.keys()
    for key, want in expected.items():
        scale = max(1.0, float(want.abs().max()))
        assert float((actual[key] - want).abs().max()) <= tolerance * scale, key


@pytest.mark.integration
@pytest.mark.parametrize('scenario', EXPERT_PARALLEL)
def test_two_ranks_holding_half_the_experts_give_one_process_s_losses_and_gradients(runs, scenario):
    one, two, one_dir, two_dir = runs
    assert one[scenario]['held_experts'] == [8] and two[scenario]['held_experts'] == [4]
    assert len(two[scenario]['losses']) == 3 * len(ADAPTERS) + len(ADAPTERS)  # steps, then the mixed pass
    assert_close(two[scenario]['losses'], one[scenario]['losses'])
    assert_close(two[scenario]['grad_norms'], one[scenario]['grad_norms'])
    grads = torch.load(two_dir / f'grads-{scenario}.pt')
    assert grads.keys() == torch.load(one_dir / f'grads-{scenario}.pt').keys()
    assert all(g.abs().sum() > 0 for g in grads.values())  # every adapter tensor, every expert's share, trained
    assert_tensors_close(grads, torch.load(one_dir / f'grads-{scenario}.pt'))


@pytest.mark.integration
@pytest.mark.parametrize('scenario', EXPERT_PARALLEL)
def test_the_adapters_saved_under_expert_parallel_are_one_process_s(runs, scenario):
    one, two, _, _ = runs
    for name in ADAPTERS:
        saved = load_file(str(Path(two[scenario]['checkpoints'][name]) / 'adapter_model.safetensors'))
        assert any('experts' in key for key in saved)
        expected = load_file(str(Path(one[scenario]['checkpoints'][name]) / 'adapter_model.safetensors'))
        assert_tensors_close(saved, expected, WEIGHT_TOLERANCE)
        trained = [float(w.abs().max()) for key, w in expected.items() if 'lora_B' in key]  # zero before training
        assert trained and max(trained) > 10 * WEIGHT_TOLERANCE


@pytest.mark.integration
def test_the_router_loss_under_expert_parallel_is_data_parallel_s(runs):
    """The load-balancing loss is each rank's own under data parallel; splitting the experts does
    not change it."""
    two = runs[1]
    assert two['ep-aux']['losses'] != two['ep']['losses']  # the loss is there
    assert_close(two['ep-aux']['losses'], two['dp-aux']['losses'])
    assert_close(two['ep-aux']['grad_norms'], two['dp-aux']['grad_norms'])


@pytest.mark.integration
def test_expert_parallel_refuses_what_it_cannot_do(runs):
    refusals = runs[1]['refusals']
    assert 'trains LoRA adapters, not every weight' in refusals['full']
    assert 'merged expert weights need every expert' in refusals['merged']
    assert 'has no fused experts' in refusals['dense']


def test_ep_size_must_divide_the_experts():
    accepted = r'accepted: \[1, 2, 4, 8\]'
    with pytest.raises(ConfigurationError, match=rf'ep_size=3 must divide the model.s 8 experts; {accepted}'):
        ExpertShard(num_experts=8, ep_size=3, ep_rank=0)
