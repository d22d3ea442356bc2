"""PPO with a critic: GAE and the clipped value loss by hand, and a value-head adapter that
trains beside a policy adapter on one base model (twinkle.model.output.value_head)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from twinkle import assets
from twinkle.advantage import gae, per_sequence, token_rewards
from twinkle.errors import CheckpointError, ConfigurationError, DataError, StateError
from twinkle.loss import LOSSES, ValueLoss
from twinkle.model import AdapterCall, TransformersModel
from twinkle.model.output.value_head import VALUE_HEAD_WEIGHTS

IGN = -100


def close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-6, rtol=1e-6)


# ---- GAE --------------------------------------------------------------------------------------
def test_gae_by_hand_skips_unmasked_positions():
    # Row 0: a prompt position, then 3 completion tokens with the reward 1 on the last.
    #   gamma = 0.9, lam = 0.5, so gamma * lam = 0.45; V = 0.5, 0.6, 0.7 (the 9 is a prompt's, unread)
    #   t3: delta = 1 + 0.9 * 0 - 0.7 = 0.3                  A = 0.3
    #   t2: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03               A = 0.03 + 0.45 * 0.3 = 0.165
    #   t1: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04               A = 0.04 + 0.45 * 0.165 = 0.11425
    #   returns = A + V = 0.61425, 0.765, 1.0
    # Row 1: completion tokens at 0 and 2 (position 1 is an environment's, unmasked: skipped).
    #   t2: delta = 1 - 0.4 = 0.6                             A = 0.6
    #   t0: delta = 0 + 0.9 * 0.4 - 0.2 = 0.16                A = 0.16 + 0.45 * 0.6 = 0.43
    #   returns = 0.63, 1.0
    mask = torch.tensor([[0, 1, 1, 1], [1, 0, 1, 0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 5.0, 1.0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7], [0.2, 99.0, 0.4, 99.0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    close(advantages, [[0, 0.11425, 0.165, 0.3], [0.43, 0, 0.6, 0]])
    close(returns, [[0, 0.61425, 0.765, 1.0], [0.63, 0, 1.0, 0]])
    assert per_sequence(advantages, mask) == [pytest.approx([0.11425, 0.165, 0.3]), pytest.approx([0.43, 0.6])]
    # lam = 1, gamma = 1: Monte-Carlo return minus the value; lam = 0: the one-step TD error.
    mc, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert mc[0, 1:].tolist() == pytest.approx([0.5, 0.4, 0.3])
    td, _ = gae(rewards, values, mask, gamma=1.0, lam=0.0)
    assert td[0, 1:].tolist() == pytest.approx([0.6 - 0.5, 0.7 - 0.6, 1 - 0.7])


def test_token_rewards_put_the_score_last_and_the_kl_in_the_reward():
    # log-ratios at the completion tokens: -1 - -1.5 = 0.5, 0, -0.5 - -1 = 0.5; kl_coef 0.1.
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    logps = torch.tensor([[0.0, -1.0, -2.0, -0.5, 0.0]])
    ref = torch.tensor([[0.0, -1.5, -2.0, -1.0, 0.0]])
    rewards = token_rewards([1.0], mask, logps=logps, ref_logps=ref, kl_coef=0.1)
    close(rewards, [[0, -0.05, 0, 1 - 0.05, 0]])
    assert token_rewards([2.0], mask).tolist() == [[0, 0, 0, 2.0, 0]]


@pytest.mark.parametrize(
    ('call', 'error', 'match'),
    [
        (lambda r, v, m: gae(r, v, m, gamma=1.5), ConfigurationError, r'gamma must be a number in \[0, 1\]; got 1.5'),
        (lambda r, v, m: gae(r, v, m, lam=-0.1), ConfigurationError, r'lam must be a number in \[0, 1\]; got -0.1'),
        (lambda r, v, m: gae(r, v[:, :2], m), DataError, r'values must be a tensor shaped like the mask \(1, 3\)'),
        (lambda r, v, m: gae(r, v.fill_(float('nan')), m), DataError, r'values\[0, 0\] is nan'),
        (lambda r, v, m: token_rewards([1.0], m, kl_coef=0.1), ConfigurationError, 'pass logps= and ref_logps='),
        (lambda r, v, m: token_rewards([1.0], m, kl_coef=-1.0), ConfigurationError, 'kl_coef must be'),
        (lambda r, v, m: token_rewards([1.0, 2.0], m), DataError, 'scores must be 1 real numbers'),
        (lambda r, v, m: token_rewards([1.0], m * 0), DataError, 'row 0 has no masked'),
        (lambda r, v, m: token_rewards([1.0], m * 2), DataError, 'mask must hold only 0 and 1'),
    ],
)
def test_gae_refuses_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.long))


# ---- the value loss ---------------------------------------------------------------------------
def _value_case():
    # Three trained tokens, value_clip 0.2:
    #   t1: V 0.5, V_old 0,   R 1: (0.5 - 1)^2 = 0.25; clipped V 0.2: (0.2 - 1)^2 = 0.64 -> 0.64 (clipped)
    #   t2: V 1.5, V_old 1.4, R 1: 0.25; 1.5 is within 1.4 +- 0.2: 0.25                   -> 0.25
    #   t3: V -.1, V_old 0,   R 0: 0.01; within 0 +- 0.2: 0.01                            -> 0.01
    # sum / 2 = 0.45 over 3 tokens. Gradient (d/dV of term / 2): t1 0 (the clipped branch is flat
    # in V), t2 V - R = 0.5, t3 -0.1; the prompt position (V = 9) none.
    inputs = {'labels': torch.tensor([[IGN, 5, 6, 7]])}
    values = torch.tensor([[9.0, 0.5, 1.5, -0.1]], requires_grad=True)
    return inputs, values, {'returns': [[1.0, 1.0, 0.0]], 'old_values': [[0.0, 1.4, 0.0]]}


def test_value_loss_by_hand_clips_like_ppo():
    inputs, values, kwargs = _value_case()
    out = LOSSES.build('ValueLoss', ValueLoss, value_clip=0.2)(inputs, {'values': values}, **kwargs)
    assert float(out.loss.detach()) == pytest.approx(0.45)
    assert int(out.num_items) == 3
    assert float(out.metrics['value_error']) == pytest.approx(0.25 + 0.25 + 0.01)
    assert int(out.metrics['value_clipped']) == 1
    out.loss.backward()
    close(values.grad, [[0.0, 0.0, 0.5, -0.1]])
    # No clip (or no old values): the plain squared error / 2; a scalar return fills its sequence.
    inputs, values, kwargs = _value_case()
    plain = ValueLoss(value_clip=None)(inputs, {'values': values}, **kwargs)
    assert float(plain.loss.detach()) == pytest.approx(0.51 / 2)
    scalar = ValueLoss()(inputs, {'values': values}, returns=[1.0])
    assert float(scalar.loss.detach()) == pytest.approx((0.25 + 0.25 + 1.1**2) / 2)


def test_value_loss_refuses_bad_input():
    inputs, values, kwargs = _value_case()
    with pytest.raises(ConfigurationError, match=r'value_clip must be a finite number >= 0.*got -0.1'):
        ValueLoss(value_clip=-0.1)
    with pytest.raises(StateError, match=r"needs the critic's values"):
        ValueLoss()(inputs, {'logits': torch.zeros(1, 4, 8)}, **kwargs)
    with pytest.raises(DataError, match='needs returns='):
        ValueLoss()(inputs, {'values': values})
    with pytest.raises(ConfigurationError, match='unknown loss inputs'):
        ValueLoss()(inputs, {'values': values}, advantages=[1.0], **kwargs)


# ---- the value head on the tiny model ---------------------------------------------------------
LORA = LoraConfig(r=8, lora_alpha=16, target_modules='all-linear')


def _rows() -> list[dict[str, list[int]]]:
    """Two rows of 7 tokens (no padding): prompts of 3 and 4 tokens, completions of 4 and 3."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for prompt in (3, 4):
        ids = torch.randint(5, 4000, (7,), generator=gen).tolist()
        rows.append({'input_ids': ids, 'labels': [IGN] * prompt + ids[prompt:]})
    return rows


