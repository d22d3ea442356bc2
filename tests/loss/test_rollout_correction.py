"""Rollout correction (truncated / masked importance sampling between the sampler and the
trainer), the sampler-vs-trainer metrics and the staleness metric, on examples worked by hand.

Every example uses a uniform vocabulary of 4 (zero logits), so each trained token's logp under
the trainer is ``-ln 4``; a sampler logp of ``-ln 4 - ln w`` then gives the importance weight
``w = exp(logp_old - logp_sampler)`` exactly where we want it (first epoch: logp_old = logp).
"""

from __future__ import annotations

import math

import pytest
import torch

# Vocabulary of 4, equal logits: every trained token has logp = -ln 4; 3 trained tokens, then 1.
from test_rl_losses import LN4, two_sequences

from twinkle.errors import ConfigurationError, DataError
from twinkle.loss import CISPOLoss, DRGRPOLoss, GRPOLoss, GSPOLoss, PPOLoss, RolloutCorrection, token_logps
from twinkle.metric import GRPOMetric, StalenessMetric


def sampler_for(weights: list[list[float]]) -> list[list[float]]:
    """Sampler logps that give these token weights against the trainer's -ln 4."""
    return [[-LN4 - math.log(w) for w in seq] for seq in weights]


def metrics_of(*outputs) -> dict[str, float]:
    metric = GRPOMetric()
    for out in outputs:
        metric.accumulate(inputs={}, outputs={}, loss=out)
    return metric.calculate()


# ---- token level ---------------------------------------------------------------------------------
def test_token_truncation_caps_each_weight_and_multiplies_the_term():
    inputs, outputs = two_sequences()
    loss = GRPOLoss(loss_type='token_mean', rollout_correction=RolloutCorrection(threshold=2.0))
    old = sampler_for([[0.5, 1.0, 4.0], [3.0]])
    out = loss(inputs, outputs, advantages=[1.0, -0.5], old_logps=old)
    # On-policy first epoch: r = 1, so term = -A * min(w, 2): weights 0.5, 1, 2 | 2.
    # sum = -(1 * (0.5 + 1 + 2) + -0.5 * 2) = -2.5 over 4 tokens.
    assert out.loss.item() == pytest.approx(-2.5) and out.num_items.item() == 4
    out.loss.backward()
    # d/dz of -A w log p(y) is -A w (onehot - softmax): the weight is a constant (detached).
    weight = torch.tensor([[0.0, 0.5, 1.0, 2.0], [0.0, -0.5 * 2.0, 0.0, 0.0]])
    onehot = torch.nn.functional.one_hot(inputs['labels'].clamp(min=0), 4).float()
    expected = -weight[..., None] * (onehot - 0.25)
    assert torch.allclose(outputs['logits'].grad, expected, atol=1e-6)
    figures = metrics_of(out)
    assert figures['is_truncated_frac'] == pytest.approx(2 / 4)  # 4 and 3 were capped
    # raw weights 0.5, 1, 4, 3: mean 8.5/4, mean of squares 26.25/4
    assert figures['is_weight_mean'] == pytest.approx(2.125)
    assert figures['is_weight_std'] == pytest.approx(math.sqrt(6.5625 - 2.125**2))
    assert (figures['is_weight_min'], figures['is_weight_max']) == (pytest.approx(0.5), pytest.approx(4.0))
    assert 'is_masked_frac' not in figures


def test_token_masking_drops_tokens_outside_the_range_from_loss_and_count():
    inputs, outputs = two_sequences()
    correction = RolloutCorrection(mode='mask', threshold=2.0)  # keeps [1/2, 2]
    old = sampler_for([[0.25, 1.5, 4.0], [1.0]])
    out = GRPOLoss(loss_type='token_mean', rollout_correction=correction)(
        inputs, outputs, advantages=[1.0, -0.5], old_logps=old
    )
    # kept: 1.5 (seq 0) and 1.0 (seq 1), each weighted: -(1 * 1.5 + -0.5 * 1.0) = -1.0 over 2 tokens
    assert out.loss.item() == pytest.approx(-1.0) and out.num_items.item() == 2
    assert out.metrics['tokens'].item() == 2
    assert metrics_of(out)['is_masked_frac'] == pytest.approx(2 / 4)
    # 'grpo': seq 0's mean over its kept token, -1.5; seq 1's, 0.5: -1.0 over 2 sequences
    out = GRPOLoss(rollout_correction=correction)(inputs, outputs, advantages=[1.0, -0.5], old_logps=old)
    assert out.loss.item() == pytest.approx(-1.5 + 0.5) and out.num_items.item() == 2


