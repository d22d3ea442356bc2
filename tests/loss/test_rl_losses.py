"""The RL policy losses, DPO and GRPOMetric on examples worked out by hand."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

import twinkle.loss.rl
from twinkle.errors import ConfigurationError, DataError, StateError
from twinkle.loss import (
    LOSSES,
    CISPOLoss,
    DPOLoss,
    DRGRPOLoss,
    GRPOLoss,
    GSPOLoss,
    PPOLoss,
    align_per_token,
    sequence_index,
    token_logps,
)
from twinkle.metric import GRPOMetric

LN4 = math.log(4)


def two_sequences() -> tuple[dict, dict]:
    # Vocabulary of 4, equal logits: every trained token has logp = -ln 4. Sequence 0 trains 3
    # tokens, sequence 1 trains 1 (right-padded).
    labels = torch.tensor([[-100, 1, 2, 0], [-100, 2, -100, -100]])
    inputs = {
        'labels': labels,
        'position_ids': torch.tensor([[0, 1, 2, 3], [0, 1, 0, 0]]),
        'attention_mask': torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
    }
    return inputs, {'logits': torch.zeros(2, 4, 4, requires_grad=True)}


def one_token_rows(rows: int, vocab: int = 4) -> tuple[dict, dict]:
    # `rows` sequences of one trained token each (label 0), logp = -ln(vocab).
    labels = torch.tensor([[-100, 0]] * rows)
    return {'labels': labels}, {'logits': torch.zeros(rows, 2, vocab, requires_grad=True)}


def mean_loss(out) -> float:
    return out.loss.item() / out.num_items.item()


def reinforce_grad(logits: torch.Tensor, labels: torch.Tensor, weight_BS: torch.Tensor) -> torch.Tensor:
    # d(-w * log softmax(z)[y]) / dz = -w * (onehot(y) - softmax(z)), 0 where the label is ignored.
    mask = labels != -100
    onehot = torch.nn.functional.one_hot(labels.clamp(min=0), logits.shape[-1]).float()
    return -(weight_BS * mask)[..., None] * (onehot - logits.detach().softmax(-1))


# ---- GRPO / PPO / Dr. GRPO at ratio 1 -----------------------------------------------------------
def test_on_policy_values_of_the_three_aggregations():
    advantages = [1.0, -0.5]
    # token_mean: -(3 * 1 + 1 * -0.5) / 4 tokens
    inputs, outputs = two_sequences()
    out = GRPOLoss(loss_type='token_mean')(inputs, outputs, advantages=advantages)
    assert mean_loss(out) == pytest.approx(-2.5 / 4) and out.num_items.item() == 4
    # grpo: each sequence's token mean is -A: -(1 - 0.5) / 2 sequences
    out = GRPOLoss()(inputs, outputs, advantages=advantages)
    assert mean_loss(out) == pytest.approx(-0.5 / 2) and out.num_items.item() == 2
    # drgrpo: -(3 * 1 - 0.5) / (2 sequences * 8)
    out = DRGRPOLoss(max_completion_length=8)(inputs, outputs, advantages=advantages)
    assert mean_loss(out) == pytest.approx(-2.5 / 16) and out.num_items.item() == 16
    # PPO is the same objective, token mean by default.
    assert mean_loss(PPOLoss()(inputs, outputs, advantages=advantages)) == pytest.approx(-2.5 / 4)


def test_old_logps_equal_to_the_current_ones_is_on_policy():
    inputs, outputs = two_sequences()
    old = [[-LN4] * 3, [-LN4]]  # the sampler saw the same distribution: every ratio is 1
    out = GRPOLoss(loss_type='token_mean')(inputs, outputs, advantages=[1.0, -0.5], old_logps=old)
    assert mean_loss(out) == pytest.approx(-2.5 / 4)
    assert out.metrics['ratio'].item() == pytest.approx(4.0) and out.metrics['clipped'].item() == 0


def test_gradient_at_ratio_one_is_reinforce():
    torch.manual_seed(0)
    inputs, _ = two_sequences()
    logits = torch.randn(2, 4, 4, requires_grad=True)
    # per-token advantages, as PPO would get from GAE
    advantages = [[0.5, -1.0, 2.0], [3.0]]
    PPOLoss()(inputs, {'logits': logits}, advantages=advantages).loss.backward()
    weight = torch.tensor([[0.0, 0.5, -1.0, 2.0], [0.0, 3.0, 0.0, 0.0]])
    assert torch.allclose(logits.grad, reinforce_grad(logits, inputs['labels'], weight), atol=1e-6)


# ---- clipping -----------------------------------------------------------------------------------
def test_clip_engages_beyond_epsilon_only_in_the_direction_of_the_advantage():
    # Four one-token sequences with ratios 1.5, 1.1, 0.5, 1.5 and advantages 1, 2, -1, -3.
    inputs, outputs = one_token_rows(4)
    ratios, advantages = [1.5, 1.1, 0.5, 1.5], [1.0, 2.0, -1.0, -3.0]
    old = [[-LN4 - math.log(r)] for r in ratios]
    out = GRPOLoss(loss_type='token_mean')(inputs, outputs, advantages=advantages, old_logps=old)
    # -min(rA, clip(r, 0.8, 1.2) A) per row:
    #   r 1.5, A 1: -min(1.5, 1.2) = -1.2 (clipped)     r 1.1, A 2: -min(2.2, 2.2) = -2.2
    #   r 0.5, A -1: -min(-0.5, -0.8) = 0.8 (clipped)   r 1.5, A -3: -min(-4.5, -3.6) = 4.5
    assert out.loss.item() == pytest.approx(-1.2 - 2.2 + 0.8 + 4.5)
    assert out.metrics['clipped'].item() == 2
    assert out.metrics['ratio'].item() == pytest.approx(sum(ratios))
    out.loss.backward()
    grad = outputs['logits'].grad[:, 1]
    # The clipped rows get no gradient; the others get -r * A * (onehot - softmax).
    assert grad[0].abs().sum() == 0 and grad[2].abs().sum() == 0
    softmax, onehot = torch.full((4,), 0.25), torch.tensor([1.0, 0, 0, 0])
    assert torch.allclose(grad[1], -1.1 * 2.0 * (onehot - softmax))
    assert torch.allclose(grad[3], -1.5 * -3.0 * (onehot - softmax))


def test_epsilon_high_widens_the_upper_clip_only():
    inputs, outputs = one_token_rows(2)
    old = [[-LN4 - math.log(1.5)], [-LN4 - math.log(0.7)]]
    out = GRPOLoss(epsilon_high=0.6, loss_type='token_mean')(inputs, outputs, advantages=[1.0, -1.0], old_logps=old)
    # 1.5 < 1 + 0.6: not clipped (-1.5); 0.7 < 1 - 0.2 with A<0: clipped at 0.8
    assert out.loss.item() == pytest.approx(-1.5 + 0.8) and out.metrics['clipped'].item() == 1


# ---- KL -----------------------------------------------------------------------------------------
def test_kl_is_zero_at_the_reference_and_k3_elsewhere():
    inputs, outputs = two_sequences()
    loss = GRPOLoss(beta=0.1, loss_type='token_mean')
    assert loss.needs_reference and not GRPOLoss().needs_reference
    same = torch.full((2, 4), -LN4)
    out = loss(inputs, outputs, advantages=[1.0, 1.0], ref_logps=same)
    assert out.metrics['kl'].item() == pytest.approx(0.0, abs=1e-6) and mean_loss(out) == pytest.approx(-1.0)
    # ref - logp = ln 2: k3 = e^{ln 2} - ln 2 - 1 = 1 - ln 2 per token; the model's ref_logps are read
    # from outputs when no ref_logps= is passed.
    outputs['ref_logps'] = torch.full((2, 4), -LN4 + math.log(2))
    out = loss(inputs, outputs, advantages=[1.0, 1.0])
    k3 = 1 - math.log(2)
    assert out.metrics['kl'].item() == pytest.approx(4 * k3)
    assert mean_loss(out) == pytest.approx(-1.0 + 0.1 * k3)
    # The ref_logps= kwarg wins over outputs['ref_logps'].
    assert loss(inputs, outputs, advantages=[1.0, 1.0], ref_logps=same).metrics['kl'].item() == pytest.approx(
        0, abs=1e-6
    )


# ---- GSPO ---------------------------------------------------------------------------------------
def one_sequence_of_two_tokens() -> tuple[dict, dict]:
    labels = torch.tensor([[-100, 0, 1]])
    return {'labels': labels}, {'logits': torch.zeros(1, 3, 4, requires_grad=True)}


def test_gspo_clips_on_the_sequence_mean_ratio():
    # Token log-ratios +0.1 and -0.1: each token ratio is far outside 1 +- 4e-4, but their mean
    # is 0, so s = 1 and nothing is clipped: loss = -A.
    inputs, outputs = one_sequence_of_two_tokens()
    balanced = [[-LN4 - 0.1, -LN4 + 0.1]]
    out = GSPOLoss()(inputs, outputs, advantages=[1.0], old_logps=balanced)
    assert mean_loss(out) == pytest.approx(-1.0) and out.metrics['clipped'].item() == 0
    # GRPO with the same epsilon clips the token whose ratio is e^0.1 (A > 0).
    grpo = GRPOLoss(epsilon=3e-4, epsilon_high=4e-4)(inputs, outputs, advantages=[1.0], old_logps=balanced)
    assert grpo.metrics['clipped'].item() == 1
    # Both +0.1: s = e^0.1 > 1 + 4e-4 with A > 0, both tokens clipped, loss -(1 + 4e-4), no gradient.
    out = GSPOLoss()(inputs, outputs, advantages=[1.0], old_logps=[[-LN4 - 0.1, -LN4 - 0.1]])
    assert mean_loss(out) == pytest.approx(-(1 + 4e-4)) and out.metrics['clipped'].item() == 2
    out.loss.backward()
    assert outputs['logits'].grad.abs().sum() == 0


def test_gspo_gradient_is_the_sequence_ratio_times_the_mean_token_gradient():
    inputs, outputs = one_sequence_of_two_tokens()
    # Log-ratios 0.1 and -0.3: s = e^{-0.1}, inside 1 +- 0.2.
    old = [[-LN4 - 0.1, -LN4 + 0.3]]
    out = GSPOLoss(epsilon=0.2, epsilon_high=0.2)(inputs, outputs, advantages=[2.0], old_logps=old)
    s = math.exp(-0.1)
    assert mean_loss(out) == pytest.approx(-s * 2.0)
    out.loss.backward()
    # grad of -s * A * mean_t logp_t: -s * A / 2 * (onehot - softmax) at each token
    weight = torch.tensor([[0.0, s * 2.0 / 2, s * 2.0 / 2]])
    assert torch.allclose(outputs['logits'].grad, reinforce_grad(outputs['logits'], inputs['labels'], weight))


# ---- CISPO --------------------------------------------------------------------------------------
def test_cispo_keeps_the_gradient_of_tokens_outside_the_clip_range():
    inputs, outputs = one_token_rows(2)
    # Ratio 2 with A > 0: PPO would drop this token; CISPO weighs it by clip(2, -, 1.2) = 1.2.
    # Ratio 0.1 with A < 0: no lower bound by default, weight 0.1.
    old = [[-LN4 - math.log(2.0)], [-LN4 - math.log(0.1)]]
    out = CISPOLoss(epsilon_high=0.2)(inputs, outputs, advantages=[1.0, -1.0], old_logps=old)
    assert out.loss.item() == pytest.approx(-1.2 * 1.0 * -LN4 - 0.1 * -1.0 * -LN4)
    assert out.metrics['clipped'].item() == 1  # only the first weight was truncated
    out.loss.backward()
    weight = torch.tensor([[0.0, 1.2 * 1.0], [0.0, 0.1 * -1.0]])
    grad = outputs['logits'].grad
    assert grad[0].abs().sum() > 0
    assert torch.allclose(grad, reinforce_grad(outputs['logits'], inputs['labels'], weight))
    # Default cap is 1 + 3 = 4: a ratio of 5 gets weight 4.
    inputs, outputs = one_token_rows(1)
    out = CISPOLoss()(inputs, outputs, advantages=[1.0], old_logps=[[-LN4 - math.log(5.0)]])
    assert out.loss.item() == pytest.approx(-4.0 * -LN4)


# ---- DPO ----------------------------------------------------------------------------------------
def dpo_pair() -> tuple[dict, dict]:
    # Vocabulary of 2, one trained token per sequence, label 0. Chosen logits (ln 3, 0): p = 3/4;
    # rejected logits (0, 0): p = 1/2. So pc - pr = ln(3/4) - ln(1/2) = ln 1.5.
    labels = torch.tensor([[-100, 0], [-100, 0]])
    logits = torch.tensor([[[0.0, 0.0], [math.log(3), 0.0]], [[0.0, 0.0], [0.0, 0.0]]], requires_grad=True)
    return {'labels': labels}, {'logits': logits}


def test_dpo_on_a_hand_computed_pair():
    inputs, outputs = dpo_pair()
    # Reference: rc = ln(1/4), rr = ln(1/2): h = ln 1.5 - (ln(1/4) - ln(1/2)) = ln 3.
    ref = [math.log(0.25), math.log(0.5)]
    out = DPOLoss(beta=1.0)(inputs, outputs, ref_logps=ref)
    # -log sigmoid(ln 3) = ln(1 + 1/3)
    assert mean_loss(out) == pytest.approx(math.log(4 / 3)) and out.num_items.item() == 1
    assert out.metrics['reward_accuracy'].item() == 1 and out.metrics['margin'].item() == pytest.approx(math.log(3))
    # The same reference per token, from the model, or as per-pair sums.
    outputs['ref_logps'] = torch.tensor([[0.0, math.log(0.25)], [0.0, math.log(0.5)]])
    assert mean_loss(DPOLoss(beta=1.0)(inputs, outputs)) == pytest.approx(math.log(4 / 3))
    pairs = DPOLoss(beta=1.0)(inputs, outputs, ref_chosen_logps=[ref[0]], ref_rejected_logps=[ref[1]])
    assert mean_loss(pairs) == pytest.approx(math.log(4 / 3))
    # beta = 0.5: -log sigmoid(0.5 ln 3) = ln(1 + 3^-0.5); ipo: (ln 3 - 1)^2; hinge: max(0, 1 - 0.5 ln 3)
    assert mean_loss(DPOLoss(beta=0.5)(inputs, outputs)) == pytest.approx(math.log(1 + 3**-0.5))
    assert mean_loss(DPOLoss(beta=0.5, loss_type='ipo')(inputs, outputs)) == pytest.approx((math.log(3) - 1) ** 2)
    assert mean_loss(DPOLoss(beta=0.5, loss_type='hinge')(inputs, outputs)) == pytest.approx(1 - 0.5 * math.log(3))
    # label smoothing 0.1: 0.9 ln(1 + 1/3) + 0.1 ln(1 + 3)
    smoothed = DPOLoss(beta=1.0, label_smoothing=0.1)(inputs, outputs)
    assert mean_loss(smoothed) == pytest.approx(0.9 * math.log(4 / 3) + 0.1 * math.log(4))


def test_dpo_reference_free_and_its_gradient():
    inputs, outputs = dpo_pair()
    loss = DPOLoss(beta=1.0, reference_free=True)
    assert not loss.needs_reference and DPOLoss().needs_reference
    out = loss(inputs, outputs)
    # h = ln 1.5: -log sigmoid(ln 1.5) = ln(1 + 2/3)
    assert mean_loss(out) == pytest.approx(math.log(5 / 3))
    out.loss.backward()
    # dL/dh = -(1 - sigmoid(h)) = -(1 - 0.6) = -0.4; h = pc - pr, so the chosen token is pushed
    # up with weight 0.4 and the rejected one down with weight 0.4 (REINFORCE form, w = -dL/dlogp).
    weight = torch.tensor([[0.0, 0.4], [0.0, -0.4]])
    assert torch.allclose(outputs['logits'].grad, reinforce_grad(outputs['logits'], inputs['labels'], weight))


def test_dpo_refuses_odd_batches_and_a_missing_reference():
    inputs, outputs = one_token_rows(3, vocab=2)
    with pytest.raises(DataError, match='3 sequences, an odd number'):
        DPOLoss(reference_free=True)(inputs, outputs)
    inputs, outputs = dpo_pair()
    with pytest.raises(StateError, match=r'DPOLoss\(beta=0.1\) needs reference logprobs'):
        DPOLoss()(inputs, outputs)
    with pytest.raises(DataError, match='together'):
        DPOLoss()(inputs, outputs, ref_chosen_logps=[0.0])
    with pytest.raises(ConfigurationError, match=r"loss_type 'kto'.*\['hinge', 'ipo', 'sigmoid'\]"):
        DPOLoss(loss_type='kto')


# ---- packed == padded ---------------------------------------------------------------------------
def padded_and_packed() -> tuple[tuple[dict, dict], tuple[dict, dict]]:
    # Four sequences of lengths 4, 2, 3, 2 with 3, 1, 2, 1 trained tokens, once padded to width 4
    # and once packed into one row of 11 positions, with the same logits at the real positions.
    torch.manual_seed(1)
    seqs = [[-100, 1, 2, 0], [-100, 2], [-100, 3, 1], [-100, 0]]
    logits = [torch.randn(len(s), 5) for s in seqs]
    padded_labels = torch.full((4, 4), -100)
    padded_logits = torch.randn(4, 4, 5)  # padding positions hold noise that must not matter
    positions, mask = torch.zeros(4, 4, dtype=torch.long), torch.zeros(4, 4, dtype=torch.long)
    for row, (labels, values) in enumerate(zip(seqs, logits, strict=True)):
        padded_labels[row, : len(labels)] = torch.tensor(labels)
        padded_logits[row, : len(labels)] = values
        positions[row, : len(labels)] = torch.arange(len(labels))
        mask[row, : len(labels)] = 1
    padded = (
        {'labels': padded_labels, 'position_ids': positions, 'attention_mask': mask},
        {'logits': padded_logits.requires_grad_()},
    )
    packed = (
        {
            'labels': torch.tensor([[label for s in seqs for label in s]]),
            'position_ids': torch.cat([torch.arange(len(s)) for s in seqs])[None],
        },
        {'logits': torch.cat(logits)[None].requires_grad_()},
    )
    return padded, packed


@pytest.mark.parametrize(
    'loss',
    [
        GRPOLoss(),
        GRPOLoss(loss_type='token_mean', beta=0.05),
        DRGRPOLoss(max_completion_length=4),
        GSPOLoss(epsilon=0.2, epsilon_high=0.2),
        CISPOLoss(epsilon_high=0.1),
    ],
    ids=lambda loss: type(loss).__name__,
)
def test_a_packed_batch_gives_the_padded_batch_loss(loss):
    padded, packed = padded_and_packed()
    assert sequence_index(packed[0]).tolist() == [[0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3]]
    assert sequence_index(padded[0])[:, 0].tolist() == [0, 1, 2, 3]
    kwargs = {
        'advantages': [1.0, -0.5, [0.3, -0.2], 2.0],
        'old_logps': [[-1.5, -1.7, -1.4], [-2.0], [-1.2, -1.9], [-1.6]],
        'ref_logps': [[-1.6, -1.6, -1.6], [-1.6], [-1.6, -1.6], [-1.6]],
    }
    a, b = loss(*padded, **kwargs), loss(*packed, **kwargs)
    assert a.loss.item() == pytest.approx(b.loss.item(), abs=1e-6) and a.num_items.item() == b.num_items.item()
    for key in a.metrics:
        assert a.metrics[key].item() == pytest.approx(b.metrics[key].item(), abs=1e-5), key
    a.loss.backward()
    b.loss.backward()
    real = padded[0]['attention_mask'].bool()
    assert torch.allclose(padded[1]['logits'].grad[real], packed[1]['logits'].grad[0], atol=1e-6)


def test_dpo_packed_equals_padded():
    padded, packed = padded_and_packed()
    ref = [-4.0, -2.5, -3.0, -1.0]
    a, b = DPOLoss()(*padded, ref_logps=ref), DPOLoss()(*packed, ref_logps=ref)
    assert a.loss.item() == pytest.approx(b.loss.item(), abs=1e-6) and b.num_items.item() == 2


def test_sequence_index_ignores_left_padding_and_works_without_positions():
    inputs = {
        'labels': torch.zeros(2, 4, dtype=torch.long),
        'position_ids': torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3]]),
        'attention_mask': torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
    }
    assert sequence_index(inputs).tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]
    assert sequence_index({'labels': torch.zeros(3, 2)}).tolist() == [[0, 0], [1, 1], [2, 2]]


def test_rl_helpers_doctests():
    assert doctest.testmod(twinkle.loss.rl, raise_on_error=False).failed == 0


def test_token_logps_upcasts_and_zeroes_ignored_positions():
    logits = torch.tensor([[[0.0, math.log(3)], [5.0, 5.0]]], dtype=torch.bfloat16)
    out = token_logps(logits, torch.tensor([[1, -100]]))
    assert out.dtype == torch.float32
    assert out[0].tolist() == pytest.approx([math.log(3 / 4), 0.0], abs=1e-2)


# ---- bad inputs ---------------------------------------------------------------------------------
def test_bad_loss_inputs_name_the_input_and_the_lengths():
    inputs, outputs = two_sequences()
    loss = GRPOLoss()
    with pytest.raises(DataError, match=r'old_logps\[0\] has 2 values but sequence 0 has 3 completion.*expected 3'):
        loss(inputs, outputs, advantages=[1.0, 1.0], old_logps=[[-1.0, -1.0], [-1.0]])
    with pytest.raises(DataError, match=r'old_logps\[1\] is a single number'):
        loss(inputs, outputs, advantages=[1.0, 1.0], old_logps=[[-1.0] * 3, -1.0])
    with pytest.raises(DataError, match=r'advantages has 3 entries for 2 sequences'):
        loss(inputs, outputs, advantages=[1.0, 1.0, 1.0])
    with pytest.raises(DataError, match=r'advantages\[1\] is nan'):
        loss(inputs, outputs, advantages=[1.0, float('nan')])
    with pytest.raises(DataError, match=r'old_logps\[0\]\[2\] is inf'):
        loss(inputs, outputs, advantages=[1.0, 1.0], old_logps=[[-1.0, -1.0, float('inf')], [-1.0]])
    with pytest.raises(DataError, match='GRPOLoss needs advantages='):
        loss(inputs, outputs)
    with pytest.raises(ConfigurationError, match=r"unknown loss inputs \['advantage'\].*\['advantages', 'old_logps'"):
        loss(inputs, outputs, advantage=[1.0, 1.0])
    message = r'GRPOLoss\(beta=0.1\) needs reference logprobs: train a LoRA adapter .* or pass ref_logps='
    with pytest.raises(StateError, match=message):
        GRPOLoss(beta=0.1)(inputs, outputs, advantages=[1.0, 1.0])


def test_a_nan_in_a_per_token_tensor_counts_only_where_trained():
    inputs, outputs = two_sequences()
    old = torch.full((2, 4), -LN4)
    old[1, 3] = float('nan')  # an ignored position: harmless
    assert mean_loss(GRPOLoss()(inputs, outputs, advantages=[1.0, 1.0], old_logps=old)) == pytest.approx(-1.0)
    old[0, 2] = float('nan')
    with pytest.raises(DataError, match=r'old_logps\[0, 2\] is nan'):
        GRPOLoss()(inputs, outputs, advantages=[1.0, 1.0], old_logps=old)


def test_bad_configurations_are_refused():
    with pytest.raises(ConfigurationError, match=r"loss_type 'dapo'.*\['drgrpo', 'grpo', 'token_mean'\]"):
        GRPOLoss(loss_type='dapo')
    with pytest.raises(ConfigurationError, match='max_completion_length'):
        GRPOLoss(loss_type='drgrpo')
    with pytest.raises(ConfigurationError, match='epsilon must be a finite number > 0; got 0'):
        GRPOLoss(epsilon=0)
    with pytest.raises(ConfigurationError, match='beta must be a finite number >= 0'):
        GRPOLoss(beta=-0.1)
    assert LOSSES.get('GSPOLoss') is GSPOLoss and 'DPOLoss' in LOSSES


def test_align_per_token_broadcasts_and_scatters():
    mask = torch.tensor([[False, True, True], [False, True, False]])
    seq = torch.tensor([[0, 0, 0], [1, 1, 1]])
    assert align_per_token(torch.tensor([2.0, -1.0]), mask, seq, 'a').tolist() == [[0, 2, 2], [0, -1, 0]]
    assert align_per_token([[0.5, 1.5], 3.0], mask, seq, 'a').tolist() == [[0, 0.5, 1.5], [0, 3, 0]]


# ---- GRPOMetric ---------------------------------------------------------------------------------
def test_grpo_metric_divides_sums_across_micro_batches():
    metric = GRPOMetric()
    # Micro-batch 1: four one-token rows, ratios 1.5, 1.1, 0.5, 1.5 (2 clipped, as above), a
    # reference at ln 2 above the policy (k3 = 1 - ln 2 per token), entropy ln 4 per token.
    inputs, outputs = one_token_rows(4)
    old = [[-LN4 - math.log(r)] for r in (1.5, 1.1, 0.5, 1.5)]
    ref = [[-LN4 + math.log(2)]] * 4
    loss = GRPOLoss(beta=0.1)
    metric.accumulate(
        inputs=inputs,
        outputs=outputs,
        loss=loss(inputs, outputs, advantages=[1.0, 1.0, -1.0, -1.0], old_logps=old, ref_logps=ref),
    )
    # Micro-batch 2: two sequences, 4 tokens, on-policy (ratio 1, nothing clipped), reference equal
    # to the policy (KL 0), entropy ln 4.
    inputs, outputs = two_sequences()
    metric.accumulate(
        inputs=inputs,
        outputs=outputs,
        loss=loss(inputs, outputs, advantages=[1.0, 1.0], ref_logps=torch.full((2, 4), -LN4)),
    )
    metric.accumulate(inputs=inputs, outputs=outputs, loss=None)
    result = metric.calculate()
    # 8 tokens in all: 2 clipped, KL 4 (1 - ln 2), ratio 4.6 + 4. The sampler's figures cover
    # micro-batch 1's 4 tokens only: sampler - trainer logp = -ln r, importance weights w = r.
    ratios = (1.5, 1.1, 0.5, 1.5)
    assert result == pytest.approx(
        {
            'clip_frac': 2 / 8,
            'kl': 4 * (1 - math.log(2)) / 8,
            'entropy': LN4,
            'ratio': (4.6 + 4) / 8,
            'kl_sample_train_v1': -sum(math.log(r) for r in ratios) / 4,
            'kl_sample_train_v2': 0.5 * sum(math.log(r) ** 2 for r in ratios) / 4,
            'is_weight_mean': 4.6 / 4,
            'is_weight_std': math.sqrt(5.96 / 4 - (4.6 / 4) ** 2),
            'is_weight_min': 0.5,
            'is_weight_max': 1.5,
        }
    )
    metric.reset()
    assert metric.calculate() == {}


def test_grpo_metric_reports_dpo_pairs():
    metric = GRPOMetric()
    inputs, outputs = dpo_pair()
    metric.accumulate(inputs=inputs, outputs=outputs, loss=DPOLoss(beta=1.0, reference_free=True)(inputs, outputs))
    assert metric.calculate() == pytest.approx({'reward_accuracy': 1.0, 'margin': math.log(1.5)})
