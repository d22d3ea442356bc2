"""CrossEntropyLoss and the metrics on examples worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from twinkle.errors import ConfigurationError
from twinkle.loss import CrossEntropyLoss
from twinkle.metric import Accuracy, LossMetric


def example() -> tuple[dict, dict]:
    # Vocabulary of 2, equal logits: every label has probability 1/2, so each trained token costs
    # ln 2. Labels: three trained tokens and one ignored (-100).
    logits = torch.zeros(1, 4, 2, requires_grad=True)
    labels = torch.tensor([[0, 1, -100, 1]])
    return {'labels': labels}, {'logits': logits}


def test_cross_entropy_sums_and_counts_the_trained_tokens():
    inputs, outputs = example()
    mean = CrossEntropyLoss()(inputs, outputs)
    assert mean.loss.item() == pytest.approx(3 * math.log(2)) and mean.num_items.item() == 3
    total = CrossEntropyLoss(reduction='sum')(inputs, outputs)
    assert total.loss.item() == pytest.approx(3 * math.log(2)) and total.num_items.item() == 1
    # d/dlogit of -log softmax at the label: p - onehot = (-1/2, 1/2) for label 0; 0 where ignored.
    mean.loss.backward()
    assert outputs['logits'].grad[0, 0].tolist() == pytest.approx([-0.5, 0.5])
    assert outputs['logits'].grad[0, 2].tolist() == [0.0, 0.0]


def test_cross_entropy_refuses_bad_reductions_and_shapes():
    with pytest.raises(ConfigurationError, match=r"reduction 'avg'.*\['mean', 'sum'\]"):
        CrossEntropyLoss(reduction='avg')
    inputs, outputs = example()
    with pytest.raises(ValueError, match=r'logits \(1, 4, 2\) do not match labels \(1, 3\)'):
        CrossEntropyLoss()({'labels': inputs['labels'][:, :3]}, outputs)


def test_loss_metric_weighs_micro_batches_by_their_tokens():
    inputs, outputs = example()
    metric = LossMetric()
    metric.accumulate(inputs=inputs, outputs=outputs, loss=CrossEntropyLoss()(inputs, outputs))
    # A second batch of one trained token at loss ln 1 = 0 (a certain prediction).
    certain = {'logits': torch.tensor([[[0.0, -1e9]]])}
    metric.accumulate(
        inputs={'labels': torch.tensor([[0]])},
        outputs=certain,
        loss=CrossEntropyLoss()({'labels': torch.tensor([[0]])}, certain),
    )
    # (3 ln 2 + 0) / 4 tokens, not the mean of the two batch means (ln 2 / 2).
    assert metric.calculate()['loss'] == pytest.approx(3 * math.log(2) / 4)
    metric.reset()
    assert metric.calculate() == {}


def test_accuracy_counts_argmax_hits_on_trained_tokens():
    logits = torch.tensor([[[2.0, 0.0], [2.0, 0.0], [0.0, 2.0], [0.0, 2.0]]])
    labels = torch.tensor([[0, 1, -100, 1]])  # hit, miss, ignored, hit -> 2 of 3
    metric = Accuracy()
    metric.accumulate(inputs={'labels': labels}, outputs={'logits': logits}, loss=None)
    assert metric.calculate() == {'accuracy': pytest.approx(2 / 3)}
