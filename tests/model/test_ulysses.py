"""Ulysses sequence parallel: two real processes (gloo, CPU) forming one Ulysses group, against
one process with the same batches.

``dist_ulysses.py`` runs its scenarios (tiny-qwen3 and tiny-qwen3.5, padded and packed rows,
data parallel and FSDP2, cross-entropy and GRPO with per-token loss inputs, a model with one
key/value head) once under ``torch.distributed.run --nproc_per_node=2`` with ``ulysses_size=2``
and once in this process; the module fixture runs both, and the tests compare what they wrote.
Rows are cut to odd lengths, so the sequence is padded to a multiple of the 2 ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_ulysses import SCENARIOS, main, small_config
from server_helpers import here_and_under_torchrun
from transformers import Qwen3MoeConfig

import twinkle
from twinkle import assets
from twinkle.errors import ConfigurationError
from twinkle.model.parallel.ulysses import check_model

SCRIPT = Path(__file__).with_name('dist_ulysses.py')
TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def local_again():
    yield
    twinkle.initialize(mode='local', seed=None)


@pytest.fixture(scope='module')
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """(one process's results, the Ulysses group's results)."""
    for name in {name for name, *_ in SCENARIOS.values() if name != 'config'}:
        assets.tiny_model(name)  # built once here, not by three processes at once
    one, two = tmp_path_factory.mktemp('one'), tmp_path_factory.mktemp('two')
    results = here_and_under_torchrun(SCRIPT, main, one, two)
    return results[0], results[1]


def assert_close(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert abs(got - want) <= TOLERANCE * max(1.0, abs(want)), (actual, expected)


@pytest.mark.integration
@pytest.mark.parametrize('scenario', list(SCENARIOS))
def test_ulysses_2_trains_as_one_process(runs: tuple[dict, dict], scenario: str) -> None:
    """Per-step losses and gradient norms (3 AdamW steps), the metrics and an evaluation loss."""
    one, two = runs[0][scenario], runs[1][scenario]
    assert 'sequences split over 2 ranks (Ulysses)' in two['parallel']
    assert_close(two['losses'], one['losses'])
    assert_close(two['grad_norms'], one['grad_norms'])
    assert_close([two['eval_loss']], [one['eval_loss']])
    assert sorted(two['metrics']) == sorted(one['metrics'])
    assert_close(
        [two['metrics'][k] for k in sorted(one['metrics'])], [one['metrics'][k] for k in sorted(one['metrics'])]
    )


@pytest.mark.integration
@pytest.mark.parametrize('scenario', list(SCENARIOS))
def test_outputs_hold_the_whole_sequence(runs: tuple[dict, dict], scenario: str) -> None:
    """``forward_only`` returns every position's logits and label logprobs on each rank, as one
    process does (the padding Ulysses adds is dropped)."""
    one, two = runs[0][scenario], runs[1][scenario]
    assert two['logits_shape'] == one['logits_shape']
    got, want = torch.tensor(two['logps']), torch.tensor(one['logps'])
    assert torch.allclose(got, want, rtol=TOLERANCE, atol=1e-4)


# One process runs each scenario without a mesh, so its 'qwen3.5-fsdp' is the plain run.
@pytest.mark.integration
@pytest.mark.parametrize(
    ('fused', 'unfused'), [('qwen3-grpo-packed-fused', 'qwen3-grpo-packed'), ('qwen3.5-dp-fused', 'qwen3.5-fsdp')]
)
def test_the_fused_output_layer_under_ulysses_gives_one_unfused_process_s_numbers(
    runs: tuple[dict, dict], fused: str, unfused: str
) -> None:
    """Each rank runs the fused output layer on its slice and the ranks gather label logprobs
    (not logits): the losses, gradient norms and metrics of one process without it."""
    one, two = runs[0][unfused], runs[1][fused]
    assert_close(two['losses'], one['losses'])
    assert_close(two['grad_norms'], one['grad_norms'])
    assert sorted(two['metrics']) == sorted(one['metrics'])
    assert_close(
        [two['metrics'][k] for k in sorted(one['metrics'])], [one['metrics'][k] for k in sorted(one['metrics'])]
    )


@pytest.mark.integration
def test_packed_rows_have_an_odd_width_so_ulysses_pads_them(runs: tuple[dict, dict]) -> None:
    widths = {name: result['logits_shape'][1] for name, result in runs[0].items() if name.endswith('packed')}
    assert widths and all(width % 2 == 1 for width in widths.values()), widths


@pytest.mark.integration
def test_packing_matters_so_the_packed_scenarios_test_the_block_diagonal_mask(runs: tuple[dict, dict]) -> None:
    """On tiny-qwen3 a packed batch gives the padded batch's losses (attention stays within each
    packed row), so the Ulysses group's packed losses, equal to one process's, are the padded ones:
    its whole-sequence mask keeps the packed rows apart."""
    one, two = runs
    assert_close(one['qwen3-fsdp-packed']['losses'], one['qwen3-dp']['losses'])
    assert_close(two['qwen3-fsdp-packed']['losses'], one['qwen3-dp']['losses'])


@pytest.mark.integration
def test_heads_that_do_not_divide_are_refused_naming_the_sizes(runs: tuple[dict, dict]) -> None:
    assert runs[1]['refusal'] == (
        'ulysses_size=2 must divide the attention heads (3) of qwen3: ulysses_size can be one of [3]'
    )


def test_check_model_names_what_fits() -> None:
    with pytest.raises(ConfigurationError, match=r'ulysses_size=4 must divide the attention heads \(6\).*\[2, 3, 6\]'):
        check_model(small_config(6, 2), 4, moe=False)
    check_model(small_config(4, 1), 4, moe=False)  # one key/value head: repeated, accepted
    moe = Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ConfigurationError, match='mixture of experts is not supported'):
        check_model(moe, 2, moe=True)
    sliding = small_config(4, 2)
    sliding.layer_types = ['sliding_attention', 'full_attention']
    with pytest.raises(ConfigurationError, match=r"kinds \['sliding_attention'\]"):
        check_model(sliding, 2, moe=False)
