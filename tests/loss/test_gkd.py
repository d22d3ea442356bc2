"""GKDLoss: the generalized JSD and the sampled reverse KL on examples worked out by hand,
against TRL's ``GKDTrainer.generalized_jsd_loss``, and distillation from each teacher source
(another model, a saved adapter, the base model) on the embedded tiny model."""

from __future__ import annotations

import doctest
import math
import warnings

import pytest
import torch
from peft import LoraConfig

import twinkle.loss.gkd
import twinkle.loss.rl
from twinkle.errors import ConfigurationError, DataError
from twinkle.loss import LOSSES, GKDLoss, teacher_logits
from twinkle.model import TransformersModel

with warnings.catch_warnings():  # TRL warns that its experimental trainers may change: the version is pinned
    warnings.simplefilter('ignore')
    from trl.experimental.gkd import gkd_trainer as trl_gkd

LN = math.log


def one_token() -> tuple[dict, dict, torch.Tensor]:
    # One trained position (label 0) and one ignored; student uniform over 2 tokens, teacher (3/4, 1/4).
    inputs = {'labels': torch.tensor([[-100, 0]])}
    student = torch.zeros(1, 2, 2, requires_grad=True)
    teacher = torch.tensor([[[5.0, -5.0], [LN(3), 0.0]]])  # the ignored position's values must not count
    return inputs, {'logits': student}, teacher


def mean_loss(out) -> float:
    return out.loss.item() / out.num_items.item()


def test_jsd_hand_values():
    inputs, outputs, teacher = one_token()
    forward = 0.75 * LN(1.5) + 0.25 * LN(0.5)  # KL(P || S)
    reverse = 0.5 * LN(2 / 3) + 0.5 * LN(2)  # KL(S || P)
    # beta = 0.5: M = (5/8, 3/8); KL(P || M) = 3/4 ln(6/5) + 1/4 ln(2/3), KL(S || M) = 1/2 ln(4/5) + 1/2 ln(4/3)
    jsd = 0.5 * (0.75 * LN(6 / 5) + 0.25 * LN(2 / 3)) + 0.5 * (0.5 * LN(4 / 5) + 0.5 * LN(4 / 3))
    for beta, expected in ((0.0, forward), (1.0, reverse), (0.5, jsd)):
        out = GKDLoss(beta=beta)(inputs, outputs, teacher_logits=teacher)
        assert out.num_items.item() == 1 and mean_loss(out) == pytest.approx(expected, abs=1e-6), beta
        assert out.metrics['distill_kl'].item() == pytest.approx(expected, abs=1e-6)
    # Temperature 2 on teacher logits twice as large: the same distributions.
    out = GKDLoss(beta=0.0, temperature=2.0)(inputs, outputs, teacher_logits=2 * teacher)
    assert mean_loss(out) == pytest.approx(forward)
    # Student equal to teacher: 0 for every beta.
    same = GKDLoss(beta=0.3)(inputs, {'logits': teacher.clone().requires_grad_()}, teacher_logits=teacher)
    assert mean_loss(same) == pytest.approx(0.0, abs=1e-7)


def test_forward_kl_gradient_by_hand():
    inputs, outputs, teacher = one_token()
    GKDLoss(beta=0.0)(inputs, outputs, teacher_logits=teacher).loss.backward()
    # d KL(P || softmax(z)) / dz = S - P = (1/2 - 3/4, 1/2 - 1/4); the ignored position gets none.
    assert outputs['logits'].grad[0, 1].tolist() == pytest.approx([-0.25, 0.25])
    assert outputs['logits'].grad[0, 0].abs().sum().item() == 0


def test_sampled_reverse_kl_value_and_gradient_by_hand():
    inputs, outputs, teacher = one_token()
    out = GKDLoss(mode='sampled_reverse_kl')(inputs, outputs, teacher_logits=teacher)
    # k = log S(y) - log P(y) = ln(1/2) - ln(3/4) = ln(2/3): the value is k.
    assert mean_loss(out) == pytest.approx(LN(2 / 3)) and out.metrics['distill_kl'].item() == pytest.approx(LN(2 / 3))
    out.loss.backward()
    # Gradient k * grad log S(y): k * (onehot(0) - S) = ln(2/3) * (1/2, -1/2).
    assert outputs['logits'].grad[0, 1].tolist() == pytest.approx([0.5 * LN(2 / 3), -0.5 * LN(2 / 3)])
    # The teacher's label log-probs given directly instead: the same.
    given = GKDLoss(mode='sampled_reverse_kl')(inputs, one_token()[1], teacher_logps=torch.tensor([[0.0, LN(0.75)]]))
    assert mean_loss(given) == pytest.approx(LN(2 / 3))


