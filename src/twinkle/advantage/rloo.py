"""REINFORCE Leave-One-Out advantages."""

from __future__ import annotations

import torch

from twinkle.advantage.base import ADVANTAGES, Advantage


@ADVANTAGES.register
class RLOOAdvantage(Advantage):
    """RLOO advantages (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!",
    ICLR DeepRLStructPred workshop; used for LLMs by Ahmadian et al. 2024, "Back to Basics:
    Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs",
    arXiv:2402.14740, its RLOO estimator): the baseline of sample ``i`` is the mean reward of
    the OTHER ``G - 1`` samples of its prompt,

        A_i = r_i - 1/(G-1) * sum_{j != i} r_j = G/(G-1) * (r_i - mean(r_1..r_G)),

    so it does not depend on ``r_i`` and the gradient estimate stays unbiased. It needs
    ``num_generations >= 2``. ``scale='none'`` is the paper's estimator; ``'group'`` and
    ``'batch'`` divide by a reward std as GRPO does (see ``twinkle.advantage.base``).

    >>> RLOOAdvantage()([0.0, 1.0, 1.0, 1.0], num_generations=2, scale='none').tolist()
    [-1.0, 1.0, 0.0, 0.0]
    """

    min_generations = 2

    def center(self, rewards_P_G: torch.Tensor) -> torch.Tensor:
        count = rewards_P_G.shape[1]
        others_mean_P_G = (rewards_P_G.sum(dim=1, keepdim=True) - rewards_P_G) / (count - 1)
        return rewards_P_G - others_mean_P_G
