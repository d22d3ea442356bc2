"""Samplers: generate completions, with the logprobs RL needs, from a base model or an adapter."""

from twinkle.infra.ray import remote_class
from twinkle.sampler.base import SAMPLERS, Sampler
from twinkle.sampler.torch_sampler import TorchSampler
from twinkle.sampler.vllm_sampler import vLLMSampler

# In ray mode, TorchSampler(..., remote_group='sampler'): each rank samples its share of the prompts.
remote_class(TorchSampler, {'sample': ('slice_dp', 'flatten')})
# vLLMSampler(..., device_mesh=mesh, remote_group='sampler'): one engine per data-parallel rank.
remote_class(vLLMSampler, {'sample': ('slice_dp', 'flatten')})

__all__ = ['SAMPLERS', 'Sampler', 'TorchSampler', 'vLLMSampler']
