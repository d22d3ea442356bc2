from __future__ import annotations

from typing import Any

import torch

from twinkle.data_format import IGNORE_INDEX
from twinkle.loss.base import LossOutput
from twinkle.metric.base import METRICS, Metric


@METRICS.register
class LossMetric(Metric):
    """``loss``: the summed loss over the summed item count since the last reset, i.e. the
    loss the optimizer saw, not a mean of per-batch means."""

    total: torch.Tensor | float
    count: torch.Tensor | float

    def __init__(self) -> None:
        self.reset()

    def accumulate(self, *, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], loss: LossOutput | None) -> None:
        if loss is not None:
            self.total = self.total + loss.loss.detach().float()
            self.count = self.count + loss.num_items.detach()

    def calculate(self) -> dict[str, float]:
        count = float(self.count)
        return {'loss': float(self.total) / count} if count else {}

    def reset(self) -> None:
        self.total = 0.0
        self.count = 0

    def state(self) -> dict[str, Any]:
        return {'total': float(self.total), 'count': float(self.count)}

    def merge(self, state: dict[str, Any]) -> None:
        self.total = float(self.total) + state['total']
        self.count = float(self.count) + state['count']


@METRICS.register
class Accuracy(Metric):
    """``accuracy``: the share of trained label tokens that are the argmax of the logits (a
    label tied for the maximum counts as a hit). Comparing the label's logit with the maximum
    is an order of magnitude cheaper than ``argmax`` over a large vocabulary."""

    correct: torch.Tensor | int
    total: torch.Tensor | int

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index
        self.reset()

    def accumulate(self, *, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], loss: LossOutput | None) -> None:
        labels = inputs['labels']
        mask = labels != self.ignore_index
        logits = outputs['logits'].detach()
        label_logits = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        hits = (label_logits >= logits.amax(-1)) & mask
        self.correct = self.correct + hits.sum()
        self.total = self.total + mask.sum()

    def calculate(self) -> dict[str, float]:
        total = int(self.total)
        return {'accuracy': int(self.correct) / total} if total else {}

    def reset(self) -> None:
        self.correct = 0
        self.total = 0

    def state(self) -> dict[str, Any]:
        return {'correct': int(self.correct), 'total': int(self.total)}

    def merge(self, state: dict[str, Any]) -> None:
        self.correct = int(self.correct) + state['correct']
        self.total = int(self.total) + state['total']
