"""KTO, SimPO, ORPO and CPO: on examples worked out by hand, against TRL's own loss code on the
same inputs, and trained a few steps on the embedded tiny model."""

from __future__ import annotations

import doctest
import math
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig
from trl.trainer import kto_trainer as trl_kto

import twinkle.loss.preference
from twinkle.errors import ConfigurationError, DataError, StateError
from twinkle.loss import LOSSES, CPOLoss, KTOLoss, ORPOLoss, SimPOLoss, kto_kl_rows, token_logps
from twinkle.model import TransformersModel

with warnings.catch_warnings():  # TRL warns that its experimental trainers may change: the version is pinned
    warnings.simplefilter('ignore')
    from trl.experimental.cpo import cpo_trainer as trl_cpo
    from trl.experimental.orpo import orpo_trainer as trl_orpo


def rows(*probabilities: list[float]) -> tuple[dict, dict]:
    """One sequence per argument: the probability of each of its trained tokens. Vocabulary of
    2, label 0, logits ``(ln p, ln(1 - p))``: the label's log-probability is exactly ``ln p``.
    The first position is a prompt token (ignored); shorter sequences are right-padded."""
    width = 1 + max(len(p) for p in probabilities)
    labels = torch.full((len(probabilities), width), -100)
    logits = torch.zeros(len(probabilities), width, 2)
    for row, probs in enumerate(probabilities):
        for col, p in enumerate(probs, start=1):
            labels[row, col] = 0
            logits[row, col] = torch.tensor([math.log(p), math.log(1 - p)])
    return {'labels': labels}, {'logits': logits.requires_grad_()}


def mean_loss(out) -> float:
    return out.loss.item() / out.num_items.item()


def per_token(*values: list[float]) -> list[list[float]]:
    return [[math.log(v) for v in seq] for seq in values]


# ---- hand-worked values -------------------------------------------------------------------------
def test_simpo_hand_values():
    # chosen: two tokens at 1/2 (mean ln 1/2); rejected: one at 1/4 (mean ln 1/4).
    inputs, outputs = rows([0.5, 0.5], [0.25])
    out = SimPOLoss(beta=2.0, gamma=0.5)(inputs, outputs)
    # margin = 2 (ln 1/2 - ln 1/4) = ln 4; -log sigmoid(ln 4 - 0.5) = ln(1 + e^0.5 / 4)
    assert mean_loss(out) == pytest.approx(math.log(1 + math.exp(0.5) / 4))
    assert out.num_items.item() == 1 and out.metrics['margin'].item() == pytest.approx(math.log(4))
    assert out.metrics['reward_accuracy'].item() == 1
    # The length normalisation: the chosen answer's second token does not change its mean.
    assert mean_loss(SimPOLoss(beta=2.0, gamma=0.5)(*rows([0.5], [0.25]))) == pytest.approx(mean_loss(out))
    # Equal means and gamma = 0: ln 2.
    assert mean_loss(SimPOLoss(beta=2.0, gamma=0.0)(*rows([0.5, 0.5], [0.5]))) == pytest.approx(math.log(2))


def test_orpo_hand_values():
    # chosen p = 1/2: odds 1, log odds 0. rejected p = 1/4: odds 1/3, log odds -ln 3.
    inputs, outputs = rows([0.5], [0.25])
    out = ORPOLoss(beta=0.1)(inputs, outputs)
    # NLL ln 2 + 0.1 * -log sigmoid(ln 3) = ln 2 + 0.1 ln(4/3)
    assert mean_loss(out) == pytest.approx(math.log(2) + 0.1 * math.log(4 / 3))
    assert out.metrics['margin'].item() == pytest.approx(math.log(3))
    # The NLL is the chosen answer's mean: tokens 1/2 and 1/4 cost (ln 2 + ln 4) / 2 = 1.5 ln 2.
    # Mean log-prob ln(1/2^1.5): odds 2^-1.5 / (1 - 2^-1.5); rejected 1/4 as before.
    two = ORPOLoss(beta=0.1)(*rows([0.5, 0.25], [0.25]))
    p = 2**-1.5
    log_odds_ratio = math.log(p / (1 - p)) + math.log(3)
    expected = 1.5 * math.log(2) + 0.1 * math.log(1 + math.exp(-log_odds_ratio))
    assert mean_loss(two) == pytest.approx(expected)


