"""The advantage interface: one float per sampled completion, from its reward and its group's.

Rewards arrive flat, ``[N]`` with ``N = P * G``: ``P`` prompts, ``G = num_generations`` samples
each, and the groups are CONTIGUOUS: ``rewards[i*G:(i+1)*G]`` are the samples of prompt ``i``.
That is the order a sampler returns with ``SamplingParams(num_samples=G)`` (the sequences of one
``SampleResponse`` in a row), or the order of a batch that repeats each prompt ``G`` times in a
row. Interleaved orders (``p0, p1, p0, p1``) give wrong baselines without any error.

A subclass only centres a ``[P, G]`` matrix of rewards (``center``); the base class validates
the input, then applies the shared ``scale``:

- ``'group'``: divide by the standard deviation of the rewards of the sample's own group;
- ``'batch'``: divide by the standard deviation of all ``N`` rewards: group mean, batch std, as
  recommended by Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
  arXiv:2508.08221;
- ``'none'``: no division, as in Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like
  Training", arXiv:2503.20783), which drops the std to remove its question-difficulty bias.

Standard deviations are unbiased (``torch.std``'s default, divisor ``n - 1``) and ``EPS = 1e-8``
is added to them before dividing. A group whose rewards are all equal carries no signal: its
advantages are exactly 0, never NaN and never ``tiny / (tiny + EPS)`` (in float32, seven rewards
of 0.7 have a mean that differs from 0.7 by one ulp, which the naive formula turns into 0.8).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from twinkle.errors import ConfigurationError, DataError, one_of
from twinkle.registry import Registry

Scale = Literal['group', 'batch', 'none']
SCALES: tuple[str, ...] = ('group', 'batch', 'none')
#: Added to every standard deviation before dividing by it.
EPS = 1e-8

Rewards = Sequence[float] | np.ndarray | torch.Tensor


class Advantage:
    """Turns rewards into advantages; see the module docstring for the layout and ``scale``.

    >>> from twinkle.advantage import GRPOAdvantage
    >>> GRPOAdvantage()([0.0, 1.0, 1.0, 1.0], num_generations=2, scale='none').tolist()
    [-0.5, 0.5, 0.0, 0.0]
    """

    #: The smallest ``num_generations`` the method is defined for.
    min_generations = 1

    def __call__(self, rewards: Rewards, num_generations: int = 1, scale: Scale = 'group') -> torch.Tensor:
        """Advantages ``[N]`` (float32, on the device of a tensor ``rewards``) for rewards ``[N]``."""
        self._check_config(num_generations, scale)
        rewards_N = _as_rewards(rewards)
        if rewards_N.numel() % num_generations:
            raise DataError(
                f'got {rewards_N.numel()} rewards, not a multiple of num_generations={num_generations}; '
                f'each prompt needs exactly num_generations samples, in contiguous groups'
            )
        rewards_P_G = self.groups(rewards_N, num_generations)
        advantages_P_G = self.center(rewards_P_G)
        if scale == 'group':
            advantages_P_G = advantages_P_G / (_std(rewards_P_G, dim=1) + EPS)
        elif scale == 'batch':
            advantages_P_G = advantages_P_G / (_std(rewards_N, dim=0) + EPS)
        constant_P_1 = (rewards_P_G == rewards_P_G[:, :1]).all(dim=1, keepdim=True)
        advantages_P_G = advantages_P_G.masked_fill(constant_P_1, 0.0)
        return advantages_P_G.reshape(-1).to(torch.float32)

    def groups(self, rewards_N: torch.Tensor, num_generations: int) -> torch.Tensor:
        """The rewards ``[N]`` as ``[P, G]``, one row per prompt."""
        return rewards_N.reshape(-1, num_generations)

    def center(self, rewards_P_G: torch.Tensor) -> torch.Tensor:
        """Rewards ``[P, G]`` minus their baseline, before any ``scale``."""
        raise NotImplementedError

    def _check_config(self, num_generations: object, scale: object) -> None:
        if scale not in SCALES:
            raise one_of('advantage scale', scale, SCALES)
        if not isinstance(num_generations, int) or isinstance(num_generations, bool) or num_generations <= 0:
            raise ConfigurationError(f'num_generations must be a positive integer; got {num_generations!r}')
        if num_generations < self.min_generations:
            raise ConfigurationError(
                f'{type(self).__name__} needs num_generations >= {self.min_generations}; got {num_generations}'
            )


def _as_rewards(rewards: Rewards) -> torch.Tensor:
    """``rewards`` as a float64 vector (float64 so that centring a group loses no precision)."""
    if isinstance(rewards, torch.Tensor):
        rewards_N = rewards.detach()
    else:
        try:
            rewards_N = torch.as_tensor(np.asarray(rewards, dtype=np.float64))
        except (TypeError, ValueError) as err:
            raise DataError(f'rewards must be numbers (a list, numpy array or 1-D tensor); {err}') from None
    if rewards_N.dim() != 1:
        raise DataError(f'rewards must be 1-D, one per sample; got shape {tuple(rewards_N.shape)}')
    if rewards_N.numel() == 0:
        raise DataError('rewards is empty; there is nothing to compute advantages for')
    if rewards_N.is_complex():
        raise DataError(f'rewards must be real numbers; got dtype {rewards_N.dtype}')
    rewards_N = rewards_N.to(torch.float64)
    finite_N = torch.isfinite(rewards_N)
    if not bool(finite_N.all()):
        index = int((~finite_N).nonzero()[0, 0])
        value = float(rewards_N[index])
        raise DataError(f'reward at index {index} is {value}; rewards must be finite numbers')
    return rewards_N


def _std(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased standard deviation along ``dim`` (kept), defined as 0 for a single value."""
    count = values.shape[dim]
    centered = values - values.mean(dim=dim, keepdim=True)
    return (centered.square().sum(dim=dim, keepdim=True) / max(count - 1, 1)).sqrt()


ADVANTAGES: Registry[Advantage] = Registry('advantage')
