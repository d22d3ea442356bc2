"""The "one script, every runtime" recipes, launched as users launch them: one process, torchrun
(2 processes, gloo) and Ray (a local Ray the script starts), with tiny settings.

``fsdp_self_cognition.py`` shards the model with FSDP2 under torchrun and on a Ray group of 2;
``grpo_every_mode.py`` trains data parallel with a sampler per process under torchrun, and with
the model (2 workers) and the sampler (1 worker) on two Ray groups. In each runtime the loss of
each step is that of one process running the same global batch, so the runs must agree.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import free_port

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# Losses of one process and of 2 ranks (gloo sums in another order) agree to float rounding.
TOLERANCE = 1e-4
FSDP_ARGS = ('--steps', '6', '--batch-size', '4')
GRPO_ARGS = ('--steps', '3', '--num-generations', '4')


def launch(script: str, runtime: str, *args: str, cwd: Path) -> str:
    """Run ``cookbook/script`` in ``runtime`` ('one', 'torchrun' or 'ray': ``--mode ray`` in ``args``,
    else ``TWINKLE_MODE=ray``); returns its log."""
    command = [sys.executable]
    if runtime == 'torchrun':
        command += ['-m', 'torch.distributed.run', '--nproc_per_node=2', f'--master_port={free_port()}']
    command += [str(ROOT / 'cookbook' / script), *args]
    environment = {**os.environ, 'HF_DATASETS_DISABLE_PROGRESS_BARS': '1'}
    environment.pop('RAY_ADDRESS', None)  # the script starts its own local Ray
    environment.pop('TWINKLE_MODE', None)
    if runtime == 'ray' and '--mode' not in args:
        environment['TWINKLE_MODE'] = 'ray'  # the other way to pick the mode
    if runtime != 'one':
        environment['OMP_NUM_THREADS'] = '1'  # two processes (or actors) share the two cores
    result = subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=300)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    return log


def assert_close(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected), (actual, expected)
    assert all(abs(a - e) <= TOLERANCE for a, e in zip(actual, expected, strict=True)), (actual, expected)


# ---- FSDP2 SFT ----------------------------------------------------------------------------------
def fsdp_losses(runtime: str, tmp_path: Path) -> list[float]:
    log = launch('fsdp_self_cognition.py', runtime, *FSDP_ARGS, '--losses', 'losses.json', cwd=tmp_path)
    losses = json.loads((tmp_path / 'losses.json').read_text())
    # The log shows every step's loss (rank 0's line only under torchrun), and the saved adapter.
    assert [float(x) for x in re.findall(r'step \d+/6 loss ([\d.]+)', log)] == pytest.approx(losses, abs=1e-6)
    assert (tmp_path / 'output' / 'fsdp-self-cognition' / 'last-checkpoint' / 'adapter_model.safetensors').is_file()
    # The default metric sink: rank 0 alone writes step 5's metrics (gathered over the ranks) and the eval.
    lines = (tmp_path / 'output' / 'fsdp-self-cognition' / 'logs' / 'metrics.jsonl').read_text().splitlines()
    assert [(line['step'], sorted(line)[0]) for line in map(json.loads, lines)] == [(5, 'step'), (6, 'eval/accuracy')]
    return losses


@pytest.fixture(scope='module')
def fsdp_one(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> list[float]:
    return fsdp_losses('one', tmp_path_factory.mktemp('fsdp-one'))


def test_fsdp_recipe_in_one_process_lowers_the_loss(fsdp_one):
    # 6 batches of 4, an optimizer step every 2: from the random model's ~9 nats per token down.
    assert len(fsdp_one) == 6 and all(math.isfinite(x) for x in fsdp_one)
    assert fsdp_one[-1] < fsdp_one[0] - 1.0, fsdp_one


def test_fsdp_recipe_under_torchrun_gives_the_losses_of_one_process(fsdp_one, tmp_path):
    # Each of the 2 ranks holds half of each weight and runs 2 rows of each batch of 4.
    assert_close(fsdp_losses('torchrun', tmp_path), fsdp_one)


def test_fsdp_recipe_in_ray_mode_gives_the_losses_of_one_process(fsdp_one, tmp_path):
    # Picked by TWINKLE_MODE=ray: a 'model' group of 2 actors, each holding half of each weight.
    assert_close(fsdp_losses('ray', tmp_path), fsdp_one)


# ---- GRPO with a separate sampler ---------------------------------------------------------------
def grpo_history(runtime: str, tmp_path: Path) -> list[dict[str, float]]:
    mode = ('--mode', 'ray') if runtime == 'ray' else ()
    log = launch('grpo_every_mode.py', runtime, *GRPO_ARGS, *mode, '--output', 'history.json', cwd=tmp_path)
    history = json.loads((tmp_path / 'history.json').read_text())['history']
    assert len(re.findall(r'step +\d+  reward [\d.]+  loss -?[\d.]+  kl', log)) == 3, log[-3000:]
    assert 'mean reward: first 3 steps' in log
    assert [r['step'] for r in history] == [1, 2, 3]
    assert all(math.isfinite(r['loss']) and 0.0 <= r['total_reward'] <= 1.0 for r in history), history
    # The default metric sink: rank 0 alone writes each step's record.
    lines = (tmp_path / 'output' / 'grpo-every-mode' / 'logs' / 'metrics.jsonl').read_text().splitlines()
    written = [json.loads(line) for line in lines]
    assert [(w['step'], w['train/total_reward']) for w in written] == [(r['step'], r['total_reward']) for r in history]
    return history


@pytest.fixture(scope='module')
def grpo_one(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> list[dict[str, float]]:
    return grpo_history('one', tmp_path_factory.mktemp('grpo-one'))


def test_grpo_recipe_in_one_process_logs_each_step(grpo_one):
    # The sampler had the trainer's weights (a sync before each sampling step), so the policy
    # ratio is 1 and the first step's loss is 0: the advantages of each group sum to 0, and
    # there is no KL yet to the base model the adapter starts equal to. Up to float32 rounding: the
    # sampler's logprobs come from a KV-cached decode, the trainer's from one forward (-6e-8 here on
    # an idle machine, 2.3e-6 seen once in a fresh clone).
    assert grpo_one[0]['loss'] == pytest.approx(0.0, abs=1e-5) and grpo_one[0]['kl'] == pytest.approx(0.0, abs=1e-5)
    assert grpo_one[-1]['kl'] > 0.0  # the adapter moved


@pytest.mark.parametrize('runtime', ['torchrun', 'ray'])
def test_grpo_recipe_in_every_runtime_gives_the_numbers_of_one_process(grpo_one, runtime, tmp_path):
    # torchrun: a sampler per process, each sampling its prompt; Ray: the sampler on its own
    # group. Sampling seeds follow the prompt and step only, so the samples, rewards and losses
    # are those of one process.
    history = grpo_history(runtime, tmp_path)
    # The same samples give the same rewards; their mean is merged over the ranks (summed in
    # another order), so it agrees to float rounding.
    assert [r['total_reward'] for r in history] == pytest.approx([r['total_reward'] for r in grpo_one], abs=1e-6)
    assert_close([r['loss'] for r in history], [r['loss'] for r in grpo_one])
    assert_close([r['kl'] for r in history], [r['kl'] for r in grpo_one])
