"""The rollout engine on a real vLLM engine (vLLM's CPU build, ``make test-vllm``): a multi-turn
episode is the engine's own token ids, and the trainer's float32 log-probabilities of the model's
tokens are the engine's to 1e-4 (vLLM's kernels sum in another order than torch's). Prefix
caching is on, as in production: later turns read the earlier turns' cached prefix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from twinkle.agent import RolloutEngine
from twinkle.data_format import SamplingParams
from twinkle.model import TransformersModel
from twinkle.sampler import vLLMSampler
from twinkle.template import Template

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/agent_envs.py
from agent_envs import Countdown

pytest.importorskip('vllm')
ENGINE = {'dtype': 'float32', 'max_model_len': 1024, 'enable_prefix_caching': True}


@pytest.fixture(scope='module')
def sampler(tiny_model_dir: str):
    sampler = vLLMSampler(tiny_model_dir, engine_args=ENGINE)
    yield sampler
    sampler.close()


def test_a_multi_turn_episode_on_vllm_is_the_trainers_to_1e_4(sampler, tiny_model_dir):
    template = Template(tiny_model_dir)
    engine = RolloutEngine(sampler, template, SamplingParams(max_tokens=6), max_turns=6)
    episodes = engine.rollout([Countdown(turns=5) for _ in range(4)])
    assert [episode.end for episode in episodes] == ['done'] * 4
    assert engine.stats.sampler_calls == 5  # the 4 episodes share each turn's call
    trainer = TransformersModel(tiny_model_dir, device='cpu')
    features = [episode.to_feature() for episode in episodes]
    logps = trainer.forward_only(inputs=features).logps
    for row, (episode, feature) in enumerate(zip(episodes, features, strict=True)):
        assert len(episode.turns) == 5
        trained = logps[row, : len(feature['labels'])][torch.tensor(feature['completion_mask']).bool()]
        assert torch.allclose(trained, torch.tensor(episode.old_logps), atol=1e-4, rtol=0)
