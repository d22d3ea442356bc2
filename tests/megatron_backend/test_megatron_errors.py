"""``MegatronModel``'s refusals: each names the bad value and what would fit, before any training."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip('megatron.core')

from peft import LoraConfig

from twinkle import DeviceMesh, assets
from twinkle.errors import ConfigurationError
from twinkle.model.megatron import MegatronModel


@pytest.fixture(scope='module')
def model() -> MegatronModel:
    return MegatronModel(model_id=assets.tiny_model('tiny-qwen3'))


def test_bf16_autocast_is_refused_off_cuda():
    if torch.cuda.is_available():
        pytest.skip('bf16 autocast runs on CUDA')
    with pytest.raises(ConfigurationError, match=r"mixed_precision='bf16' on CUDA only .* use mixed_precision='no'"):
        MegatronModel(model_id=assets.tiny_model('tiny-qwen3'), mixed_precision='bf16')


def test_meshes_megatron_has_no_dimension_for_are_refused():
    with pytest.raises(ConfigurationError, match=r'no FSDP dimension \(fsdp_size=2\); use dp_size=2'):
        MegatronModel(model_id=assets.tiny_model('tiny-qwen3'), device_mesh=DeviceMesh.from_sizes(fsdp_size=2))
    with pytest.raises(ConfigurationError, match=r'ulysses_size=2.*use cp_size'):
        mesh = DeviceMesh.from_sizes(dp_size=2, ulysses_size=2)
        MegatronModel(model_id=assets.tiny_model('tiny-qwen3'), device_mesh=mesh)


def test_a_value_head_and_a_missing_model_are_refused(model):
    with pytest.raises(ConfigurationError, match='no value heads yet'):
        model.add_adapter_to_model('critic', LoraConfig(r=4, target_modules='all-linear'), value_head=True)
    with pytest.raises(ConfigurationError, match=r'needs model_id= \(a checkpoint\) or config='):
        MegatronModel()


def test_unknown_lora_targets_are_refused_with_the_accepted_names(model):
    with pytest.raises(ConfigurationError, match=r"'linear_qkv'.*\['q_proj', 'k_proj', 'v_proj', 'o_proj'"):
        model.add_adapter_to_model('bad', LoraConfig(r=4, target_modules=['linear_qkv']))
    assert model.adapter_names == []


def test_a_mesh_larger_than_the_processes_is_refused():
    with pytest.raises(ConfigurationError, match=r'spans 2 processes but (1 run this script|the process group has 1)'):
        MegatronModel(model_id=assets.tiny_model('tiny-qwen3'), device_mesh=DeviceMesh.from_sizes(tp_size=2))
