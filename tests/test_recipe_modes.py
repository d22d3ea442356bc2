"""``twinkle.recipe``: what a recipe gets from its mode, and the letter-words task the recipes share.

How the mode is started is checked with a stand-in ``twinkle.initialize`` (the layer below), so no
Ray or torchrun starts here; the parts themselves are real: the tiny model and its sampler in this
process, and the native client's against a server on a thread of this process. The docstring
examples run in tests/test_doctests.py; the recipes run in every mode in tests/rl/test_async_rl.py,
tests/agent/test_agent_runtimes.py and tests/cookbook/test_cookbook_modes.py.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from peft import LoraConfig

import twinkle.recipe
from twinkle import DeviceGroup, DeviceMesh
from twinkle.data_format import SamplingParams
from twinkle.errors import ConfigurationError
from twinkle.recipe import ModeSettings, Synced, add_config_arguments, start_parts, start_runtime
from twinkle.reward import REWARDS, LetterWordsReward
from twinkle.reward.letter_words import letter_words_prompt

LORA = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear')


def test_settings_name_the_bad_value() -> None:
    with pytest.raises(ConfigurationError, match=r"Invalid mode 'http'.*\['local', 'ray', 'server'\]"):
        ModeSettings(mode='http')  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match='got 0 and 1'):
        ModeSettings(model_ranks=0)
    with pytest.raises(ConfigurationError, match='start_parts'), start_runtime(ModeSettings(mode='server')):
        pass


# ---- how each mode starts, with a stand-in twinkle.initialize ------------------------------------
@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """What the helper asked of the layers below: initialize's calls, Ray's start and stop."""
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr('twinkle.launch.initialize', lambda **kwargs: calls.append(('initialize', kwargs)))
    monkeypatch.setattr('twinkle.infra.ray.cluster.start_local', lambda cpus: calls.append(('start_local', cpus)))
    monkeypatch.setattr(twinkle.recipe, '_stop_ray', lambda: calls.append(('stop_ray', None)))
    monkeypatch.delenv('RAY_ADDRESS', raising=False)
    return calls


def _layout(ranks: int, device_type: str) -> DeviceMesh:
    return DeviceMesh.from_sizes(fsdp_size=ranks, device_type=device_type)


def test_torchrun_gives_each_process_the_mesh_over_its_world(started, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr('twinkle.infra.distributed.world_size', lambda: 2)
    with start_runtime(ModeSettings(seed=3, device='cpu'), mesh=_layout) as mesh:
        assert mesh == _layout(2, 'cpu')
    assert started == [('initialize', {'mode': 'local', 'global_device_mesh': mesh, 'seed': 3})]


def test_one_process_has_no_mesh(started) -> None:
    with start_runtime(ModeSettings(device='cpu'), mesh=_layout) as mesh:
        assert mesh is None
    assert started == [('initialize', {'mode': 'local', 'global_device_mesh': None, 'seed': 0})]


def test_ray_groups_a_private_ray_with_a_cpu_per_rank_and_stops_it(started) -> None:
    """2 model ranks and 1 sampler rank on CPUs: a local Ray of 3 logical CPUs, the two groups, the
    mesh over the model's 2 ranks; Ray stops when the block ends, by an error too."""
    settings = ModeSettings(mode='ray', seed=1, model_ranks=2, sampler_ranks=1, device='cpu')
    with pytest.raises(KeyError), start_runtime(settings, mesh=_layout) as mesh:
        assert mesh == _layout(2, 'cpu')
        raise KeyError('the loop failed')
    groups = [DeviceGroup('model', 2, 'cpu'), DeviceGroup('sampler', 1, 'cpu')]
    assert started == [
        ('start_local', 3),
        ('initialize', {'mode': 'ray', 'groups': groups, 'seed': 1}),
        ('stop_ray', None),
    ]