def test_cpo_hand_values():
    # chosen 1/2, rejected 1/4: h = ln 2; NLL of the chosen answer ln 2.
    inputs, outputs = rows([0.5], [0.25])
    # -log sigmoid(ln 2) = ln 1.5, plus ln 2: ln 3.
    assert mean_loss(CPOLoss(beta=1.0)(inputs, outputs)) == pytest.approx(math.log(3))
    # hinge: max(0, 1 - ln 2) + ln 2 = 1.
    assert mean_loss(CPOLoss(beta=1.0, loss_type='hinge')(inputs, outputs)) == pytest.approx(1.0)
    # alpha = 0: the DPO term alone, with sums (not means) of log-probs: chosen 2 ln(1/2), rejected ln(1/4): h = 0.
    out = CPOLoss(beta=1.0, alpha=0.0)(*rows([0.5, 0.5], [0.25]))
    # float32 rounding of the logs leaves about 1e-7 (-1.19e-7 on an AMD EPYC)
    assert mean_loss(out) == pytest.approx(math.log(2)) and out.metrics['margin'].item() == pytest.approx(0.0, abs=1e-6)


def test_cpo_gradient_by_hand():
    inputs, outputs = rows([0.5], [0.25])
    CPOLoss(beta=1.0, alpha=0.0)(inputs, outputs).loss.backward()
    # dL/dh = -(1 - sigmoid(ln 2)) = -1/3. d logp/dz for label 0 with softmax (p, 1 - p): (1 - p, -(1 - p)).
    grad = outputs['logits'].grad
    assert grad[0, 1].tolist() == pytest.approx([-1 / 3 * 0.5, 1 / 3 * 0.5])
    assert grad[1, 1].tolist() == pytest.approx([1 / 3 * 0.75, -1 / 3 * 0.75])
    assert grad[:, 0].abs().sum().item() == 0


def kto_batch() -> tuple[dict, dict, list[float], list]:
    # Sequences: desirable (policy 1/2, ref 1/4: r = ln 2), undesirable (1/4 vs 1/2: r = -ln 2), and two KL
    # sequences: (1/2 vs 1/2: 0) and (1/2 vs 1/4: ln 2).
    inputs, outputs = rows([0.5], [0.25], [0.5], [0.5])
    ref = [math.log(0.25), math.log(0.5), math.log(0.5), math.log(0.25)]
    return inputs, outputs, [[value] for value in ref], [True, False, None, None]


def test_kto_hand_values():
    inputs, outputs, ref, labels = kto_batch()
    out = KTOLoss(beta=1.0)(inputs, outputs, ref_logps=ref, kto_labels=labels)
    # z0 = mean(0, ln 2) = ln 2 / 2. Desirable: 1 - sigmoid(ln 2 / 2) = 1 - sqrt2 / (1 + sqrt2) = 1 / (1 + sqrt2).
    # Undesirable: 1 - sigmoid(ln 2 / 2 + ln 2) = 1 / (1 + 2 sqrt2). Mean over the 2 examples (KL rows do not count).
    s2 = math.sqrt(2)
    assert out.num_items.item() == 2 and out.metrics['kl'].item() == pytest.approx(math.log(2) / 2)
    assert mean_loss(out) == pytest.approx((1 / (1 + s2) + 1 / (1 + 2 * s2)) / 2)
    assert out.metrics['chosen_reward'].item() == pytest.approx(math.log(2))
    assert out.metrics['rejected_reward'].item() == pytest.approx(-math.log(2))
    weighted = KTOLoss(beta=1.0, desirable_weight=2.0)(inputs, outputs, ref_logps=ref, kto_labels=labels)
    assert mean_loss(weighted) == pytest.approx((2 / (1 + s2) + 1 / (1 + 2 * s2)) / 2)
    # z0 given: the KL sequences are ignored. z0 = 0: 1 - sigmoid(ln 2) = 1/3 for each example.
    given = KTOLoss(beta=1.0)(inputs, outputs, ref_logps=ref, kto_labels=labels, z0=0.0)
    assert mean_loss(given) == pytest.approx(1 / 3)
    # The estimate is clamped at 0: KL sequences with policy below the reference give z0 = 0, not negative.
    ref_low = [*ref[:2], [math.log(0.75)], [math.log(0.75)]]
    clamped = KTOLoss(beta=1.0)(inputs, outputs, ref_logps=ref_low, kto_labels=labels)
    assert clamped.metrics['kl'].item() == 0 and mean_loss(clamped) == pytest.approx(1 / 3)


