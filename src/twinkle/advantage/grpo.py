"""Group Relative Policy Optimization advantages."""

from __future__ import annotations

import torch

from twinkle.advantage.base import ADVANTAGES, Advantage


@ADVANTAGES.register
class GRPOAdvantage(Advantage):
    """GRPO outcome-supervision advantages (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300,
    section 4.1.2): every token of completion ``i`` gets

        A_i = (r_i - mean(r_1..r_G)) / std(r_1..r_G)

    over the ``G`` completions sampled for the same prompt. ``scale='group'`` is that equation;
    ``'batch'`` and ``'none'`` change only the divisor (see ``twinkle.advantage.base``).

    ``num_generations=1`` treats the whole batch as one group: the baseline is the batch mean
    (REINFORCE with a mean baseline), and ``'group'`` and ``'batch'`` coincide. A group of one
    sample would otherwise always get advantage 0 and train nothing.

    >>> GRPOAdvantage()([0.0, 1.0, 1.0, 1.0], num_generations=2).tolist()
    [-0.7071067690849304, 0.7071067690849304, 0.0, 0.0]
    """

    def groups(self, rewards_N: torch.Tensor, num_generations: int) -> torch.Tensor:
        return rewards_N.reshape(1, -1) if num_generations == 1 else rewards_N.reshape(-1, num_generations)

    def center(self, rewards_P_G: torch.Tensor) -> torch.Tensor:
        return rewards_P_G - rewards_P_G.mean(dim=1, keepdim=True)
