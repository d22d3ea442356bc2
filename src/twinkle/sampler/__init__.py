"""Samplers: generate completions, with the logprobs RL needs, from a base model or an adapter."""

from twinkle.sampler.base import SAMPLERS, Sampler
from twinkle.sampler.torch_sampler import TorchSampler

__all__ = ['SAMPLERS', 'Sampler', 'TorchSampler']