def test_kto_z0_carries_no_gradient_and_kl_rows_get_none():
    inputs, outputs, ref, labels = kto_batch()
    KTOLoss(beta=1.0)(inputs, outputs, ref_logps=ref, kto_labels=labels).loss.backward()
    grad = outputs['logits'].grad
    assert grad[2:].abs().sum().item() == 0 and grad[0].abs().sum().item() > 0 and grad[1].abs().sum().item() > 0


def test_kto_kl_rows_are_trls_mismatched_pairs():
    prompts, completions = ['p0', 'p1', 'p2'], ['c0', 'c1', 'c2']
    # TRL: KL_completion_ids = [completion_ids[-1]] + completion_ids[:-1]
    trl_kl = [completions[-1], *completions[:-1]]
    assert kto_kl_rows(prompts, completions) == list(zip(prompts, trl_kl, strict=True))
    with pytest.raises(DataError, match='needs 2 examples or more'):
        kto_kl_rows(['p'], ['c'])


# ---- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ('build', 'match'),
    [
        (lambda: SimPOLoss(beta=0), r'SimPOLoss beta must be a finite number > 0; got 0'),
        (lambda: SimPOLoss(gamma=-1.0), r'SimPOLoss gamma .* >= 0; got -1.0'),
        (lambda: ORPOLoss(beta=float('nan')), r'ORPOLoss beta must be a finite number > 0; got nan'),
        (lambda: CPOLoss(loss_type='ipo'), r"CPOLoss loss_type 'ipo'.*\['hinge', 'sigmoid'\]"),
        (lambda: CPOLoss(alpha=-0.5), r'CPOLoss alpha .* >= 0; got -0.5'),
        (lambda: KTOLoss(beta=-1), r'KTOLoss beta must be a finite number > 0; got -1'),
        (lambda: KTOLoss(undesirable_weight=True), r'KTOLoss undesirable_weight .* got True'),
    ],
)
def test_bad_configuration_names_the_value(build, match):
    with pytest.raises(ConfigurationError, match=match):
        build()


@pytest.mark.parametrize('loss', [SimPOLoss(), ORPOLoss(), CPOLoss()], ids=lambda loss: type(loss).__name__)
def test_paired_losses_refuse_a_batch_without_pairs(loss):
    inputs, outputs = rows([0.5], [0.25], [0.5])
    with pytest.raises(DataError, match='3 sequences, an odd number'):
        loss(inputs, outputs)
    with pytest.raises(ConfigurationError, match=r'unknown loss inputs \[.ref_logps.\]'):
        loss(*rows([0.5], [0.25]), ref_logps=[0.0, 0.0])


def test_length_normalised_losses_refuse_an_empty_completion():
    inputs, outputs = rows([0.5], [0.25])
    inputs['labels'][1] = -100
    with pytest.raises(DataError, match='sequence 1 has no completion'):
        SimPOLoss()(inputs, outputs)