RETURNS = [[1.0, 0.5, 0.0, -0.5], [-1.0, -1.0, 2.0]]


def _model() -> TransformersModel:
    torch.manual_seed(0)
    model = TransformersModel(assets.tiny_model('tiny-qwen3'), device='cpu')
    model.add_adapter_to_model('policy', LORA)
    model.add_adapter_to_model('critic', LORA, value_head=True)
    model.set_optimizer('AdamW', lr=1e-2, adapter_name='policy')
    model.set_optimizer('AdamW', lr=3e-3, adapter_name='critic')
    model.set_loss('ValueLoss', value_clip=None, adapter_name='critic')
    return model


def _value_error(model: TransformersModel, rows) -> float:
    values = model.forward_values(inputs=rows, adapter_name='critic')
    mask = torch.tensor([row['labels'] for row in rows]) != IGN
    flat = torch.tensor([r for row in RETURNS for r in row])
    return float((values[mask] - flat).square().mean())


def _snapshot(model: TransformersModel, name: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.train_group(name).params]


def _same(before: list[torch.Tensor], model: TransformersModel, name: str) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, model.train_group(name).params, strict=True))


def test_critic_trains_while_the_policy_stays_and_the_other_way_round(tmp_path):
    model, rows = _model(), _rows()
    assert (
        model.train_group('critic').spec.value_head is not None and model.train_group('policy').spec.value_head is None
    )
    assert model.forward_values(inputs=rows, adapter_name='critic').shape == (2, 7)
    assert model.forward_only(inputs=rows, adapter_name='policy').values is None
    policy = _snapshot(model, 'policy')
    errors = [_value_error(model, rows)]
    for _ in range(4):
        model.forward_backward(inputs=rows, adapter_name='critic', returns=RETURNS)
        model.clip_grad_and_step(adapter_name='critic')
        errors.append(_value_error(model, rows))
    assert errors[-1] < 0.5 * errors[0], errors
    assert _same(policy, model, 'policy')
    # The policy's steps leave the critic, head included, as it was.
    critic = _snapshot(model, 'critic')
    model.forward_backward(inputs=rows, adapter_name='policy')
    model.clip_grad_and_step(adapter_name='policy')
    assert not _same(policy, model, 'policy')
    assert _same(critic, model, 'critic')
    # One mixed pass of both gives the critic the loss it gets alone.
    alone = model.forward_only(inputs=rows, adapter_name='critic')
    alone_loss = model.calculate_loss(adapter_name='critic', returns=RETURNS)
    calls = [AdapterCall('policy', rows), AdapterCall('critic', rows, {'returns': RETURNS})]
    mixed = model.forward_backward_mixed(calls, forward_only=True)
    assert torch.allclose(mixed[1].values, alone.values, atol=1e-5) and mixed[0].values is None
    trained = model.forward_backward_mixed(calls)
    assert trained[1].loss == pytest.approx(alone_loss, abs=1e-5)
    assert all(p.grad is not None for p in model.train_group('critic').params)  # the head's included


