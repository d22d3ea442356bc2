"""REINFORCE++ advantages: critic-free, token-level, normalised over the whole batch.

REINFORCE++ (Hu et al. 2025, "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both
Prompt and Reward Models", arXiv:2501.03262) keeps PPO's tricks but drops the critic:

1. per-token rewards with the KL in the reward (``gae.token_rewards``): the sequence's score on
   its last token, ``-kl_coef * (logp - ref_logp)`` on every token;
2. the return of each token, ``G_t = sum_{s >= t} gamma^(s-t) r_s`` over the row's masked tokens
   (the advantage, with no baseline);
3. global normalisation: ``(G - mean) / (std + EPS)`` with the mean and the (population)
   standard deviation of ``G`` over every masked token of the batch, as the paper's reference
   implementation (OpenRLHF) whitens them. A batch, unlike a group, mixes prompts, so the
   normaliser is stable and no prompt gets its own scale.

REINFORCE++-baseline (the paper's variant for reasoning tasks with several samples per prompt)
first subtracts each group's mean score from its scores (groups contiguous, as in
``twinkle.advantage.base``), then does the same.

Inputs are ``[B, T]`` grids as in ``twinkle.advantage.per_token``; ``per_token.per_sequence`` turns the result
into the per-token ``advantages`` the losses take.
"""

from __future__ import annotations

import torch

from twinkle.advantage.base import EPS
from twinkle.advantage.per_token import Scores, as_mask, as_scores, check_unit, token_rewards
from twinkle.errors import ConfigurationError, DataError


def reinforce_pp(
    scores: Scores,
    mask: torch.Tensor,
    *,
    logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++ advantages ``[B, T]`` (float32, 0 outside ``mask``); see the module docstring.

    >>> reinforce_pp([1.0, 0.0], torch.tensor([[1, 1], [1, 1]])).tolist()  # returns 1, 1, 0, 0
    [[1.0, 1.0], [-1.0, -1.0]]
    """
    check_unit('gamma', gamma)
    mask_BT = as_mask(mask)
    rewards_BT = token_rewards(scores, mask_BT, logps=logps, ref_logps=ref_logps, kl_coef=kl_coef)
    return batch_normalize(discounted_returns(rewards_BT, mask_BT, gamma), mask_BT)


def reinforce_pp_baseline(
    scores: Scores,
    mask: torch.Tensor,
    num_generations: int,
    *,
    logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++-baseline: each score minus its group's mean score (``num_generations``
    contiguous rows per prompt), then ``reinforce_pp``.

    >>> reinforce_pp_baseline([1.0, 0.0, 2.0, 2.0], torch.ones(4, 1), num_generations=2).tolist()
    [[1.4142135381698608], [-1.4142135381698608], [0.0], [0.0]]
    """
    mask_BT = as_mask(mask)
    scores_B = as_scores(scores, mask_BT.shape[0])
    if not isinstance(num_generations, int) or isinstance(num_generations, bool) or num_generations <= 0:
        raise ConfigurationError(f'num_generations must be a positive integer; got {num_generations!r}')
    if scores_B.numel() % num_generations:
        raise DataError(
            f'got {scores_B.numel()} rows, not a multiple of num_generations={num_generations}; '
            'each prompt needs exactly num_generations samples, in contiguous groups'
        )
    scores_P_G = scores_B.reshape(-1, num_generations)
    centred_P_G = scores_P_G - scores_P_G.mean(dim=1, keepdim=True)
    # A group of equal scores carries no signal: exactly 0, not a rounding error of its mean.
    centred_P_G = centred_P_G.masked_fill((scores_P_G == scores_P_G[:, :1]).all(dim=1, keepdim=True), 0.0)
    return reinforce_pp(
        centred_P_G.reshape(-1), mask_BT, logps=logps, ref_logps=ref_logps, kl_coef=kl_coef, gamma=gamma
    )


def discounted_returns(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_next`` over each row's masked tokens, last to first (0 elsewhere)."""
    returns_BT = torch.zeros_like(rewards_BT)
    next_B = rewards_BT.new_zeros(rewards_BT.shape[0])
    for t in reversed(range(rewards_BT.shape[1])):
        here_B = mask_BT[:, t]
        value_B = rewards_BT[:, t] + gamma * next_B
        returns_BT[:, t] = torch.where(here_B, value_B, 0.0)
        next_B = torch.where(here_B, value_B, next_B)
    return returns_BT


def batch_normalize(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / (std + EPS)`` over the masked positions of the whole batch (population
    std), float32, 0 elsewhere; all 0 when every masked value is the same."""
    picked = values_BT[mask_BT]
    if bool((picked == picked[0]).all()):
        return torch.zeros(values_BT.shape, dtype=torch.float32, device=values_BT.device)
    mean = picked.mean()
    std = (picked - mean).square().mean().sqrt()
    return torch.where(mask_BT, (values_BT - mean) / (std + EPS), 0.0).float()


__all__ = ['batch_normalize', 'discounted_returns', 'reinforce_pp', 'reinforce_pp_baseline']
