"""Per-token advantages: Generalized Advantage Estimation over completion tokens (PPO with a critic), and the
``[B, T]`` grid helpers the per-token estimators share (``gae``, the function, lives here: the module is not named
after it, so ``twinkle.advantage.gae`` is the function alone).

Everything here works on the ``[B, T]`` grid a forward gives (``ModelOutput.logps``,
``TransformersModel.forward_values``): one row per sequence, ``mask`` marking its completion
(trained) tokens, in order. Positions outside the mask are skipped, not treated as steps: the
next state of a completion token is the next masked position of its row, and after the last one
the episode ends (value 0). So a multi-turn row whose environment tokens are unmasked is one
episode over its own tokens.

``token_rewards`` builds the per-token rewards of RLHF's PPO (Ouyang et al. 2022, InstructGPT,
arXiv:2203.02155, eq. 2; Stiennon et al. 2020): the sequence's reward on its last token, and
"KL in the reward", ``-kl_coef * (logp - ref_logp)`` on every token. (KL in the loss, as GRPO
puts it, is ``GRPOLoss(beta=...)`` instead.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from twinkle.errors import ConfigurationError, DataError

Scores = Sequence[float] | np.ndarray | torch.Tensor


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ``[B, T]`` (float32, 0 outside ``mask``) by GAE (Schulman et al.
    2016, arXiv:1506.02438, eq. 16). Over the masked tokens ``t`` of a row, last to first::

        delta_t = r_t + gamma * V_next - V_t          (V_next = 0 after the row's last token)
        A_t     = delta_t + gamma * lam * A_next
        R_t     = A_t + V_t                           (the critic's targets, ``ValueLoss`` returns)

    ``lam = 1`` gives the Monte-Carlo return minus the value, ``lam = 0`` the one-step TD error.
    ``gamma`` and ``lam`` must lie in ``[0, 1]``.

    >>> adv, ret = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]]), torch.tensor([[1, 1]]), 1.0, 1.0)
    >>> adv.tolist(), ret.tolist()
    ([[0.5, 0.5]], [[1.0, 1.0]])
    """
    check_unit('gamma', gamma)
    check_unit('lam', lam)
    mask_BT = as_mask(mask)
    rewards_BT = as_grid('rewards', rewards, mask_BT)
    values_BT = as_grid('values', values, mask_BT)
    advantages_BT = torch.zeros_like(values_BT)
    next_value_B = values_BT.new_zeros(values_BT.shape[0])
    next_advantage_B = values_BT.new_zeros(values_BT.shape[0])
    for t in reversed(range(values_BT.shape[1])):
        here_B = mask_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        advantage_B = delta_B + gamma * lam * next_advantage_B
        advantages_BT[:, t] = torch.where(here_B, advantage_B, 0.0)
        next_value_B = torch.where(here_B, values_BT[:, t], next_value_B)
        next_advantage_B = torch.where(here_B, advantage_B, next_advantage_B)
    returns_BT = torch.where(mask_BT, advantages_BT + values_BT, 0.0)
    return advantages_BT.float(), returns_BT.float()


