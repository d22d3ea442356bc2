"""The cookbook recipes run as users run them (a subprocess), so they cannot rot unnoticed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, *args: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / 'cookbook' / script), *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def test_sft_recipe_lowers_the_held_out_loss_and_saves_an_adapter(tmp_path, tiny_model_dir):
    flags = ('--report-to', 'tensorboard', 'wandb', 'jsonl', '--log-dir', 'logs')
    log = run('sft_self_cognition.py', '--samples', '64', '--epochs', '2', '--output-dir', 'out', *flags, cwd=tmp_path)
    before = float(re.search(r"eval before training: \{'loss': ([\d.]+)", log).group(1))
    after = float(re.search(r"eval after training: \{'loss': ([\d.]+)", log).group(1))
    assert after < before - 1.0, log[-2000:]
    assert (tmp_path / 'out' / 'last-checkpoint' / 'adapter_model.safetensors').is_file()
    # --report-to: 16 steps, metrics every 5, and the held-out loss before and after, in each sink.
    lines = [json.loads(line) for line in (tmp_path / 'logs' / 'metrics.jsonl').read_text().splitlines()]
    assert [(line['step'], 'eval/loss' in line, 'train/loss' in line) for line in lines] == [
        (0, True, False),
        (5, False, True),
        (10, False, True),
        (15, False, True),
        (16, True, False),
    ]
    assert lines[-1]['eval/loss'] == pytest.approx(after, abs=1e-4)
    assert list((tmp_path / 'logs' / 'tensorboard').glob('events.out.tfevents.*'))
    assert list((tmp_path / 'logs' / 'wandb').glob('offline-run-*/run-*.wandb'))


def test_single_device_recipe_trains_the_full_model(tmp_path, tiny_model_dir):
    log = run('single_device.py', cwd=tmp_path)
    losses = [float(x) for x in re.findall(r'loss ([\d.]+)', log)]
    assert len(losses) == 16 and losses[-1] < losses[0] - 1.0, losses


def test_kto_recipe_raises_the_held_out_reward_margin(tmp_path, tiny_model_dir):
    flags = ('--samples', '32', '--epochs', '2', '--report-to', 'jsonl', '--log-dir', 'logs')
    log = run('kto_self_cognition.py', *flags, cwd=tmp_path)
    before = float(re.search(r'eval before training: margin (-?[\d.]+)', log).group(1))
    after = float(re.search(r'eval after training: margin (-?[\d.]+)', log).group(1))
    steps = [float(m) for m in re.findall(r'step +\d+ loss [\d.]+ margin (-?[\d.]+) z0 [\d.]+', log)]
    # The policy starts as the reference (LoRA B = 0): margin 0; 32 examples, 8 a step, 2 epochs: 8 steps.
    assert before == pytest.approx(0.0, abs=1e-3) and after > 1.0, log[-2000:]
    assert len(steps) == 8 and steps[-1] > steps[0] + 1.0, steps
    lines = [json.loads(line) for line in (tmp_path / 'logs' / 'metrics.jsonl').read_text().splitlines()]
    assert 'eval/margin' in lines[0] and 'train/kl' in lines[1]


@pytest.mark.timeout(1200)  # three runs of the recipe: beside two CPU-bound processes they took over 400 s
def test_grpo_recipe_reward_rises_over_three_seeds(tmp_path, tiny_model_dir):
    gains = []
    # Fewer than the recipe's 80 steps: seed 0's reward is past 0.8 by steps 41-50, seeds 1 and 2's by steps 31-40
    # (docs/rl.md's table, which benchmarks/grpo_reward_curve.py keeps); the 80 steps' plateau is the benchmark's.
    for seed, steps in ((0, 50), (1, 40), (2, 40)):
        output = tmp_path / f'seed{seed}.json'
        logs = tmp_path / f'logs{seed}'
        flags = ['--seed', str(seed), '--steps', str(steps), '--output', str(output), '--log-dir', str(logs)]
        log = run('grpo_letter_words.py', *flags, cwd=tmp_path)
        assert re.search(r'step\s+1\s+reward [\d.]+\s+kl [\d.]+\s+entropy [\d.]+\s+completion length', log), log[-2000:]
        rewards = [step['total_reward'] for step in json.loads(output.read_text())['history']]
        # The default sink: every step's record in metrics.jsonl.
        written = [json.loads(line) for line in (logs / 'metrics.jsonl').read_text().splitlines()]
        assert [line['train/total_reward'] for line in written] == pytest.approx(rewards)
        first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        gains.append((first, last))
    # The untrained policy writes about one word in eight that starts with the letter (reward
    # ~0.08); trained, it writes them in most places. Each seed must at least double its reward
    # and all three together must gain 0.3 on average.
    assert all(last > 2 * first and last > first + 0.1 for first, last in gains), gains
    assert sum(last - first for first, last in gains) / 3 > 0.3, gains


def test_ppo_recipe_with_a_critic_raises_the_reward(tmp_path, tiny_model_dir):
    output = tmp_path / 'ppo.json'
    # 30 of the recipe's 60 steps: by steps 21-30 the reward is up 0.8 and the value 0.58 (the checks ask 0.3).
    log = run('ppo_letter_words.py', '--steps', '30', '--output', str(output), cwd=tmp_path)
    assert re.search(r'step\s+1\s+reward [\d.]+\s+value error [\d.]+\s+value -?[\d.]+', log), log[-2000:]
    history = json.loads(output.read_text())['history']
    rewards, values = [step['reward'] for step in history], [step['value'] for step in history]
    # From about 0.1 (the untrained policy) to most words right, and the critic's values follow.
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.3, rewards
    assert sum(values[-10:]) / 10 > sum(values[:10]) / 10 + 0.3, values


def test_seed_gsm8k_grpo_recipe_runs_and_saves(tmp_path, tiny_model_dir):
    log = run('grpo_gsm8k.py', '--max-steps', '2', '--output-dir', 'out', '--report-to', 'tensorboard', cwd=tmp_path)
    assert 'Training completed. optim_steps=2' in log and 'total_reward' in log and 'clip_frac' in log, log[-2000:]
    assert (tmp_path / 'out' / 'grpo-gsm8k-checkpoint' / 'adapter_model.safetensors').is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / 'output' / 'grpo-gsm8k' / 'logs' / 'tensorboard'))
    events.Reload()
    # Two optimizer steps on the mini-batches of one sampling round: rewards at the first only.
    assert [s.step for s in events.Scalars('train/loss')] == [1, 2]
    assert [s.step for s in events.Scalars('train/total_reward')] == [1]
    assert {'train/clip_frac', 'train/lr', 'train/grad_norm'} <= set(events.Tags()['scalars'])


def test_two_tenant_server_recipe_trains_both(tmp_path, tiny_model_dir):
    log = run('server_two_tenants.py', '--steps', '6', cwd=tmp_path)
    losses = {name: re.search(rf'{name}: loss ([\d.]+) -> ([\d.]+)', log) for name in ('alice', 'bob')}
    assert all(losses.values()), log[-2000:]
    first, last = map(float, losses['alice'].groups())
    assert last < first - 1.0, log[-2000:]
    assert 'alice saved twinkle://' in log and 'bob saved twinkle://' in log
