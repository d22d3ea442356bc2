"""``vLLMSampler`` on a Ray device group: ``device_mesh.dp_size`` engines, one per actor, each
sampling its share of the prompts, the results gathered in order; synced from a trainer on a
group of its own by ``CheckpointEngineManager``, as seeds 002 and 003 place them."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from peft import LoraConfig

import twinkle
from twinkle import DeviceGroup, DeviceMesh
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.infra.ray.cluster import LOCAL_SYSTEM_CONFIG
from twinkle.model import TransformersModel
from twinkle.sampler import vLLMSampler

pytest.importorskip('vllm')
ray = pytest.importorskip('ray')

ENGINE = {'dtype': 'float32', 'max_model_len': 512}
PROMPTS = [{'input_ids': [5 + i, 6 + 2 * i, 7, 8 + i, 30 + 3 * i]} for i in range(6)]


@pytest.fixture(scope='module', autouse=True)
def local_ray():
    """A Ray of 3 logical CPUs: one for the model's actor, one for each sampler actor."""
    ray.init(
        address='local', num_cpus=3, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_SYSTEM_CONFIG
    )
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    twinkle.initialize(mode='local', seed=None)
    ray.shutdown()


def actor_pid(sampler: vLLMSampler) -> int:
    return os.getpid()


def completion_logps(model, features: list[dict]) -> list[list[float]]:
    logps = model.forward_only(inputs=features).logps
    return [
        logps[i, : len(f['labels'])][torch.tensor(f['completion_mask']).bool()].tolist() for i, f in enumerate(features)
    ]


def test_two_engines_split_the_prompts_and_keep_their_order_after_syncs(tiny_model_dir):
    groups = [DeviceGroup('model', 1, 'cpu'), DeviceGroup('sampler', 2, 'cpu')]
    twinkle.initialize(mode='ray', groups=groups, lazy_collect=False, seed=0)
    model = TransformersModel(model_id=tiny_model_dir, remote_group='model')
    model.add_adapter_to_model(
        'default', LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)
    )
    model.set_optimizer('AdamW', lr=1e-2)
    mesh = DeviceMesh.from_sizes(world_size=2, dp_size=2, device_type='cpu')
    sampler = vLLMSampler(tiny_model_dir, engine_args=ENGINE, device_mesh=mesh, remote_group='sampler')
    pids = sampler.remote_execute(actor_pid, collect='list')
    assert len(set(pids)) == 2  # two actors, each with an engine of its own

    manager = CheckpointEngineManager(model=model, sampler=sampler)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for version in (1, 2):
        assert manager.sync_weights(merge_and_sync=True).weight_version == version
        responses = sampler.sample(PROMPTS, greedy)  # 3 prompts to each engine, gathered in order
        assert [r.prompt_token_ids for r in responses] == [p['input_ids'] for p in PROMPTS]
        seqs = [r.sequences[0] for r in responses]
        assert {s.weight_version for s in seqs} == {version}
        features = [s.new_input_feature for s in seqs]
        for seq, logps in zip(seqs, completion_logps(model, features), strict=True):
            assert seq.token_logprobs == pytest.approx(logps, abs=1e-4)
        model.forward_backward(inputs=features)
        model.clip_grad_and_step()
    # Both engines hold the same weights: a prompt sampled on either gives the same sequence.
    twice = sampler.sample([PROMPTS[0], PROMPTS[0]], greedy)
    assert twice[0].sequences[0].tokens == twice[1].sequences[0].tokens
