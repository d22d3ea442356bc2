"""tinker-cookbook's multi-turn ``guess_number`` recipe, unmodified, trains against a twinkle
server: its own rollouts (10 turns an episode, through the Tinker SDK's sampling client), its own
training step, and its own measure of how far the trainer's log-probabilities are from the
sampler's. Only the environment variables point it at the server; the model is the tiny one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import background_server

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

pytest.importorskip('chz')  # installed beside tinker-cookbook by `make setup`, with the few others it imports


def test_tinker_cookbooks_guess_number_recipe_trains_against_the_server(tmp_path: Path, tiny_model_dir: str) -> None:
    recipe = 'tinker_cookbook.recipes.multiplayer_rl.guess_number.train'
    settings = [f'model_name={tiny_model_dir}', 'renderer_name=qwen3', 'max_steps=1', 'batch_size=2']
    settings += ['group_size=2', 'max_tokens=4', 'eval_every=0', 'save_every=0', 'behavior_if_log_dir_exists=delete']
    with background_server(tmp_path / 'server', tiny_model_dir, tenants=('cookbook',)) as (url, keys, _):
        environment = {**os.environ, 'TINKER_BASE_URL': url, 'TINKER_API_KEY': keys['cookbook']}
        result = subprocess.run(
            [sys.executable, '-m', recipe, *settings, f'log_path={tmp_path / "run"}'],
            env=environment,
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    records = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
    [step] = [record for record in records if 'optim/kl_sample_train_v1' in record]
    # 2 games of 2 players each, every episode the recipe's 10 turns; the trainer scores the sampler's tokens.
    assert step['env/all/total_episodes'] == 4 and step['env/all/turns_per_episode'] == 10
    assert abs(step['optim/kl_sample_train_v1']) < 1e-4
