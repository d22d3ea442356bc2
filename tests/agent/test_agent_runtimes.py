"""The rollout engine on every runtime: the agent recipe in one process, on Ray (the sampler a
worker of a group) and against a server (the native client's sampler); and the Tinker SDK's
sampling client, whose episodes carry the server's log-probabilities of the base model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from agent_envs import Countdown
from server_helpers import background_server

from twinkle.agent import Episode, RolloutEngine
from twinkle.data_format import SamplingParams
from twinkle.model import TransformersModel
from twinkle.template import Template

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RECIPE_ARGS = ('--steps', '2', '--warmup-steps', '1', '--games-per-step', '2', '--group-size', '2')


@pytest.mark.parametrize('mode', ['local', 'ray', 'server'])
def test_the_agent_recipe_trains_in_every_mode(mode: str, tmp_path: Path) -> None:
    environment = {**os.environ, 'HF_DATASETS_DISABLE_PROGRESS_BARS': '1', 'OMP_NUM_THREADS': '1'}
    environment.pop('RAY_ADDRESS', None)  # the recipe starts its own local Ray
    command = [sys.executable, str(ROOT / 'cookbook' / 'agent_guess_number.py'), *RECIPE_ARGS, '--mode', mode]
    result = subprocess.run(
        [*command, '--output', 'out.json'], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=400
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    history = json.loads((tmp_path / 'out.json').read_text())['history']
    assert [record['step'] for record in history] == [1, 2]
    for record in history:
        # 4 episodes of at most 3 turns of at most 6 tokens; a game's reward is at least 0 and at most
        # 1 for finding the number plus 0.5 for closeness (each of the 3 guesses at most 0.5 / 3).
        assert 4 <= record['model_tokens'] <= 4 * 3 * 6 and 1 <= record['turns_per_episode'] <= 3
        assert 0.0 <= record['reward'] <= 1.5 and math.isfinite(record['loss'])


@pytest.fixture(scope='module')
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str):
    with background_server(tmp_path_factory.mktemp('agent'), tiny_model_dir, tenants=('alice',)) as running:
        url, keys, _ = running
        yield url, keys['alice']


@pytest.fixture(scope='module')
def base_model(tiny_model_dir: str) -> TransformersModel:
    return TransformersModel(tiny_model_dir, device='cpu')


def assert_base_model_logprobs(episodes: list[Episode], model: TransformersModel) -> None:
    """Every episode's sampler log-probabilities are the local base model's, teacher-forced."""
    features = [episode.to_feature() for episode in episodes]
    logps = model.forward_only(inputs=features).logps
    for row, (episode, feature) in enumerate(zip(episodes, features, strict=True)):
        trained = logps[row, : len(feature['labels'])][torch.tensor(feature['completion_mask']).bool()]
        assert torch.allclose(trained, torch.tensor(episode.old_logps), atol=1e-4, rtol=0)


def test_a_rollout_on_tinker_sampling_clients(server, module_sdk_clients, tiny_model_dir, base_model):
    url, key = server
    sampling = module_sdk_clients(url, key).create_sampling_client(base_model=tiny_model_dir).result()
    engine = RolloutEngine(sampling, Template(tiny_model_dir), SamplingParams(max_tokens=5), max_turns=3)
    episodes = engine.rollout([Countdown(turns=3) for _ in range(3)])
    assert [episode.end for episode in episodes] == ['done'] * 3
    assert all(len(episode.turns) == 3 for episode in episodes)
    assert_base_model_logprobs(episodes, base_model)


def test_a_rollout_on_the_native_clients_sampler(server, tiny_model_dir, base_model):
    from twinkle_client import TwinkleClient
    from twinkle_client.model import MultiLoraTransformersModel
    from twinkle_client.sampler import TorchSampler as ClientSampler

    url, key = server
    model = MultiLoraTransformersModel(client=TwinkleClient(url, key))
    model.add_adapter_to_model('default', {'r': 4, 'target_modules': 'all-linear'})  # B = 0: the base model's output
    engine = RolloutEngine(
        ClientSampler(model=model), Template(tiny_model_dir), SamplingParams(max_tokens=5), max_turns=3
    )
    episodes = engine.rollout([Countdown(turns=2) for _ in range(3)])
    assert [episode.end for episode in episodes] == ['done'] * 3
    assert engine.stats.sampler_calls == 2  # the 3 episodes share each turn's call
    assert_base_model_logprobs(episodes, base_model)
