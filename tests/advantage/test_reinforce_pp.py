"""REINFORCE++ and REINFORCE++-baseline (twinkle.advantage.reinforce_pp), worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from twinkle.advantage import per_sequence, reinforce_pp, reinforce_pp_baseline
from twinkle.errors import ConfigurationError, DataError


def close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-5, rtol=1e-5)


def test_kl_penalised_returns_normalised_over_the_batch():
    # Two rows, scores 1 and 0, kl_coef 0.1, gamma 1; log-ratios logp - ref:
    #   row 0 (2 tokens): 0.2, -0.1  -> rewards -0.02, 0.01 + 1 = 1.01  -> returns 0.99, 1.01
    #   row 1 (3 tokens): 0, 0.3, 0.1 -> rewards 0, -0.03, -0.01       -> returns -0.04, -0.04, -0.01
    # The 5 returns: mean 1.91 / 5 = 0.382; deviations 0.608, 0.628, -0.422, -0.422, -0.392;
    # squares sum to 1.27388, so the (population) std is sqrt(1.27388 / 5).
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    logps = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    ref = logps - torch.tensor([[0.2, -0.1, 0.0], [0.0, 0.3, 0.1]])
    advantages = reinforce_pp([1.0, 0.0], mask, logps=logps, ref_logps=ref, kl_coef=0.1)
    std = math.sqrt(1.27388 / 5)
    close(advantages, [[0.608 / std, 0.628 / std, 0.0], [-0.422 / std, -0.422 / std, -0.392 / std]])
    assert float(advantages[mask.bool()].mean()) == pytest.approx(0.0, abs=1e-6)


def test_discount_gamma():
    # gamma 0.5, no KL: row 0's returns 0.25, 0.5, 1; row 1's 0, 0. Mean 1.75 / 5 = 0.35;
    # deviations -0.1, 0.15, 0.65, -0.35, -0.35, squares sum 0.7: std sqrt(0.7 / 5).
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    std = math.sqrt(0.7 / 5)
    close(
        reinforce_pp([1.0, 0.0], mask, gamma=0.5), [[-0.1 / std, 0.15 / std, 0.65 / std], [-0.35 / std, -0.35 / std, 0]]
    )


def test_baseline_subtracts_the_group_mean_first():
    # Scores 1, 0 | 1, 1 (two groups of 2), two tokens each, gamma 1, no KL.
    # Baseline: centred 0.5, -0.5 | 0, 0; tokens .5 .5 -.5 -.5 0 0 0 0: mean 0;
    #   sum of squares 4 * 0.25 = 1, variance 1 / 8, std 0.35355: +-0.5 / 0.35355 = +-1.41421.
    mask = torch.ones(4, 2)
    root2 = math.sqrt(2)
    close(
        reinforce_pp_baseline([1.0, 0.0, 1.0, 1.0], mask, num_generations=2),
        [[root2] * 2, [-root2] * 2, [0, 0], [0, 0]],
    )
    # Plain REINFORCE++ on the same scores: tokens 1 1 0 0 1 1 1 1, mean 0.75, deviations .25 (x6) and
    # -.75 (x2), variance (6 * .0625 + 2 * .5625) / 8 = 0.1875: the solved group gets a positive advantage.
    std = math.sqrt(0.1875)
    plain = reinforce_pp([1.0, 0.0, 1.0, 1.0], mask)
    close(plain, [[0.25 / std] * 2, [-0.75 / std] * 2, [0.25 / std] * 2, [0.25 / std] * 2])


def test_baseline_with_kl_in_the_reward():
    # Scores 1, 0 (one group): centred 0.5, -0.5. kl_coef 0.5, log-ratios 0.2, 0 | 0, -0.2:
    #   row 0: rewards -0.1, 0.5 -> returns 0.4, 0.5;  row 1: rewards 0, -0.5 + 0.1 = -0.4 -> returns -0.4, -0.4
    # mean 0.1 / 4 = 0.025; deviations .375 .475 -.425 -.425; squares sum 0.7275: std sqrt(0.7275 / 4).
    mask = torch.ones(2, 2)
    logps = torch.zeros(2, 2)
    ref = -torch.tensor([[0.2, 0.0], [0.0, -0.2]])
    advantages = reinforce_pp_baseline([1.0, 0.0], mask, 2, logps=logps, ref_logps=ref, kl_coef=0.5)
    std = math.sqrt(0.7275 / 4)
    close(advantages, [[0.375 / std, 0.475 / std], [-0.425 / std, -0.425 / std]])
    assert per_sequence(advantages, mask)[1] == pytest.approx([-0.425 / std] * 2, rel=1e-5)


def test_equal_returns_give_zero_advantages():
    assert reinforce_pp([0.7, 0.7], torch.ones(2, 3)).abs().max() == 0
    assert reinforce_pp_baseline([0.7] * 4, torch.ones(4, 1), 2).abs().max() == 0


@pytest.mark.parametrize(
    ('call', 'error', 'match'),
    [
        (lambda m: reinforce_pp([1.0, 0.0], m, gamma=1.01), ConfigurationError, r'gamma must be a number in \[0, 1\]'),
        (lambda m: reinforce_pp([1.0, float('nan')], m), DataError, r'scores\[1\] is nan'),
        (lambda m: reinforce_pp([1.0], m), DataError, 'scores must be 2 real numbers'),
        (lambda m: reinforce_pp([1.0, 0.0], m, kl_coef=0.1), ConfigurationError, 'pass logps= and ref_logps='),
        (lambda m: reinforce_pp_baseline([1.0, 0.0], m, 3), DataError, 'not a multiple of num_generations=3'),
        (lambda m: reinforce_pp_baseline([1.0, 0.0], m, 0), ConfigurationError, 'num_generations must be a positive'),
    ],
)
def test_bad_input_is_refused(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.ones(2, 2))
