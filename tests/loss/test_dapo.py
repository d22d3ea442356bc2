"""DAPO's pieces (Yu et al. 2025, arXiv:2503.14476): dynamic sampling, soft overlong punishment,
and clip-higher with the token-level loss (GRPOLoss with DAPO's settings), worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from twinkle.advantage import filter_groups, sample_until_full
from twinkle.errors import ConfigurationError, DataError
from twinkle.loss import GRPOLoss
from twinkle.reward import REWARDS, OverlongPunishment, overlong_penalty

IGN = -100


# ---- dynamic sampling -------------------------------------------------------------------------
def test_filter_groups_keeps_groups_whose_rewards_differ():
    # Groups of 3: (1, 1, 1) all right, (0, 1, 0) mixed, (0, 0, 0) all wrong, (0.5, 0.5, 0.2) mixed.
    rewards = [1, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.2]
    kept = filter_groups(rewards, num_generations=3, target_groups=4)
    assert kept.kept_groups == [1, 3]
    assert kept.kept_rows == [3, 4, 5, 9, 10, 11]
    assert (kept.dropped, kept.refill) == (2, 2)
    assert filter_groups(rewards, 3, target_groups=1).refill == 0
    assert filter_groups(rewards, 3).refill == 0
    with pytest.raises(DataError, match='got 5 rewards, not a multiple of num_generations=2'):
        filter_groups([1, 0, 1, 0, 1], 2)
    with pytest.raises(ConfigurationError, match='target_groups must be a positive integer; got 0'):
        filter_groups([1, 0], 2, target_groups=0)


def test_sample_until_full_refills_what_was_dropped():
    # Scripted sampler, groups of 2: asked for 3, then for the 2 missing, then for the 1 missing.
    script = [[(1, 1), (0, 1), (0, 0)], [(1, 0), (1, 1)], [(0, 1)]]
    asked = []

    def sample(groups):
        call = len(asked)
        asked.append(groups)
        rewards = [r for group in script[call] for r in group]
        rows = [f'call{call}-group{g}-{j}' for g in range(groups) for j in range(2)]
        return rows, rewards

    batch = sample_until_full(sample, target_groups=3, num_generations=2, max_tries=5)
    assert asked == [3, 2, 1]
    assert batch.rows == [
        'call0-group1-0',
        'call0-group1-1',
        'call1-group0-0',
        'call1-group0-1',
        'call2-group0-0',
        'call2-group0-1',
    ]
    assert batch.rewards == [0, 1, 1, 0, 0, 1]
    assert (batch.tries, batch.sampled_groups, batch.dropped_groups) == (3, 6, 3)


def test_sample_until_full_stops_after_max_tries():
    calls = []

    def solved(groups):
        calls.append(groups)
        return ['row'] * (2 * groups), [1.0] * (2 * groups)

    with pytest.raises(DataError, match=r'kept 0 of 2 groups after max_tries=3 tries \(6 groups sampled'):
        sample_until_full(solved, target_groups=2, num_generations=2, max_tries=3)
    assert calls == [2, 2, 2]
    with pytest.raises(DataError, match=r'sample\(2\) returned 2 rows and 2 rewards; it must return 2 groups'):
        sample_until_full(lambda n: (['a', 'b'], [0.0, 1.0]), target_groups=2, num_generations=2)
    with pytest.raises(ConfigurationError, match='max_tries must be a positive integer'):
        sample_until_full(solved, target_groups=2, num_generations=2, max_tries=0)


# ---- soft overlong punishment (eq. 13) ---------------------------------------------------------
def test_overlong_penalty_by_hand():
    # L_max 20, L_cache 4: free up to 16 tokens, then (16 - len) / 4, then -1 past 20.
    lengths = [0, 16, 17, 19, 20, 21, 100]
    assert [overlong_penalty(n, 20, 4) for n in lengths] == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0, -1.0]
    # cache_length == max_length: the penalty ramps from the first token.
    assert overlong_penalty(1, 4, 4) == -0.25


def test_overlong_reward_counts_completion_tokens():
    reward = REWARDS.build('OverlongPunishment', OverlongPunishment, max_length=6, cache_length=2)
    rows = [
        {'input_ids': list(range(8)), 'labels': [IGN] * 4 + [1, 2, 3, 4]},  # 4 tokens: free
        {'input_ids': list(range(8)), 'labels': [IGN] * 3 + [1, 2, 3, 4, 5]},  # 5: (4 - 5) / 2
        {'input_ids': list(range(9)), 'labels': [IGN, *range(8)]},  # 8 > 6: -1
    ]
    assert reward(rows) == [0.0, -0.5, -1.0]
    with pytest.raises(DataError, match='row 0 has no labels to count'):
        reward([{'messages': [{'role': 'assistant', 'content': 'hi'}]}])


@pytest.mark.parametrize(
    ('args', 'error', 'match'),
    [
        ((5, 4, 5), ConfigurationError, r'cache_length \(5\) must not exceed max_length \(4\)'),
        ((5, 0, 1), ConfigurationError, 'max_length must be a positive integer; got 0'),
        ((5, 8, -1), ConfigurationError, 'cache_length must be a positive integer; got -1'),
        ((-1, 8, 2), DataError, 'a completion length must be an integer >= 0; got -1'),
        ((2.5, 8, 2), DataError, 'a completion length must be an integer'),
    ],
)
def test_overlong_refuses_bad_lengths(args, error, match):
    with pytest.raises(error, match=match):
        overlong_penalty(*args)


# ---- clip-higher and the token-level loss -----------------------------------------------------
def _policy_batch():
    # Uniform logits over 4 tokens: every label's logp is ln(1/4); old_logps set each ratio r.
    # Sequence 0 (A = +1): r = 1.25, 1.3, 0.7. Sequence 1 (A = -1): r = 0.7.
    labels = torch.tensor([[IGN, 1, 2, 3], [IGN, 1, IGN, IGN]])
    logits = torch.zeros(2, 4, 4, requires_grad=True)
    logp = math.log(0.25)
    old = [[logp - math.log(r) for r in (1.25, 1.3, 0.7)], [logp - math.log(0.7)]]
    return {'labels': labels}, {'logits': logits}, {'advantages': [1.0, -1.0], 'old_logps': old}


def test_dapo_clip_higher_with_token_mean():
    # DAPO: epsilon 0.2, epsilon_high 0.28, term = -min(r A, clip(r, 0.8, 1.28) A):
    #   seq 0: r 1.25 -> -1.25 (inside 1.28: trained; a symmetric 0.2 clip would stop it at 1.2)
    #          r 1.3  -> -1.28 (clipped above)
    #          r 0.7  -> -0.7  (A > 0: the lower clip does not bite)
    #   seq 1: r 0.7, A -1: min(-0.7, -0.8) = -0.8 -> 0.8 (clipped below)
    # token_mean: (-1.25 - 1.28 - 0.7 + 0.8) / 4 tokens = -2.43 / 4
    dapo = GRPOLoss(epsilon=0.2, epsilon_high=0.28, loss_type='token_mean')
    inputs, outputs, kwargs = _policy_batch()
    out = dapo(inputs, outputs, **kwargs)
    assert float(out.loss.detach()) == pytest.approx(-2.43, abs=1e-5)
    assert int(out.num_items) == 4
    assert int(out.metrics['clipped']) == 2
    # The gradient reaches the r = 1.25 token (clip-higher); with the symmetric clip it does not.
    out.loss.backward()
    assert outputs['logits'].grad[0, 1].abs().sum() > 0
    inputs, outputs, kwargs = _policy_batch()
    symmetric = GRPOLoss(epsilon=0.2, loss_type='token_mean')(inputs, outputs, **kwargs)
    assert float(symmetric.loss.detach()) == pytest.approx(-1.2 - 1.2 - 0.7 + 0.8, abs=1e-5)
    symmetric.loss.backward()
    assert outputs['logits'].grad[0, 1].abs().sum() == 0
    # GRPO's sequence mean instead: (-3.23 / 3 + 0.8) over 2 sequences; each of seq 0's three
    # tokens weighs a third of seq 1's one, where token_mean weighs every token alike.
    inputs, outputs, kwargs = _policy_batch()
    grpo = GRPOLoss(epsilon=0.2, epsilon_high=0.28, loss_type='grpo')(inputs, outputs, **kwargs)
    assert float(grpo.loss.detach()) == pytest.approx(-3.23 / 3 + 0.8, abs=1e-5)
    assert int(grpo.num_items) == 2