def test_threshold_low_moves_the_lower_bound():
    inputs, outputs = two_sequences()
    correction = RolloutCorrection(mode='mask', threshold=5.0, threshold_low=0.2)  # keeps [0.2, 5]
    old = sampler_for([[0.25, 1.5, 4.0], [0.1]])
    out = PPOLoss(rollout_correction=correction)(inputs, outputs, advantages=[1.0, -0.5], old_logps=old)
    # seq 0 keeps all three: -(0.25 + 1.5 + 4); seq 1's 0.1 is dropped
    assert out.loss.item() == pytest.approx(-5.75) and out.num_items.item() == 3


# ---- sequence level --------------------------------------------------------------------------------
def test_sequence_level_truncates_the_product_of_the_token_weights():
    inputs, outputs = two_sequences()
    correction = RolloutCorrection(level='sequence', threshold=2.0)
    old = sampler_for([[0.5, 2.0, 4.0], [1.5]])
    out = GRPOLoss(rollout_correction=correction)(inputs, outputs, advantages=[1.0, -0.5], old_logps=old)
    # seq 0: 0.5 * 2 * 4 = 4, capped at 2: token mean -2; seq 1: 1.5: -(-0.5 * 1.5) = 0.75
    assert out.loss.item() == pytest.approx(-2.0 + 0.75) and out.num_items.item() == 2
    figures = metrics_of(out)  # each token carries its sequence's weight: 4, 4, 4, 1.5
    assert figures['is_weight_mean'] == pytest.approx((3 * 4 + 1.5) / 4)
    assert figures['is_truncated_frac'] == pytest.approx(3 / 4)


def test_sequence_masking_drops_whole_sequences_product_versus_geometric_mean():
    inputs, outputs = two_sequences()
    old = sampler_for([[0.5, 2.0, 4.0], [1.5]])
    product = RolloutCorrection(level='sequence', mode='mask', threshold=2.0)
    out = GRPOLoss(loss_type='token_mean', rollout_correction=product)(
        inputs, outputs, advantages=[1.0, -0.5], old_logps=old
    )
    # the product 4 is out of [1/2, 2]: all of seq 0 goes; seq 1 stays with w = 1.5
    assert out.loss.item() == pytest.approx(0.75) and out.num_items.item() == 1
    assert out.metrics['sequences'].item() == 1 and out.metrics['is_masked'].item() == 3
    geometric = RolloutCorrection(level='geometric', mode='mask', threshold=2.0)
    out = GRPOLoss(loss_type='token_mean', rollout_correction=geometric)(
        inputs, outputs, advantages=[1.0, -0.5], old_logps=old
    )
    # the geometric mean 4^(1/3) = 1.587 is in range: seq 0 stays, each token weighted by it
    w0 = 4 ** (1 / 3)
    assert out.loss.item() == pytest.approx(-(3 * w0 - 0.5 * 1.5), rel=1e-5) and out.num_items.item() == 4


# ---- the trainer's own old policy (later PPO epochs) ---------------------------------------------
def test_proximal_logps_anchor_the_ratio_and_the_weight():
    labels = torch.tensor([[-100, 0]])
    logits = torch.zeros(1, 2, 4, requires_grad=True)
    proximal = [[-LN4 - math.log(1.1)]]  # r = exp(logp - proximal) = 1.1, inside the clip
    sampler = [[proximal[0][0] - math.log(3.0)]]  # w = exp(proximal - sampler) = 3, capped at 2
    loss = PPOLoss(rollout_correction={'threshold': 2.0})
    out = loss({'labels': labels}, {'logits': logits}, advantages=[1.0], old_logps=sampler, proximal_logps=proximal)
    assert out.loss.item() == pytest.approx(-1.1 * 2.0)
    figures = metrics_of(out)
    assert figures['is_weight_mean'] == pytest.approx(3.0)
    assert figures['kl_sample_train_v1'] == pytest.approx(-math.log(3.3))  # sampler - current
    assert figures['ratio'] == pytest.approx(1.1)


