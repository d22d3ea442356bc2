"""RL losses through TransformersModel: sampled sequences in, exact accumulation, the KL
reference from the base model with the adapter off, and errors before any backward."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from twinkle.data_format import SamplingParams
from twinkle.errors import DataError, StateError
from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler

PROMPTS = [
    {'messages': [{'role': 'user', 'content': 'Write words that start with s.'}]},
    {'messages': [{'role': 'user', 'content': 'Count to three.'}]},
]


@pytest.fixture(scope='module')
def rollout(tiny_model_dir: str) -> tuple[list[dict], list[list[float]], list[float]]:
    sampler = TorchSampler(tiny_model_dir, device='cpu')
    responses = sampler.sample(PROMPTS, SamplingParams(max_tokens=6, num_samples=3, seed=0))
    sequences = [s for r in responses for s in r.sequences]
    advantages = [1.0, -0.5, 0.2, -1.0, 0.8, 0.5]
    return [s.new_input_feature for s in sequences], [s.token_logprobs for s in sequences], advantages


def policy(tiny_model_dir: str, **loss_kwargs) -> TransformersModel:
    torch.manual_seed(0)
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model('policy', LoraConfig(r=4, target_modules='all-linear', init_lora_weights=False))
    model.set_optimizer('SGD', lr=1.0)
    model.set_loss('GRPOLoss', **loss_kwargs)
    model.add_metric('GRPOMetric')
    return model


def grads(model: TransformersModel) -> torch.Tensor:
    group = model.groups['policy']
    group.normalize_grads()
    return torch.cat([p.grad.flatten() for p in group.params])


@pytest.mark.parametrize('loss_type', ['grpo', 'token_mean'])
def test_micro_batches_give_the_full_batch_gradient(tiny_model_dir, rollout, loss_type):
    features, old_logps, advantages = rollout
    whole = policy(tiny_model_dir, loss_type=loss_type)
    whole.forward_backward(inputs=features, old_logps=old_logps, advantages=advantages)
    split = policy(tiny_model_dir, loss_type=loss_type)
    out = split.forward_backward(inputs=features, old_logps=old_logps, advantages=advantages, micro_batch_size=4)
    assert torch.allclose(grads(whole), grads(split), atol=1e-6)
    assert out.loss is not None and out.num_tokens == sum(len(lp) for lp in old_logps)


def test_on_policy_ratio_is_one_and_grpo_loss_is_minus_the_mean_advantage(tiny_model_dir, rollout):
    features, _, advantages = rollout
    model = policy(tiny_model_dir)
    # The sampler ran the base model; this policy's adapter is random, so take old_logps from
    # the policy itself (what a synced sampler gives) to be exactly on-policy.
    own = model.forward_only(inputs=features).logps
    masks = [torch.tensor(f['completion_mask']).bool() for f in features]
    on_policy = [own[i, : len(mask)][mask].tolist() for i, mask in enumerate(masks)]
    out = model.forward_backward(inputs=features, old_logps=on_policy, advantages=advantages)
    assert out.loss == pytest.approx(-sum(advantages) / len(advantages), abs=1e-5)
    metrics = model.calculate_metric()
    assert metrics['ratio'] == pytest.approx(1.0, abs=1e-5) and metrics['clip_frac'] == 0.0


def test_kl_reference_is_the_base_model_with_the_adapter_off(tiny_model_dir, rollout):
    features, old_logps, advantages = rollout
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model('policy', LoraConfig(r=4, target_modules='all-linear'))  # B = 0: policy == base
    model.set_optimizer('AdamW', lr=1e-2)
    model.set_loss('GRPOLoss', beta=0.1)
    model.add_metric('GRPOMetric')
    model.forward_backward(inputs=features, old_logps=old_logps, advantages=advantages)
    model.clip_grad_and_step()
    assert model.calculate_metric()['kl'] == pytest.approx(0.0, abs=1e-6)
    for _ in range(3):
        model.forward_backward(inputs=features, old_logps=old_logps, advantages=advantages)
        model.clip_grad_and_step()
    assert model.calculate_metric()['kl'] > 1e-4


def test_kl_needs_a_reference_on_a_model_without_adapters(tiny_model_dir, rollout):
    features, old_logps, advantages = rollout
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.set_loss('GRPOLoss', beta=0.1)
    with pytest.raises(StateError, match='needs reference logprobs'):
        model.forward_backward(inputs=features, old_logps=old_logps, advantages=advantages)


def test_bad_rl_inputs_fail_before_backward(tiny_model_dir, rollout):
    features, old_logps, advantages = rollout
    model = policy(tiny_model_dir)
    short = [lp[:-1] for lp in old_logps]
    with pytest.raises(DataError, match=r'old_logps.*5.*6'):
        model.forward_backward(inputs=features, old_logps=short, advantages=advantages)
    with pytest.raises(DataError, match='advantages'):
        model.forward_backward(inputs=features, old_logps=old_logps, advantages=[float('nan'), *advantages[1:]])
    with pytest.raises(DataError, match="loss input 'advantages' has 5 entries for 6 rows"):
        model.forward_backward(inputs=features, old_logps=old_logps, advantages=advantages[:5])
    assert all(p.grad is None for p in model.groups['policy'].params)


def test_dpo_through_the_model_prefers_the_chosen_answers(tiny_model_dir):
    from twinkle.template import Template

    template = Template(tiny_model_dir)
    pairs = [('What is your name?', 'I am twinkle.', 'I do not know.'), ('Say hi', 'hi there', 'go away')]
    rows = []
    for question, chosen, rejected in pairs:
        for answer in (chosen, rejected):  # interleaved: chosen_0, rejected_0, chosen_1, ...
            messages = [{'role': 'user', 'content': question}, {'role': 'assistant', 'content': answer}]
            rows.append(template.encode({'messages': messages}))
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model('policy', LoraConfig(r=4, target_modules='all-linear'))
    model.set_optimizer('AdamW', lr=1e-2)
    model.set_loss('DPOLoss', beta=0.1)
    model.add_metric('GRPOMetric')
    first = model.forward_backward(inputs=rows).loss
    model.clip_grad_and_step()
    for _ in range(10):
        last = model.forward_backward(inputs=rows).loss
        model.clip_grad_and_step()
    # At the start the policy is the reference (LoRA B = 0): every margin is 0 and the loss ln 2.
    assert first == pytest.approx(0.6931, abs=1e-4)
    assert last < 0.5 and model.calculate_metric()['reward_accuracy'] > 0.5