def token_rewards(
    scores: Scores,
    mask: torch.Tensor,
    *,
    logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards ``[B, T]`` (float64, 0 outside ``mask``): row ``i``'s ``scores[i]`` on
    its last masked token, plus ``-kl_coef * (logps - ref_logps)`` on each masked token (the
    sampled token's log-ratio to the reference, the KL estimator of InstructGPT's reward).
    ``kl_coef > 0`` needs both log-probability grids.

    >>> token_rewards([1.0], torch.tensor([[0, 1, 1, 0]])).tolist()
    [[0.0, 0.0, 1.0, 0.0]]
    """
    mask_BT = as_mask(mask)
    scores_B = as_scores(scores, mask_BT.shape[0])
    if not is_finite(kl_coef) or kl_coef < 0:
        raise ConfigurationError(f'kl_coef must be a finite number >= 0; got {kl_coef!r}')
    empty = (~mask_BT.any(dim=1)).nonzero()
    if len(empty):
        raise DataError(f'row {int(empty[0, 0])} has no masked (completion) token to put its score on')
    positions_T = torch.arange(mask_BT.shape[1], device=mask_BT.device)
    last_B = torch.where(mask_BT, positions_T, -1).argmax(dim=1)
    rewards_BT = torch.zeros(mask_BT.shape, dtype=torch.float64, device=mask_BT.device)
    rewards_BT[torch.arange(mask_BT.shape[0], device=mask_BT.device), last_B] = scores_B.to(mask_BT.device)
    if kl_coef > 0:
        if logps is None or ref_logps is None:
            raise ConfigurationError(f'kl_coef={kl_coef} puts a KL penalty in the reward: pass logps= and ref_logps=')
        log_ratio_BT = as_grid('logps', logps, mask_BT) - as_grid('ref_logps', ref_logps, mask_BT)
        rewards_BT = rewards_BT - kl_coef * torch.where(mask_BT, log_ratio_BT, 0.0)
    return rewards_BT


def per_sequence(values: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """Each row's masked values in order: the per-token form the losses take for ``advantages``,
    ``returns``, ``old_logps`` or ``old_values`` (what ``twinkle.loss.rl.align_per_token`` lays
    back onto the grid, whatever padding a later forward uses).

    >>> per_sequence(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0, 1, 1]]))
    [[2.0, 3.0]]
    """
    mask_BT = as_mask(mask)
    values_BT = as_grid('values', values, mask_BT)
    return [row[row_mask].tolist() for row, row_mask in zip(values_BT.float(), mask_BT, strict=True)]


# ---- checks shared with reinforce_pp ------------------------------------------------------------
def check_unit(name: str, value: float) -> None:
    """``ConfigurationError`` unless ``value`` is a number in ``[0, 1]`` (a discount, GAE's lambda)."""
    if not is_finite(value) or not 0.0 <= value <= 1.0:
        raise ConfigurationError(f'{name} must be a number in [0, 1]; got {value!r}')


def is_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def as_mask(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` as a bool ``[B, T]`` tensor (a 0/1 or bool tensor)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise DataError(f'mask must be a [batch, tokens] tensor; got {shape}')
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise DataError('mask must hold only 0 and 1 (or be a bool tensor)')
    return mask.bool()


def as_grid(name: str, values: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """``values`` as float64 on the mask's grid; ``DataError`` for another shape or a NaN or
    infinite value at a masked position (unmasked ones are ignored, so padding may hold anything)."""
    if not isinstance(values, torch.Tensor) or values.shape != mask_BT.shape:
        shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise DataError(f'{name} must be a tensor shaped like the mask {tuple(mask_BT.shape)}; got {shape}')
    grid_BT = torch.where(mask_BT, values.detach().to(device=mask_BT.device, dtype=torch.float64), 0.0)
    bad = (~torch.isfinite(grid_BT)).nonzero()
    if len(bad):
        row, col = (int(i) for i in bad[0])
        raise DataError(f'{name}[{row}, {col}] is {float(grid_BT[row, col])}; it must be a finite number')
    return grid_BT


def as_scores(scores: Scores, rows: int) -> torch.Tensor:
    """One finite score per row, float64 ``[B]``."""
    try:
        scores_B = torch.as_tensor(np.asarray(scores.detach().cpu() if isinstance(scores, torch.Tensor) else scores))
    except (TypeError, ValueError) as err:
        raise DataError(f'scores must be numbers, one per row; {err}') from None
    if scores_B.dim() != 1 or scores_B.numel() != rows or scores_B.is_complex() or scores_B.dtype == torch.bool:
        raise DataError(f'scores must be {rows} real numbers, one per row; got shape {tuple(scores_B.shape)}')
    scores_B = scores_B.to(torch.float64)
    bad = (~torch.isfinite(scores_B)).nonzero()
    if len(bad):
        raise DataError(f'scores[{int(bad[0, 0])}] is {float(scores_B[bad[0, 0]])}; scores must be finite numbers')
    return scores_B


__all__ = ['as_grid', 'as_mask', 'as_scores', 'check_unit', 'gae', 'per_sequence', 'token_rewards']