def test_proximal_logps_without_a_correction_are_refused():
    inputs, outputs = two_sequences()
    with pytest.raises(ConfigurationError, match='proximal_logps= but has no rollout_correction'):
        GRPOLoss()(inputs, outputs, advantages=[1.0, 1.0], proximal_logps=[[-LN4] * 3, [-LN4]])


def test_cispo_multiplies_its_weight_by_the_correction():
    labels = torch.tensor([[-100, 0]])
    out = CISPOLoss(rollout_correction=RolloutCorrection(threshold=2.0))(
        {'labels': labels}, {'logits': torch.zeros(1, 2, 4)}, advantages=[1.0], old_logps=sampler_for([[3.0]])
    )
    # -sg(clip(r)) * A * logp * min(w, 2), r = 1: -1 * 1 * -ln 4 * 2
    assert out.loss.item() == pytest.approx(2 * LN4)


# ---- no mismatch, no change ------------------------------------------------------------------------
CORRECTIONS = [
    RolloutCorrection(level=level, mode=mode, threshold=1.0 if mode == 'mask' else 2.0)
    for level in ('token', 'sequence', 'geometric')
    for mode in ('truncate', 'mask')
]
LOSSES = [
    lambda rc: GRPOLoss(rollout_correction=rc),
    lambda rc: PPOLoss(rollout_correction=rc),
    lambda rc: DRGRPOLoss(max_completion_length=8, rollout_correction=rc),
    lambda rc: GSPOLoss(rollout_correction=rc),
    lambda rc: CISPOLoss(rollout_correction=rc),
]


@pytest.mark.parametrize('make', LOSSES, ids=['grpo', 'ppo', 'drgrpo', 'gspo', 'cispo'])
def test_sampler_equal_to_trainer_gives_weights_of_1_and_the_uncorrected_loss_exactly(make):
    torch.manual_seed(0)
    inputs, _ = two_sequences()
    base = torch.randn(2, 4, 4)
    sampler_BS = token_logps(base, inputs['labels'])  # the trainer's own logps: no mismatch
    advantages = [[0.7, -1.2, 0.4], -0.3]

    def run(correction: RolloutCorrection | None):
        logits = base.clone().requires_grad_(True)
        out = make(correction)(inputs, {'logits': logits}, advantages=advantages, old_logps=sampler_BS)
        out.loss.backward()
        return out, logits.grad

    plain, plain_grad = run(None)
    for correction in CORRECTIONS:  # threshold 1 when masking: the tightest range, and 1 is still in it
        out, grad = run(correction)
        assert torch.equal(out.loss, plain.loss) and torch.equal(out.num_items, plain.num_items), correction
        assert torch.equal(grad, plain_grad), correction
        figures = metrics_of(out)
        assert figures['is_weight_min'] == figures['is_weight_max'] == 1.0
        assert figures['kl_sample_train_v1'] == 0.0 and figures['kl_sample_train_v2'] == 0.0
        assert figures.get('is_truncated_frac', figures.get('is_masked_frac')) == 0.0


# ---- metrics ----------------------------------------------------------------------------------------
def test_kl_sample_train_v1_and_v2_on_hand_worked_numbers():
    inputs, outputs = two_sequences()
    diffs = [[0.1, -0.2, 0.3], [0.4]]  # sampler logp - trainer logp, per token
    old = [[-LN4 + d for d in seq] for seq in diffs]
    out = GRPOLoss()(inputs, outputs, advantages=[1.0, 1.0], old_logps=old)
    figures = metrics_of(out)
    assert figures['kl_sample_train_v1'] == pytest.approx((0.1 - 0.2 + 0.3 + 0.4) / 4, abs=1e-6)  # 0.15
    assert figures['kl_sample_train_v2'] == pytest.approx(0.5 * (0.01 + 0.04 + 0.09 + 0.16) / 4, abs=1e-6)
    # no correction: the weights exp(-d) are reported all the same, no truncated/masked share
    assert figures['is_weight_max'] == pytest.approx(math.exp(0.2))
    assert 'is_truncated_frac' not in figures and 'is_masked_frac' not in figures
    # without sampler logps there is nothing to compare: no such figure
    assert 'kl_sample_train_v1' not in metrics_of(GRPOLoss()(inputs, outputs, advantages=[1.0, 1.0]))