@pytest.mark.parametrize('beta', [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize('temperature', [1.0, 0.7, 2.0])
def test_jsd_matches_trl(beta, temperature):
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(3, 5, 11, generator=generator, requires_grad=True)
    teacher = torch.randn(3, 5, 11, generator=generator) * 2
    labels = torch.randint(0, 11, (3, 5), generator=generator)
    labels[:, :2] = -100
    labels[1, 4] = -100
    expected = trl_gkd.GKDTrainer.generalized_jsd_loss(
        student.detach(), teacher, labels=labels, beta=beta, temperature=temperature
    )
    out = GKDLoss(beta=beta, temperature=temperature)({'labels': labels}, {'logits': student}, teacher_logits=teacher)
    assert out.num_items.item() == 8 and mean_loss(out) == pytest.approx(expected.item(), abs=1e-6)


@pytest.mark.parametrize(
    ('kwargs', 'match'),
    [
        ({'beta': 1.5}, r'beta must be in \[0, 1\] \(0: forward KL, 1: reverse KL, between: JSD\); got 1.5'),
        ({'beta': -0.1}, r'got -0.1'),
        ({'temperature': 0}, r'temperature must be a finite number > 0; got 0'),
        ({'mode': 'reverse'}, r"GKDLoss mode 'reverse'.*\['jsd', 'sampled_reverse_kl'\]"),
    ],
)
def test_bad_configuration_names_the_value(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        GKDLoss(**kwargs)


def test_bad_teacher_inputs():
    inputs, outputs, teacher = one_token()
    with pytest.raises(DataError, match='GKDLoss needs the teacher: pass teacher_logits='):
        GKDLoss()(inputs, outputs)
    with pytest.raises(DataError, match='vocabulary of 3 tokens, the student 2'):
        GKDLoss()(inputs, outputs, teacher_logits=torch.zeros(1, 2, 3))
    with pytest.raises(DataError, match=r'teacher_logits has shape \(1, 3, 2\); the student batch needs \(1, 2, 2\)'):
        GKDLoss()(inputs, outputs, teacher_logits=torch.zeros(1, 3, 2))
    with pytest.raises(DataError, match=r"mode='jsd'\) needs teacher_logits="):
        GKDLoss()(inputs, outputs, teacher_logps=torch.zeros(1, 2))
    with pytest.raises(DataError, match='not both'):
        GKDLoss()(inputs, outputs, teacher_logits=teacher, teacher_logps=torch.zeros(1, 2))
    with pytest.raises(DataError, match='NaN or infinite'):
        GKDLoss(mode='sampled_reverse_kl')(inputs, outputs, teacher_logps=torch.tensor([[0.0, math.nan]]))
    with pytest.raises(ConfigurationError, match=r'unknown loss inputs \[.ref_logps.\]'):
        GKDLoss()(inputs, outputs, teacher_logits=teacher, ref_logps=[0.0])


def test_registered_and_doctests():
    assert 'GKDLoss' in LOSSES
    assert doctest.testmod(twinkle.loss.gkd).failed == 0


# ---- the teacher sources, through the model --------------------------------------------------------
QUESTIONS = [('What is your name?', 'I am twinkle.'), ('Say hi', 'hi there'), ('Who made you?', 'ModelScope.')]


@pytest.fixture(scope='module')
def rows(tiny_model_dir) -> list[dict]:
    from twinkle.template import Template

    template = Template(tiny_model_dir)
    return [
        template.encode({'messages': [{'role': 'user', 'content': q}, {'role': 'assistant', 'content': a}]})
        for q, a in QUESTIONS
    ]


@pytest.fixture(scope='module')
def teacher(tiny_model_dir, rows, tmp_path_factory) -> tuple[TransformersModel, str]:
    """Another model: the base with a LoRA adapter fitted to the rows (SFT), saved."""
    torch.manual_seed(0)
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model('default', LoraConfig(r=4, target_modules='all-linear'))
    model.set_optimizer('AdamW', lr=2e-2)
    for _ in range(4):
        model.forward_backward(inputs=rows)
        model.clip_grad_and_step()
    return model, model.save('teacher', output_dir=str(tmp_path_factory.mktemp('teacher')))


def student(tiny_model_dir: str, **loss_kwargs) -> TransformersModel:
    torch.manual_seed(1)
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model('policy', LoraConfig(r=4, target_modules='all-linear'))
    model.set_optimizer('AdamW', lr=1e-2, adapter_name='policy')
    model.set_loss('GKDLoss', adapter_name='policy', **loss_kwargs)
    return model


@pytest.mark.slow
def test_teacher_sources_agree(tiny_model_dir, rows, teacher):
    other, saved = teacher
    from_other = teacher_logits(other, rows)
    model = student(tiny_model_dir)
    model.add_adapter_to_model('teacher', saved)
    # A saved adapter loaded beside the student's gives the other model's logits.
    assert torch.allclose(teacher_logits(model, rows, adapter_name='teacher'), from_other, atol=1e-5)
    # The base (adapter off) is a plain model of the same weights, and differs from the fitted teacher.
    base = teacher_logits(model, rows, adapter_name='policy', disable_lora=True)
    assert torch.allclose(base, teacher_logits(TransformersModel(tiny_model_dir, device='cpu'), rows), atol=1e-5)
    assert (base - from_other).abs().max() > 0.1


@pytest.mark.slow
def test_distillation_moves_the_student_to_the_teacher(tiny_model_dir, rows, teacher):
    target = teacher_logits(teacher[0], rows)
    model = student(tiny_model_dir, beta=0.5)
    losses = []
    for _ in range(5):
        losses.append(model.forward_backward(inputs=rows, adapter_name='policy', teacher_logits=target).loss)
        model.clip_grad_and_step(adapter_name='policy')
    # The student starts as the base (LoRA B = 0): the first loss is the base's distance to the teacher.
    labels = torch.nn.utils.rnn.pad_sequence([torch.tensor(r['labels']) for r in rows], True, -100)
    base = teacher_logits(model, rows, adapter_name='policy', disable_lora=True)
    before = GKDLoss(beta=0.5)({'labels': labels}, {'logits': base}, teacher_logits=target)
    assert losses[0] == pytest.approx(mean_loss(before), abs=1e-5)
    assert losses[-1] < 0.5 * losses[0], losses


def test_sampled_reverse_kl_is_unbiased_for_the_reverse_kl_gradient():
    # One position, vocabulary 3. Over y ~ S, sum_y S(y) * grad(surrogate at label y) = grad KL(S || P) (full vocab).
    student_logits = torch.tensor([[[0.3, -0.2, 1.0]]])
    teacher = torch.tensor([[[1.0, 0.0, -1.0]]])
    expected = student_logits.clone().requires_grad_()
    GKDLoss(beta=1.0)({'labels': torch.tensor([[0]])}, {'logits': expected}, teacher_logits=teacher).loss.backward()
    probs = student_logits.softmax(-1)[0, 0]
    total = torch.zeros_like(student_logits)
    for y in range(3):
        logits = student_logits.clone().requires_grad_()
        loss = GKDLoss(mode='sampled_reverse_kl')(
            {'labels': torch.tensor([[y]])}, {'logits': logits}, teacher_logits=teacher
        )
        loss.loss.backward()
        total += probs[y] * logits.grad
    assert torch.allclose(total, expected.grad, atol=1e-6)


@pytest.mark.slow
def test_sampled_reverse_kl_through_the_model(tiny_model_dir, rows, teacher):
    target = teacher_logits(teacher[0], rows)
    model = student(tiny_model_dir, mode='sampled_reverse_kl')
    # At the start the student is the base: the value is the mean of log S(y) - log P(y) over the label tokens.
    labels = torch.nn.utils.rnn.pad_sequence([torch.tensor(r['labels']) for r in rows], True, -100)
    teacher_logps = twinkle.loss.rl.token_logps(target, labels)
    gap_before = model.forward_only(inputs=rows, adapter_name='policy').logps - teacher_logps
    tokens = (labels != -100).sum()
    first = model.forward_backward(inputs=rows, adapter_name='policy', teacher_logits=target).loss
    assert first == pytest.approx(float(gap_before.sum() / tokens), abs=1e-5)
    model.clip_grad_and_step(adapter_name='policy')
    for _ in range(2):
        model.forward_backward(inputs=rows, adapter_name='policy', teacher_logits=target)
        model.clip_grad_and_step(adapter_name='policy')
    # Each token's log-probability moved toward the teacher's: up where the teacher is surer, down where less.
    gap_after = model.forward_only(inputs=rows, adapter_name='policy').logps - teacher_logps
    assert gap_after.abs().sum() < 0.7 * gap_before.abs().sum(), (gap_before.abs().sum(), gap_after.abs().sum())
