"""The Tinker built-in losses on datums worked out by hand, their gradients, padded and packed
batches, the model's sum semantics, and every refusal."""

from __future__ import annotations

import doctest
import math
from typing import Any

import pytest
import torch

import twinkle.loss.tinker
from twinkle.errors import ConfigurationError, DataError, UnknownNameError
from twinkle.loss.tinker import TINKER_LOSSES, TinkerLoss, tinker_loss_terms

LN2, LN4, LN5 = math.log(2), math.log(4), math.log(5)
E01 = math.exp(0.1)


def vec(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def leaf(*values: float) -> torch.Tensor:
    return vec(*values).requires_grad_()


def grad_of(loss: torch.Tensor, logprobs: torch.Tensor) -> list[float]:
    (grad,) = torch.autograd.grad(loss, logprobs)
    return grad.tolist()


def approx(values: list[float]) -> object:
    return pytest.approx(values, abs=1e-5)


def tinker_loss(*args: Any) -> torch.Tensor:
    """The loss sum alone: most tests below check a loss by its sum."""
    return tinker_loss_terms(*args).loss


def test_docstring_examples_run():
    assert doctest.testmod(twinkle.loss.tinker).failed == 0


# ---- each loss on a datum worked out by hand ----------------------------------------------------
def test_cross_entropy_takes_any_real_weights_and_its_gradient_is_minus_the_weights():
    lp = leaf(-1.0, -2.0, -0.5)
    loss = tinker_loss('cross_entropy', lp, {'weights': vec(1.0, 0.5, -2.0)})
    # -(-1 * 1 + -2 * 0.5 + -0.5 * -2) = -(-1 - 1 + 1) = 1
    assert loss.item() == pytest.approx(1.0)
    # d/dlp -(lp * w) = -w
    assert grad_of(loss, lp) == approx([-1.0, -0.5, 2.0])


def test_importance_sampling_at_ratio_one_is_minus_the_sum_of_advantages():
    lp = leaf(-0.7, -1.3, -2.0)
    advantages = vec(0.5, -1.0, 2.0)
    loss = tinker_loss('importance_sampling', lp, {'logprobs': lp.detach().clone(), 'advantages': advantages})
    # exp(0) = 1 everywhere: -(0.5 - 1 + 2) = -1.5
    assert loss.item() == pytest.approx(-1.5)
    # d/dlp -(exp(lp - lp_old) * A) = -ratio * A = -A
    assert grad_of(loss, lp) == approx([-0.5, 1.0, -2.0])


def test_importance_sampling_weights_each_advantage_by_its_ratio():
    lp = vec(-1.0, -1.0 + LN2)
    loss = tinker_loss('importance_sampling', lp, {'logprobs': vec(-1.0, -1.0), 'advantages': vec(1.0, -1.0)})
    # ratios 1 and 2: -(1 * 1 + 2 * -1) = 1
    assert loss.item() == pytest.approx(1.0)


def ppo_datum() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    # Ratios 1.5, 1.5, 0.5, 0.5 against the sampler, advantages +1, -1, -1, +1.
    lp = leaf(*(-1.0 + math.log(r) for r in (1.5, 1.5, 0.5, 0.5)))
    return lp, {'logprobs': vec(-1.0, -1.0, -1.0, -1.0), 'advantages': vec(1.0, -1.0, -1.0, 1.0)}


def test_ppo_clips_only_the_side_that_would_overshoot():
    lp, inputs = ppo_datum()
    loss, metrics = tinker_loss_terms('ppo', lp, inputs)  # defaults 0.8 / 1.2
    # r=1.5, A=+1: min(1.5, 1.2) = 1.2     (clipped: no gradient)
    # r=1.5, A=-1: min(-1.5, -1.2) = -1.5  (unclipped)
    # r=0.5, A=-1: min(-0.5, -0.8) = -0.8  (clipped: no gradient)
    # r=0.5, A=+1: min(0.5, 0.8) = 0.5     (unclipped)
    # loss = -(1.2 - 1.5 - 0.8 + 0.5) = 0.6
    assert loss.item() == pytest.approx(0.6, abs=1e-6)
    assert metrics['clipped:sum'].item() == 2
    assert metrics['loss:sum'].item() == pytest.approx(0.6, abs=1e-6)
    # Unclipped tokens: d/dlp -(r * A) = -r * A, i.e. 1.5 and -0.5; clipped tokens: 0.
    assert grad_of(loss, lp) == approx([0.0, 1.5, 0.0, -0.5])


def test_ppo_reads_its_thresholds_from_the_config():
    lp = vec(-1.0 + math.log(1.5), -1.0 + math.log(1.05))
    inputs = {'logprobs': vec(-1.0, -1.0), 'advantages': vec(1.0, 1.0)}
    loss = tinker_loss('ppo', lp, inputs, {'clip_low_threshold': 0.9, 'clip_high_threshold': 1.1})
    # min(1.5, 1.1) + min(1.05, 1.1) = 1.1 + 1.05
    assert loss.item() == pytest.approx(-2.15, abs=1e-6)
    # With the defaults (1.2) the first token would give 1.2 instead.
    assert tinker_loss('ppo', lp, inputs).item() == pytest.approx(-2.25, abs=1e-6)


def test_ppo_on_policy_is_minus_the_sum_of_advantages():
    lp = vec(-0.3, -2.2, -1.0)
    assert tinker_loss('ppo', lp, {'logprobs': lp, 'advantages': vec(2.0, -1.0, 0.5)}).item() == pytest.approx(-1.5)


def test_per_token_thresholds_override_the_config():
    lp = vec(-1.0 + math.log(1.25), -1.0 + math.log(1.25))
    inputs = {'logprobs': vec(-1.0, -1.0), 'advantages': vec(1.0, 1.0), 'clip_high_threshold': vec(1.1, 1.3)}
    # Token 0 capped at 1.1; token 1's cap 1.3 does not bind: -(1.1 + 1.25)
    assert tinker_loss('ppo', lp, inputs).item() == pytest.approx(-2.35, abs=1e-6)


def test_cispo_truncates_the_weight_but_keeps_every_gradient():
    lp = leaf(-1.0, -2.0)
    inputs = {'logprobs': vec(-1.0 - LN5, -2.0), 'advantages': vec(1.0, -0.5)}
    loss, metrics = tinker_loss_terms('cispo', lp, inputs)  # defaults 0 / 4
    # ratios 5 and 1; weights min(5, 4) = 4 and 1.
    # loss = -(4 * -1 * 1 + 1 * -2 * -0.5) = -(-4 + 1) = 3
    assert loss.item() == pytest.approx(3.0, abs=1e-5)
    assert metrics['clipped:sum'].item() == 1
    # The weight is detached: d/dlp = -w * A = -4 and 0.5 (the truncated token still learns).
    assert grad_of(loss, lp) == approx([-4.0, 0.5])


def test_cispo_clips_the_low_side_only_when_asked():
    lp = leaf(-1.0, -1.0)
    inputs = {'logprobs': vec(-1.0 - LN5, -1.0 + LN2), 'advantages': vec(1.0, 1.0)}  # ratios 5 and 0.5
    loss = tinker_loss('cispo', lp, inputs, {'clip_low_threshold': 0.8, 'clip_high_threshold': 1.2})
    # weights 1.2 and 0.8: -(1.2 * -1 + 0.8 * -1) = 2
    assert loss.item() == pytest.approx(2.0, abs=1e-5)
    assert grad_of(loss, lp) == approx([-1.2, -0.8])
    # The default low threshold is 0: the 0.5 weight stays, -(0.5 * -1 * 1) = 0.5
    only_low = {'logprobs': vec(-1.0 + LN2), 'advantages': vec(1.0)}
    assert tinker_loss('cispo', vec(-1.0), only_low).item() == pytest.approx(0.5, abs=1e-5)


def test_dro_subtracts_a_quadratic_penalty_even_where_the_advantage_is_zero():
    lp = leaf(-1.0, -2.0)
    inputs = {'logprobs': vec(-1.5, -1.0), 'advantages': vec(2.0, 0.0)}
    loss = tinker_loss('dro', lp, inputs, {'beta': 0.5})
    # token 0: -1 * 2 - 0.5 * 0.5 * (0.5)^2 = -2.0625
    # token 1:  0     - 0.5 * 0.5 * (-1)^2 = -0.25
    # loss = -(-2.0625 - 0.25) = 2.3125
    assert loss.item() == pytest.approx(2.3125, abs=1e-6)
    # d/dlp = -(A - beta * (lp - lp_old)): -(2 - 0.25) = -1.75 and -(0 + 0.5) = -0.5
    assert grad_of(loss, lp) == approx([-1.75, -0.5])


def test_dro_default_beta_is_0_05():
    # 0.5 * 0.05 * (-1 - -2)^2 = 0.025
    loss = tinker_loss('dro', vec(-1.0), {'logprobs': vec(-2.0), 'advantages': vec(0.0)})
    assert loss.item() == pytest.approx(0.025, abs=1e-7)


def test_gspo_uses_the_geometric_mean_ratio_of_the_datum():
    lp = vec(-1.0, -1.0)
    inputs = {'logprobs': vec(-1.1, -0.9), 'advantages': vec(1.0, 1.0)}
    loss, metrics = tinker_loss_terms('gspo', lp, inputs)
    # token log-ratios +0.1 and -0.1 average to 0: s = 1, inside even the tight default clip,
    # loss = -(1 + 1)
    assert loss.item() == pytest.approx(-2.0, abs=1e-6)
    assert metrics['clipped:sum'].item() == 0
    # Token by token, PPO with the same thresholds clips the first token at 1.0004 and keeps
    # e^-0.1 for the second: -(1.0004 + 0.904837)
    ppo_config = {'clip_low_threshold': 1 - 3e-4, 'clip_high_threshold': 1 + 4e-4}
    assert tinker_loss('ppo', lp, inputs, ppo_config).item() == pytest.approx(-1.905237, abs=1e-5)


def test_gspo_gradient_is_the_sequence_ratio_times_each_tokens_own():
    lp = leaf(-1.0, -1.0)
    inputs = {'logprobs': vec(-1.2, -1.0), 'advantages': vec(1.0, 2.0)}
    loss = tinker_loss('gspo', lp, inputs, {'clip_low_threshold': 0.8, 'clip_high_threshold': 1.2})
    # s = exp(mean(0.2, 0)) = e^0.1 = 1.105171, inside [0.8, 1.2]: loss = -s * (1 + 2)
    assert loss.item() == pytest.approx(-3 * E01, abs=1e-5)
    # GSPO-token: each token carries sg(s) * exp(lp_t - sg(lp_t)), so d/dlp_t = -s * A_t
    assert grad_of(loss, lp) == approx([-E01, -2 * E01])


def test_gspo_clips_the_whole_sequence_at_the_default_thresholds():
    lp = leaf(-1.0, -1.0)
    inputs = {'logprobs': vec(-1.2, -1.0), 'advantages': vec(1.0, 2.0)}
    loss, metrics = tinker_loss_terms('gspo', lp, inputs)
    # s = e^0.1 > 1 + 4e-4 with A > 0: both tokens take the clipped 1.0004, loss = -1.0004 * 3
    assert loss.item() == pytest.approx(-3.0012, abs=1e-5)
    assert metrics['clipped:sum'].item() == 2
    assert grad_of(loss, lp) == approx([0.0, 0.0])


def test_gspo_sequence_ratio_mask_picks_the_tokens_of_the_ratio():
    # A prompt position (sampler log-prob placeholder 0, advantage 0) and two sampled tokens.
    lp = vec(-3.0, -1.0, -1.0)
    inputs = {'logprobs': vec(0.0, -1.2, -1.0), 'advantages': vec(0.0, 1.0, 2.0)}
    config = {'clip_low_threshold': 0.8, 'clip_high_threshold': 1.2}
    masked = tinker_loss('gspo', lp, {**inputs, 'sequence_ratio_mask': vec(0.0, 1.0, 1.0)}, config)
    # Over the sampled tokens: s = exp(mean(0.2, 0)) = e^0.1, loss = -e^0.1 * 3
    assert masked.item() == pytest.approx(-3 * E01, abs=1e-5)
    # Without the mask the prompt position joins: s = exp((-3 + 0.2 + 0) / 3) = 0.3932, below
    # 0.8 with A > 0, so min(s A, 0.8 A) = s A: loss = -0.3932 * 3
    unmasked = tinker_loss('gspo', lp, inputs, config)
    assert unmasked.item() == pytest.approx(-3 * math.exp(-2.8 / 3), abs=1e-5)


def test_gspo_takes_one_ratio_per_sequence_id():
    lp = vec(-1.0, -1.0, -1.0, -1.0)
    inputs = {
        'logprobs': vec(-1.1, -1.1, -0.8, -0.5),
        'advantages': vec(1.0, 1.0, 1.0, 1.0),
        'sequence_ratio_mask': vec(1.0, 1.0, 1.0, 0.0),
    }
    config = {'clip_low_threshold': 0.5, 'clip_high_threshold': 2.0}
    # Sequence 7: log-ratios 0.1, 0.1 -> s = e^0.1 on 2 tokens. Sequence 3: log-ratio -0.2 at
    # its one masked token -> s = e^-0.2 on 2 tokens (the unmasked one carries it too).
    expected = -(2 * E01 + 2 * math.exp(-0.2))
    assert tinker_loss('gspo', lp, inputs, config, torch.tensor([7, 7, 3, 3])).item() == pytest.approx(expected)
    # A sequence with no masked token has s = 1.
    none_masked = {**inputs, 'sequence_ratio_mask': vec(0.0, 0.0, 1.0, 0.0)}
    expected = -(2 * 1.0 + 2 * math.exp(-0.2))
    assert tinker_loss('gspo', lp, none_masked, config, torch.tensor([0, 0, 1, 1])).item() == pytest.approx(expected)


# ---- TinkerLoss on batches ------------------------------------------------------------------------
def uniform_batch(lengths: list[int], vocab: int = 4) -> tuple[dict, dict]:
    """Right-padded rows whose logits are all 0: every label has logp = -ln(vocab)."""
    width = max(lengths)
    labels = torch.full((len(lengths), width), -100)
    for row, length in enumerate(lengths):
        labels[row, :length] = torch.arange(length) % vocab
    attention = (labels != -100).long()
    return {'labels': labels, 'attention_mask': attention}, {'logits': torch.zeros(len(lengths), width, vocab)}


def test_tinker_loss_sums_over_every_position_of_every_datum():
    inputs, outputs = uniform_batch([3, 1])
    out = TinkerLoss('cross_entropy')(inputs, outputs, weights=[[1.0, 1.0, -1.0], [2.0]])
    # lp = -ln 4 everywhere: -(-ln 4) * (1 + 1 - 1 + 2) = 3 ln 4
    assert out.loss.item() == pytest.approx(3 * LN4, abs=1e-5)
    assert out.num_items.shape == () and out.num_items.item() == 0  # a sum: nothing to divide by
    assert out.metrics['loss:sum'].shape == () and not out.metrics['loss:sum'].requires_grad
    assert out.metrics['loss:sum'].item() == pytest.approx(3 * LN4, abs=1e-5)


def random_datums(seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    datums = []
    for length in (3, 5):
        datums.append(
            {
                'logits': torch.randn(length, 7, generator=generator),
                'targets': torch.randint(0, 7, (length,), generator=generator),
                'logprobs': (-torch.rand(length, generator=generator) * 3).tolist(),
                'advantages': torch.randn(length, generator=generator).tolist(),
                'sequence_ratio_mask': [0.0] + [1.0] * (length - 1),
                'weights': torch.randn(length, generator=generator).tolist(),
                'recorded_logprobs': (-torch.rand(length, generator=generator) * 3).tolist(),
                'recorded_mask': [float(i % 3 != 1) for i in range(length)],
            }
        )
    return datums


def loss_inputs(loss_fn: str, datums: list[dict]) -> dict[str, list]:
    spec = TINKER_LOSSES[loss_fn]
    names = [*spec.required, *(n for n in spec.optional if n == 'sequence_ratio_mask')]
    return {name: [d[name] for d in datums] for name in names}


def run_padded(loss_fn: str, config: dict, datums: list[dict]) -> tuple[float, list[torch.Tensor]]:
    width = max(len(d['targets']) for d in datums)
    logits = torch.zeros(len(datums), width, 7)
    labels = torch.full((len(datums), width), -100)
    for row, d in enumerate(datums):
        logits[row, : len(d['targets'])] = d['logits']
        labels[row, : len(d['targets'])] = d['targets']
    logits.requires_grad_()
    inputs = {'labels': labels, 'attention_mask': (labels != -100).long()}
    out = TinkerLoss(loss_fn, config)(inputs, {'logits': logits}, **loss_inputs(loss_fn, datums))
    out.loss.backward()
    return out.loss.item(), [logits.grad[row, : len(d['targets'])] for row, d in enumerate(datums)]


def run_packed(loss_fn: str, config: dict, datums: list[dict]) -> tuple[float, list[torch.Tensor]]:
    logits = torch.cat([d['logits'] for d in datums])[None].requires_grad_()
    inputs = {
        'labels': torch.cat([d['targets'] for d in datums])[None],
        'position_ids': torch.cat([torch.arange(len(d['targets'])) for d in datums])[None],
    }
    out = TinkerLoss(loss_fn, config)(inputs, {'logits': logits}, **loss_inputs(loss_fn, datums))
    out.loss.backward()
    return out.loss.item(), list(logits.grad[0].split([len(d['targets']) for d in datums]))


CONFIGS = {
    'cross_entropy': {},
    'importance_sampling': {},
    'ppo': {'clip_low_threshold': 0.5, 'clip_high_threshold': 1.5},
    'cispo': {},
    'dro': {'beta': 0.3},
    'gspo': {'clip_low_threshold': 0.7, 'clip_high_threshold': 1.3},
    'stable_reinforce': {'ratio_cap': 1.5, 'kl_coeff': 0.2},
}


@pytest.mark.parametrize('loss_fn', sorted(CONFIGS))
def test_padded_and_packed_batches_give_the_sum_of_each_datum_alone(loss_fn):
    assert set(CONFIGS) == set(TINKER_LOSSES)
    datums = random_datums()
    alone = [run_padded(loss_fn, CONFIGS[loss_fn], [d]) for d in datums]
    expected_loss = sum(loss for loss, _ in alone)
    expected_grads = [grads[0] for _, grads in alone]
    for loss, grads in (run_padded(loss_fn, CONFIGS[loss_fn], datums), run_packed(loss_fn, CONFIGS[loss_fn], datums)):
        assert loss == pytest.approx(expected_loss, abs=1e-5)
        for grad, expected in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(grad, expected, rtol=0, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in expected_grads)  # the comparison is not between zeros


def test_batch_loss_matches_the_flat_formula():
    datums = random_datums(seed=1)
    loss, _ = run_padded('ppo', CONFIGS['ppo'], datums)
    lp = torch.cat([d['logits'].log_softmax(-1).gather(-1, d['targets'][:, None])[:, 0] for d in datums])
    flat = {name: vec(*(v for d in datums for v in d[name])) for name in ('logprobs', 'advantages')}
    assert loss == pytest.approx(tinker_loss('ppo', lp, flat, CONFIGS['ppo']).item(), abs=1e-5)


def test_target_tokens_may_be_passed_and_must_match_the_labels():
    inputs, outputs = uniform_batch([3, 3])  # labels 0, 1, 2 in both rows
    weights = [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    out = TinkerLoss('cross_entropy')(inputs, outputs, weights=weights, target_tokens=[[0, 1, 2], [0, 1, 2]])
    assert out.loss.item() == pytest.approx(6 * LN4, abs=1e-5)
    with pytest.raises(DataError, match=r'target_tokens\[1\]\[2\] is 3 but the batch labels have 2'):
        TinkerLoss('cross_entropy')(inputs, outputs, weights=weights, target_tokens=[[0, 1, 2], [0, 1, 3]])


# ---- the model: sums, not means -------------------------------------------------------------------
def test_model_accumulates_plain_sums_across_calls(tiny_model_dir):
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    torch.manual_seed(0)
    model = TransformersModel(model_id=tiny_model_dir)
    model.add_adapter_to_model('default', LoraConfig(r=4, target_modules='all-linear', init_lora_weights=False))
    model.set_optimizer('AdamW', lr=1e-3)
    model.set_loss(TinkerLoss('importance_sampling'))
    # Two datums of 3 and 5 positions; labels are the target tokens at every position.
    rows = [
        {'input_ids': [5, 17, 29], 'labels': [17, 29, 41]},
        {'input_ids': [7, 8, 9, 10, 11], 'labels': [8, 9, 10, 11, 12]},
    ]
    logps = model.forward_only(inputs=rows).logps
    sampler = [logps[0, :3].tolist(), logps[1, :5].tolist()]
    advantages = [[1.0, 2.0, 3.0], [-1.0, 0.0, 1.0, 0.0, 2.0]]
    out = model.forward_backward(inputs=rows, logprobs=sampler, advantages=advantages)
    # On-policy, every ratio is 1: loss = -(1 + 2 + 3 - 1 + 0 + 1 + 0 + 2) = -8, undivided.
    assert out.loss == pytest.approx(-8.0, abs=1e-4)
    params = [p for p in model.model.parameters() if p.requires_grad]
    once = [p.grad.clone() for p in params]
    model.forward_backward(inputs=rows, logprobs=sampler, advantages=advantages, micro_batch_size=1)
    model.clip_grad_norm(max_grad_norm=1e9)  # divides by the step's item count, clamped at 1
    # atol: float32 sums over differently padded batches (one row vs two) differ near 1e-5.
    for param, first in zip(params, once, strict=True):
        torch.testing.assert_close(param.grad, 2 * first, rtol=1e-3, atol=1e-4)
    assert any(g.abs().sum() > 0 for g in once)


# ---- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize('name', ['grpo', 'PPO', '', 42, None])
def test_an_unknown_loss_name_lists_the_supported_ones(name):
    with pytest.raises(UnknownNameError) as raised:
        TinkerLoss(name)
    assert repr(name) in str(raised.value) and 'importance_sampling' in str(raised.value)


@pytest.mark.parametrize(('name', 'reason'), [('custom', 'forward_backward_custom')])
def test_known_but_unsupported_losses_say_why(name, reason):
    with pytest.raises(ConfigurationError) as raised:
        TinkerLoss(name)
    message = str(raised.value)
    assert repr(name) in message and reason in message and "'gspo'" in message


def test_an_unknown_config_key_lists_the_accepted_ones():
    with pytest.raises(ConfigurationError, match=r"ppo got unknown loss_fn_config keys \['beta'\]") as raised:
        TinkerLoss('ppo', {'beta': 0.1})
    assert "['clip_high_threshold', 'clip_low_threshold']" in str(raised.value)
    with pytest.raises(ConfigurationError, match=r"unknown loss_fn_config keys \['beta'\]. It takes no keys"):
        TinkerLoss('cross_entropy', {'beta': 0.1})
    with pytest.raises(ConfigurationError, match='must be a mapping; got list'):
        TinkerLoss('dro', [('beta', 0.1)])


@pytest.mark.parametrize('value', [float('nan'), float('inf'), '0.1', True, None])
def test_a_config_value_must_be_a_finite_number(value):
    with pytest.raises(ConfigurationError) as raised:
        TinkerLoss('dro', {'beta': value})
    assert f"loss_fn_config['beta'] must be a finite number; got {value!r}" in str(raised.value)


@pytest.mark.parametrize(
    ('loss_fn', 'config', 'message'),
    [
        ('ppo', {'clip_low_threshold': 1.3}, 'clip_low_threshold=1.3, clip_high_threshold=1.2'),
        ('cispo', {'clip_low_threshold': -0.1}, 'clip_low_threshold=-0.1'),
        ('dro', {'beta': -1.0}, 'beta must be >= 0; got -1.0'),
    ],
)
def test_config_values_out_of_range_are_refused(loss_fn, config, message):
    with pytest.raises(ConfigurationError) as raised:
        TinkerLoss(loss_fn, config)
    assert message in str(raised.value)


def test_a_missing_input_is_named():
    inputs, outputs = uniform_batch([2])
    with pytest.raises(DataError, match=r"ppo needs the loss inputs \['logprobs'\]"):
        TinkerLoss('ppo')(inputs, outputs, advantages=[[1.0, 1.0]])
    with pytest.raises(DataError, match=r"cross_entropy needs the loss inputs \['weights'\]"):
        TinkerLoss('cross_entropy')(inputs, outputs, weights=None)
    with pytest.raises(DataError, match=r"gspo needs the loss inputs \['advantages'\]"):
        tinker_loss('gspo', vec(-1.0), {'logprobs': vec(-1.0)})


def test_an_input_the_loss_does_not_read_is_refused():
    inputs, outputs = uniform_batch([2])
    rl = {'logprobs': [[-1.0, -1.0]], 'advantages': [[1.0, 1.0]]}
    with pytest.raises(ConfigurationError, match=r"dro got unknown loss inputs \['weights'\]") as raised:
        TinkerLoss('dro')(inputs, outputs, weights=[[1.0, 1.0]], **rl)
    assert "'advantages'" in str(raised.value) and "'logprobs'" in str(raised.value)
    with pytest.raises(ConfigurationError, match=r"unknown loss inputs \['sequence_ratio_mask'\]"):
        TinkerLoss('ppo')(inputs, outputs, sequence_ratio_mask=[[1.0, 1.0]], **rl)


def test_per_datum_inputs_must_have_one_finite_value_per_position():
    inputs, outputs = uniform_batch([2, 3])
    loss = TinkerLoss('importance_sampling')
    sampler = [[-1.0, -1.0], [-1.0, -1.0, -1.0]]
    with pytest.raises(DataError, match=r'advantages\[1\] has 2 values but sequence 1 has 3'):
        loss(inputs, outputs, logprobs=sampler, advantages=[[1.0, 1.0], [1.0, 1.0]])
    with pytest.raises(DataError, match=r'advantages\[0\] is a single number'):
        loss(inputs, outputs, logprobs=sampler, advantages=[1.0, [1.0, 1.0, 1.0]])
    with pytest.raises(DataError, match=r'advantages has 1 entries for 2 sequences'):
        loss(inputs, outputs, logprobs=sampler, advantages=[[1.0, 1.0]])
    with pytest.raises(DataError, match=r'logprobs\[1\]\[2\] is nan'):
        loss(inputs, outputs, logprobs=[[-1.0, -1.0], [-1.0, -1.0, float('nan')]], advantages=[[0.0] * 2, [0.0] * 3])


def test_flat_inputs_must_match_the_logprobs():
    lp = vec(-1.0, -1.0)
    with pytest.raises(DataError, match=r"input 'advantages' must be a tensor of shape \(2,\); got \(3,\)"):
        tinker_loss('importance_sampling', lp, {'logprobs': lp, 'advantages': vec(1.0, 1.0, 1.0)})
    with pytest.raises(DataError, match=r"input 'sequence_ids' must be a tensor of shape \(2,\); got list"):
        tinker_loss('gspo', lp, {'logprobs': lp, 'advantages': lp}, None, [0, 0])
    with pytest.raises(DataError, match=r'logprobs must be 1-D \(positions\); got shape \(1, 2\)'):
        tinker_loss('importance_sampling', lp[None], {'logprobs': lp, 'advantages': lp})
    with pytest.raises(DataError, match=r'input advantages\[1\] is inf'):
        tinker_loss('importance_sampling', lp, {'logprobs': lp, 'advantages': vec(0.0, math.inf)})


def test_per_token_thresholds_must_be_ordered():
    lp = vec(-1.0, -1.0)
    inputs = {'logprobs': lp, 'advantages': lp, 'clip_low_threshold': vec(0.8, 1.5)}
    with pytest.raises(DataError, match=r'position 1 are clip_low_threshold=1.5, clip_high_threshold=1.2'):
        tinker_loss('ppo', lp, inputs)