def test_weight_extremes_and_sums_add_up_over_micro_batches_and_ranks():
    inputs, outputs = two_sequences()
    loss = GRPOLoss(rollout_correction=RolloutCorrection(threshold=2.0))
    first = loss(inputs, outputs, advantages=[1.0, 1.0], old_logps=sampler_for([[0.5, 1.0, 1.0], [1.0]]))
    second = loss(inputs, outputs, advantages=[1.0, 1.0], old_logps=sampler_for([[1.0, 1.0, 1.0], [3.0]]))
    both = metrics_of(first, second)
    assert (both['is_weight_min'], both['is_weight_max']) == (pytest.approx(0.5), pytest.approx(3.0))
    assert both['is_weight_mean'] == pytest.approx((3.5 + 6.0) / 8)
    assert both['is_truncated_frac'] == pytest.approx(1 / 8)
    one, other = GRPOMetric(), GRPOMetric()  # two ranks: merging the other's state gives the same figures
    one.accumulate(inputs={}, outputs={}, loss=first)
    other.accumulate(inputs={}, outputs={}, loss=second)
    one.merge(other.state())
    assert one.calculate() == pytest.approx(both)


# ---- configuration ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ('options', 'message'),
    [
        ({'threshold': 0.5}, 'threshold must be a finite number >= 1'),
        ({'threshold': float('nan')}, 'threshold must be a finite number >= 1'),
        ({'threshold': True}, 'threshold must be a finite number >= 1'),
        ({'mode': 'mask', 'threshold_low': 1.5}, r'threshold_low must be a number in \[0, 1\]'),
        ({'mode': 'mask', 'threshold_low': -0.1}, r'threshold_low must be a number in \[0, 1\]'),
        ({'threshold_low': 0.5}, "bounds mode='mask' only"),
        ({'level': 'turn'}, "Invalid RolloutCorrection level 'turn'"),
        ({'mode': 'clip'}, "Invalid RolloutCorrection mode 'clip'"),
    ],
)
def test_out_of_range_settings_are_refused_at_construction(options, message):
    with pytest.raises(ConfigurationError, match=message):
        RolloutCorrection(**options)
    with pytest.raises(ConfigurationError, match=message):
        GRPOLoss(rollout_correction=options)  # a dict, as a loss set over the wire gives it


def test_a_dict_of_fields_is_a_correction_and_unknown_fields_are_named():
    assert GSPOLoss(rollout_correction={'level': 'sequence'}).rollout_correction == RolloutCorrection('sequence')
    with pytest.raises(ConfigurationError, match=r"unknown fields \['cap'\]"):
        GRPOLoss(rollout_correction={'cap': 2.0})
    with pytest.raises(ConfigurationError, match='must be a RolloutCorrection'):
        GRPOLoss(rollout_correction=2.0)  # type: ignore[arg-type]


# ---- staleness ------------------------------------------------------------------------------------------
def test_staleness_mean_max_and_histogram():
    metric = StalenessMetric()
    assert metric.calculate() == {}
    metric.accumulate(staleness=[0, 0, 1, 3])
    metric.accumulate(trainer_version=7, weight_versions=[7, 6])  # staleness 0 and 1
    assert metric.calculate() == {
        'staleness_mean': (0 + 0 + 1 + 3 + 0 + 1) / 6,
        'staleness_max': 3.0,
        'staleness/0': 3.0,
        'staleness/1': 2.0,
        'staleness/3': 1.0,
    }
    other = StalenessMetric()
    other.accumulate(staleness=[5])
    metric.merge(other.state())
    assert metric.calculate()['staleness_max'] == 5.0 and metric.calculate()['staleness/5'] == 1.0
    metric.reset()
    assert metric.calculate() == {}


def test_staleness_refuses_samples_from_the_future_and_non_integers():
    metric = StalenessMetric()
    with pytest.raises(DataError, match='staleness -1'):
        metric.accumulate(trainer_version=2, weight_versions=[3])
    with pytest.raises(DataError, match='without trainer_version'):
        metric.accumulate(weight_versions=[3])
    with pytest.raises(DataError, match='must be integers'):
        metric.accumulate(staleness=[0.5])
    assert metric.calculate() == {}