def test_ray_joins_the_cluster_ray_address_names(started, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('RAY_ADDRESS', 'ray://head:10001')
    with start_runtime(ModeSettings(mode='ray', sampler_ranks=0, device='cpu')) as mesh:
        assert mesh is None  # one model rank: no mesh
    assert started == [
        ('initialize', {'mode': 'ray', 'groups': [DeviceGroup('model', 1, 'cpu')], 'seed': 0}),
        ('stop_ray', None),
    ]


def test_start_parts_on_ray_needs_a_sampler_group() -> None:
    no_sampler = ModeSettings(mode='ray', sampler_ranks=0)
    with pytest.raises(ConfigurationError, match='sampler_ranks must be at least 1'), start_parts(no_sampler, 'unused'):
        pass


# ---- the parts themselves ----------------------------------------------------------------------
def test_local_parts_sync_and_stage_the_adapter(tiny_model_dir: str) -> None:
    """Each sync or stage is the next weight version: the sampler samples version 1 after the first
    sync; a staged copy (2) reaches it only when applied."""
    with start_parts(ModeSettings(device='cpu'), tiny_model_dir) as parts:
        assert parts.mode == 'local'
        parts.model.add_adapter_to_model('default', LORA)
        synced = parts.sync_weights()
        assert (synced.version, parts.sampler.weight_version) == (1, 1) and synced.seconds > 0
        version, apply = parts.stage_weights()
        assert version == 2 and parts.sampler.weight_version == 1
        apply()
        response = parts.sampler.sample([{'input_ids': [1, 2, 3]}], SamplingParams(max_tokens=2, seed=0))[0]
        assert response.sequences[0].weight_version == 2


@pytest.mark.integration  # a server on a thread of this process
def test_a_server_started_for_the_block_serves_one_run(tiny_model_dir: str) -> None:
    """Without a sampler group the server samples the trainer's current weights: a sync or a stage
    only counts a version (0, 1, 2) and loads nothing. The server stops with the block."""
    with start_parts(ModeSettings(mode='server'), tiny_model_dir) as parts:
        assert parts.mode == 'server' and type(parts.model).__module__ == 'twinkle_client.model'
        url = parts.model.client.base_url
        parts.model.add_adapter_to_model('default', LORA)
        assert parts.stage_weights() == (0, None)
        assert parts.stage_weights() == (1, None)
        assert parts.sync_weights() == Synced(2, 0.0)
        response = parts.sampler.sample([{'input_ids': [1, 2, 3]}], SamplingParams(max_tokens=2, seed=0))[0]
        assert len(response.sequences[0].tokens) == 2
    with pytest.raises(httpx.TransportError):
        httpx.get(f'{url}/healthz', timeout=5)


# ---- a recipe's config as its command line -------------------------------------------------------
@dataclass
class _Config:
    steps: int = 3
    lr: float = 0.5
    sync: bool = True
    mode: str = 'local'


def test_config_flags_take_the_fields_types_and_booleans_both_ways() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, _Config(), choices={'mode': ('local', 'ray')})
    assert _Config(**vars(parser.parse_args([]))) == _Config()
    assert _Config(**vars(parser.parse_args(['--steps', '7', '--lr', '1e-3', '--no-sync']))) == _Config(7, 1e-3, False)
    with pytest.raises(SystemExit):
        parser.parse_args(['--mode', 'server'])


# ---- the letter-words task -----------------------------------------------------------------------
def _answered(letter: str, completion: str, pairs: bool = False) -> dict[str, Any]:
    row = letter_words_prompt(letter)
    if pairs:  # twinkle-kit's wire form of user_data
        row['user_data'] = [[key, value] for key, value in row['user_data'].items()]
    return {**row, 'messages': [*row['messages'], {'role': 'assistant', 'content': completion}]}


def test_letter_words_reward_counts_words_that_start_with_the_letter_capped_at_one() -> None:
    reward = REWARDS.get('LetterWordsReward')(target_words=4)
    assert isinstance(reward, LetterWordsReward)
    rows = [
        _answered('s', 'sun Sea moon'),  # 2 of 4 words asked for: 0.5
        _answered('c', 'cat cow car cup can', pairs=True),  # 5 of 4: capped at 1
        _answered('s', ''),  # no words: 0
        _answered('p', 'apple pear'),  # only a word's first letter counts: 1 of 4
    ]
    assert reward(rows) == [0.5, 1.0, 0.0, 0.25]