def test_saving_and_loading_the_critic_keeps_its_head(tmp_path):
    model, rows = _model(), _rows()
    model.forward_backward(inputs=rows, adapter_name='critic', returns=RETURNS)
    model.clip_grad_and_step(adapter_name='critic')
    expected = model.forward_values(inputs=rows, adapter_name='critic')
    path = model.save('critic-1', str(tmp_path), adapter_name='critic')
    assert (tmp_path / 'critic-1' / VALUE_HEAD_WEIGHTS).is_file()
    # Added from the directory, the adapter is a critic again (its head comes back with it).
    model.add_adapter_to_model('critic-copy', path)
    assert torch.allclose(model.forward_values(inputs=rows, adapter_name='critic-copy'), expected, atol=1e-6)
    # load() into a critic whose head has moved on brings the saved head back.
    model.forward_backward(inputs=rows, adapter_name='critic', returns=RETURNS)
    model.clip_grad_and_step(adapter_name='critic')
    assert not torch.allclose(model.forward_values(inputs=rows, adapter_name='critic'), expected, atol=1e-6)
    model.load(path, adapter_name='critic')
    assert torch.allclose(model.forward_values(inputs=rows, adapter_name='critic'), expected, atol=1e-6)
    # A checkpoint of a policy has no head to load into a critic.
    policy_path = model.save('policy-0', str(tmp_path), adapter_name='policy')
    with pytest.raises(CheckpointError, match=f'has no {VALUE_HEAD_WEIGHTS}'):
        model.load(policy_path, adapter_name='critic')


def test_resuming_the_critic_continues_exactly(tmp_path):
    # The head's Adam moments are saved with the adapter's: a resumed step is the step not interrupted.
    model, rows = _model(), _rows()
    for _ in range(2):
        model.forward_backward(inputs=rows, adapter_name='critic', returns=RETURNS)
        model.clip_grad_and_step(adapter_name='critic')
    path = model.save('critic-2', str(tmp_path), adapter_name='critic', save_optimizer=True)
    model.forward_backward(inputs=rows, adapter_name='critic', returns=RETURNS)
    model.clip_grad_and_step(adapter_name='critic')
    resumed = _model()
    assert resumed.resume_from_checkpoint(path, adapter_name='critic')['optim_step'] == 2
    resumed.forward_backward(inputs=rows, adapter_name='critic', returns=RETURNS)
    resumed.clip_grad_and_step(adapter_name='critic')
    expected = model.forward_values(inputs=rows, adapter_name='critic')
    assert torch.equal(resumed.forward_values(inputs=rows, adapter_name='critic'), expected)


def test_values_and_value_loss_need_a_value_head():
    model = _model()
    with pytest.raises(
        ConfigurationError, match=r"ValueLoss trains a value head, and adapter 'policy' has none.*\['critic'\]"
    ):
        model.set_loss('ValueLoss', adapter_name='policy')
    with pytest.raises(ConfigurationError, match="adapter 'policy' has no value head"):
        model.forward_values(inputs=_rows(), adapter_name='policy')
    # The policy kept its loss (the refused one was never set).
    assert type(model.train_group('policy').spec.loss).__name__ == 'CrossEntropyLoss'
