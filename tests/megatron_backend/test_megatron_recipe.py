"""``cookbook/sft_megatron.py``, the seeds' SFT loop on ``MegatronModel``, run as its users run it.

The recipe runs in real processes: one process (TP=1), ``torch.distributed.run`` with two ranks at
TP=2 and at PP=2 (gloo), and ``--mode ray`` with a model group of two Ray workers at TP=2 (a
private local Ray started by the recipe). Every layout trains the same global batches from the same
weights, so each step's loss is one process's up to float rounding (1e-5); on the tiny model the
loss falls within the few steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip('megatron.core')

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from server_helpers import free_port  # noqa: E402

RECIPE = HERE.parent.parent / 'cookbook' / 'sft_megatron.py'
SAME = 1e-5
STEPS, BATCH = 5, 4
#: Each run's recipe flags and how many processes torchrun starts (0: the recipe alone, no torchrun).
RUNS: dict[str, tuple[list[str], int]] = {
    'tp1': ([], 0),
    'tp2': (['--tp', '2'], 2),
    'pp2': (['--pp', '2'], 2),
    'ray_tp2': (['--mode', 'ray', '--tp', '2'], 0),
}


def start(name: str, root: Path) -> subprocess.Popen[bytes]:
    flags, processes = RUNS[name]
    command = [sys.executable]
    if processes:
        command += ['-m', 'torch.distributed.run', f'--nproc_per_node={processes}', f'--master_port={free_port()}']
    command += [str(RECIPE), *flags, '--steps', str(STEPS), '--batch-size', str(BATCH)]
    command += ['--output-dir', str(root / name), '--losses', str(root / f'{name}.json')]
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'HF_DATASETS_DISABLE_PROGRESS_BARS': '1'}
    env.pop('RAY_ADDRESS', None)  # the recipe's own local Ray, never a cluster of this machine
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.fixture(scope='module')
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each run's losses and evaluation; two runs at a time (the machine's 2 cores)."""
    root = tmp_path_factory.mktemp('sft-megatron')
    results = {}
    for pair in (('tp1', 'tp2'), ('pp2', 'ray_tp2')):
        processes = {name: start(name, root) for name in pair}
        for name, process in processes.items():
            try:
                output, _ = process.communicate(timeout=600)
            finally:
                if process.poll() is None:
                    process.kill()
            assert process.returncode == 0, f'{name}:\n{output.decode(errors="replace")[-4000:]}'
            results[name] = json.loads((root / f'{name}.json').read_text())
            assert (root / name / 'last-checkpoint' / 'adapter_model.safetensors').is_file(), name
    return results


def assert_same_losses(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        assert abs(g - w) <= SAME * max(1.0, abs(w)), (step, g, w)


def test_the_loss_falls_on_the_tiny_model(runs):
    one = runs['tp1']
    # A random-weight model starts near ln(vocab); five AdamW steps at 5e-3 take off more than a nat.
    assert one['losses'][-1] < one['losses'][0] - 1.0, one['losses']
    assert one['eval_after'] < one['eval_before'] - 1.0, one


@pytest.mark.parametrize('layout', ['tp2', 'pp2'])
def test_tp2_and_pp2_under_torchrun_give_the_one_process_losses(runs, layout):
    assert_same_losses(runs[layout]['losses'], runs['tp1']['losses'])
    for key in ('eval_before', 'eval_after'):
        assert abs(runs[layout][key] - runs['tp1'][key]) <= SAME * max(1.0, abs(runs['tp1'][key])), key


def test_a_two_rank_ray_model_group_at_tp2_gives_the_one_process_losses(runs):
    assert_same_losses(runs['ray_tp2']['losses'], runs['tp1']['losses'])
    assert abs(runs['ray_tp2']['eval_after'] - runs['tp1']['eval_after']) <= SAME * max(1.0, runs['tp1']['eval_after'])