def test_kto_refuses_bad_labels_and_a_missing_reference_point():
    inputs, outputs, ref, labels = kto_batch()
    kto = KTOLoss()
    with pytest.raises(DataError, match='needs kto_labels='):
        kto(inputs, outputs, ref_logps=ref)
    with pytest.raises(DataError, match=r'one entry per sequence \(4\); got 2 entries'):
        kto(inputs, outputs, ref_logps=ref, kto_labels=[True, False])
    with pytest.raises(DataError, match=r"kto_labels\[1\] is 'no'; accepted: True"):
        kto(inputs, outputs, ref_logps=ref, kto_labels=[True, 'no', None, None])
    with pytest.raises(DataError, match='needs the reference point z0'):
        kto(inputs, outputs, ref_logps=ref, kto_labels=[True, False, True, False])
    with pytest.raises(DataError, match='z0 must be a finite number'):
        kto(inputs, outputs, ref_logps=ref, kto_labels=labels, z0=float('inf'))
    with pytest.raises(DataError, match='no example to train on'):
        kto(inputs, outputs, ref_logps=ref, kto_labels=[None] * 4)
    with pytest.raises(StateError, match=r'KTOLoss\(beta=0.1\) needs reference logprobs'):
        kto(inputs, outputs, kto_labels=labels)


def test_registered_and_doctests():
    assert all(name in LOSSES for name in ('KTOLoss', 'SimPOLoss', 'ORPOLoss', 'CPOLoss'))
    assert doctest.testmod(twinkle.loss.preference).failed == 0


# ---- against TRL --------------------------------------------------------------------------------
def random_pairs(
    pairs: int = 3, width: int = 6, vocab: int = 7, seed: int = 0, equal_chosen: bool = False
) -> tuple[dict, dict]:
    """Interleaved (chosen, rejected) rows with random logits and random completion lengths (the
    prompt is the first 1-2 positions); ``equal_chosen``: every chosen answer has ``width - 1``
    tokens."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(2 * pairs, width, vocab, generator=generator)
    labels = torch.randint(0, vocab, (2 * pairs, width), generator=generator)
    for row in range(2 * pairs):
        prompt = 1 + row % 2
        end = width - int(torch.randint(0, 3, (), generator=generator))
        end = width if equal_chosen and row % 2 == 0 else end
        labels[row, :prompt] = -100
        labels[row, end:] = -100
    return {'labels': labels}, {'logits': logits.requires_grad_()}


def trl_layout(inputs: dict, outputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Our pre-shifted (logits[t] predicts labels[t]) as TRL's unshifted layout: TRL drops the
    last logit and the first label."""
    logits, labels = outputs['logits'].detach(), inputs['labels']
    pad = torch.full((labels.shape[0], 1), -100)
    return torch.cat([logits, torch.zeros_like(logits[:, :1])], 1), torch.cat([pad, labels], 1)


def trl_self(**attributes) -> SimpleNamespace:
    return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device('cpu')), **attributes)


def chosen_first(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Ours interleave (chosen, rejected); TRL concatenates all chosen then all rejected.
    return values[0::2], values[1::2]


def trl_nll(inputs: dict, outputs: dict) -> torch.Tensor:
    # TRL's chosen NLL: nn.CrossEntropyLoss (mean over the chosen rows' tokens) on the same layout.
    logits, labels = trl_layout(inputs, outputs)
    return F.cross_entropy(logits[0::2, :-1].reshape(-1, logits.shape[-1]), labels[0::2, 1:].reshape(-1))


@pytest.mark.parametrize(('beta', 'gamma'), [(2.0, 0.5), (10.0, 1.6), (0.5, 0.0)])
def test_simpo_matches_trl(beta, gamma):
    inputs, outputs = random_pairs()
    logits, labels = trl_layout(inputs, outputs)
    average = trl_cpo.CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    trainer = trl_self(alpha=0.0, loss_type='simpo', simpo_gamma=gamma, beta=beta, label_smoothing=0.0)
    losses, _, _ = trl_cpo.CPOTrainer.cpo_loss(trainer, *chosen_first(average))
    assert mean_loss(SimPOLoss(beta=beta, gamma=gamma)(inputs, outputs)) == pytest.approx(
        losses.mean().item(), abs=1e-6
    )


@pytest.mark.parametrize('beta', [0.1, 1.0])
def test_orpo_matches_trl(beta):
    # Equal chosen lengths: TRL's batch-token mean NLL is then the mean of per-answer means.
    inputs, outputs = random_pairs(equal_chosen=True)
    logits, labels = trl_layout(inputs, outputs)
    average = trl_orpo.ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    losses, *_ = trl_orpo.ORPOTrainer.odds_ratio_loss(trl_self(beta=beta), *chosen_first(average))
    expected = trl_nll(inputs, outputs) - losses.mean()  # TRL: loss = policy_nll_loss - losses.mean()
    assert mean_loss(ORPOLoss(beta=beta)(inputs, outputs)) == pytest.approx(expected.item(), abs=1e-6)


@pytest.mark.parametrize('loss_type', ['sigmoid', 'hinge'])
@pytest.mark.parametrize('alpha', [0.0, 1.0])
def test_cpo_matches_trl(loss_type, alpha):
    inputs, outputs = random_pairs(seed=1, equal_chosen=True)
    logits, labels = trl_layout(inputs, outputs)
    summed = trl_cpo.CPOTrainer.get_batch_logps(logits, labels, average_log_prob=False)
    trainer = trl_self(alpha=0.0, loss_type=loss_type, beta=0.3, label_smoothing=0.0)
    losses, _, _ = trl_cpo.CPOTrainer.cpo_loss(trainer, *chosen_first(summed))
    expected = losses.mean() + alpha * trl_nll(inputs, outputs)  # TRL: losses.mean() + cpo_alpha * nll
    ours = CPOLoss(beta=0.3, alpha=alpha, loss_type=loss_type)(inputs, outputs)
    assert mean_loss(ours) == pytest.approx(expected.item(), abs=1e-6)


class _TRLKTOModel:
    """What KTOTrainer._compute_loss calls: returns given per-token log-probs for the examples
    and for the KL sequences (the fused LM head's ``log_probs``, ``entropy``, ``mean_logits``)."""

    def __init__(self, logps: torch.Tensor, kl_logps: torch.Tensor, kl_input_ids: torch.Tensor):
        self.logps, self.kl_logps, self.kl_input_ids = logps, kl_logps, kl_input_ids

    def __call__(self, *, input_ids: torch.Tensor, **kwargs) -> SimpleNamespace:
        logps = self.kl_logps if input_ids is self.kl_input_ids else self.logps
        zeros = torch.zeros_like(logps)
        return SimpleNamespace(log_probs=logps, entropy=zeros, mean_logits=zeros)


@pytest.mark.parametrize(('beta', 'desirable_weight', 'undesirable_weight'), [(0.1, 1.0, 1.0), (2.0, 1.33, 0.5)])
def test_kto_matches_trl(beta, desirable_weight, undesirable_weight):
    # 4 examples and their 4 KL sequences, interleaved as the cookbook lays them out: ex_0, kl_0, ex_1, kl_1, ...
    generator = torch.Generator().manual_seed(3)
    inputs = {'labels': torch.randint(0, 5, (8, 5), generator=generator)}
    inputs['labels'][:, 0] = -100
    inputs['labels'][2, 4] = -100
    outputs = {'logits': torch.randn(8, 5, 5, generator=generator).requires_grad_()}
    ref_BS = torch.where(inputs['labels'] != -100, -torch.rand(8, 5, generator=generator) * 3, 0.0)
    desirable = [True, False, False, True]
    labels = [entry for flag in desirable for entry in (flag, None)]
    ours = KTOLoss(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)(
        inputs, outputs, ref_logps=ref_BS, kto_labels=labels
    )
    # TRL's batch: per-token log-probs [batch, seq - 1] of the examples and of the KL sequences, the reference's
    # summed, the labels; its model here hands back ours.
    logps_BS = token_logps(outputs['logits'].detach(), inputs['labels'])
    ones = torch.ones(4, 6, dtype=torch.long)
    batch = {
        'input_ids': ones.clone(),
        'attention_mask': ones,
        'completion_mask': ones,
        'KL_input_ids': ones.clone(),
        'KL_attention_mask': ones,
        'KL_completion_mask': ones,
        'label': torch.tensor(desirable),
        'ref_logps': ref_BS[0::2].sum(-1),
        'ref_KL_logps': ref_BS[1::2].sum(-1),
    }
    model = _TRLKTOModel(logps_BS[0::2], logps_BS[1::2], batch['KL_input_ids'])
    trainer = trl_self(
        model=SimpleNamespace(training=True),
        calculate_KL=True,
        precompute_ref_logps=True,
        loss_type='kto',
        beta=beta,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )
    trainer.accelerator.gather_for_metrics = lambda value: value
    trainer._compute_kl_logps = lambda model, batch: trl_kto.KTOTrainer._compute_kl_logps(trainer, model, batch)
    expected = trl_kto.KTOTrainer._compute_loss(trainer, model, batch, return_outputs=False)
    assert mean_loss(ours) == pytest.approx(expected.item(), abs=1e-6)
    assert ours.metrics['kl'].item() == pytest.approx(trainer._metrics['train']['kl'][0], abs=1e-6)


# ---- through the model ----------------------------------------------------------------------------
PAIRS = [('What is your name?', 'I am twinkle.', 'I do not know.'), ('Say hi', 'hi there', 'go away')]


def encode(template, question: str, answer: str) -> dict:
    messages = [{'role': 'user', 'content': question}, {'role': 'assistant', 'content': answer}]
    return template.encode({'messages': messages})


def lora_model(tiny_model_dir: str, loss: str, **kwargs) -> TransformersModel:
    torch.manual_seed(0)
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model('policy', LoraConfig(r=4, target_modules='all-linear'))
    model.set_optimizer('AdamW', lr=1e-2)
    model.set_loss(loss, **kwargs)
    model.add_metric('GRPOMetric')
    return model


def chosen_minus_rejected(model: TransformersModel, rows: list[dict]) -> float:
    """Mean over pairs of (mean chosen log-prob - mean rejected log-prob), from a forward."""
    logps = model.forward_only(inputs=rows).logps
    mean = logps.sum(-1) / torch.tensor([sum(t != -100 for t in row['labels']) for row in rows])
    return float((mean[0::2] - mean[1::2]).mean())


@pytest.mark.slow
@pytest.mark.parametrize(
    ('loss', 'kwargs'),
    [('SimPOLoss', {'beta': 2.0, 'gamma': 0.5}), ('ORPOLoss', {'beta': 0.5}), ('CPOLoss', {'beta': 0.5})],
)
def test_paired_losses_train_through_the_model(tiny_model_dir, loss, kwargs):
    from twinkle.template import Template

    template = Template(tiny_model_dir)
    batch = [encode(template, q, answer) for q, chosen, rejected in PAIRS for answer in (chosen, rejected)]
    model = lora_model(tiny_model_dir, loss, **kwargs)
    before = chosen_minus_rejected(model, batch)
    losses = []
    for _ in range(5):
        losses.append(model.forward_backward(inputs=batch).loss)
        model.clip_grad_and_step()
    assert losses[-1] < losses[0]
    assert chosen_minus_rejected(model, batch) > before + 2.0
    assert model.calculate_metric()['reward_accuracy'] > 0.5


@pytest.mark.slow
def test_kto_trains_through_the_model(tiny_model_dir):
    from twinkle.template import Template

    template = Template(tiny_model_dir)
    prompts = [q for q, _, _ in PAIRS for _ in range(2)]
    completions = [answer for _, chosen, rejected in PAIRS for answer in (chosen, rejected)]
    desirable = [True, False, True, False]
    kl = kto_kl_rows(prompts, completions)
    batch, labels = [], []
    for prompt, completion, flag, (kl_prompt, kl_completion) in zip(prompts, completions, desirable, kl, strict=True):
        batch += [encode(template, prompt, completion), encode(template, kl_prompt, kl_completion)]
        labels += [flag, None]
    model = lora_model(tiny_model_dir, 'KTOLoss', beta=0.5)
    first = model.forward_backward(inputs=batch, kto_labels=labels).loss
    model.clip_grad_and_step()
    for _ in range(3):
        model.forward_backward(inputs=batch, kto_labels=labels)
        model.clip_grad_and_step()
    # At the start the policy is the reference (LoRA B = 0): r = 0, z0 = 0, every example costs 1/2.
    assert first == pytest.approx(0.5, abs=1e-5)
    examples = batch[0::2]
    assert chosen_minus_rejected(model, examples) > chosen_minus_rejected(
        lora_model(tiny_model_dir, 'KTOLoss'), examples
    )
