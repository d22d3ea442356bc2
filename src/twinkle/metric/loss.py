from __future__ import annotations

from typing import Any

import torch

from twinkle.data_format import IGNORE_INDEX
from twinkle.loss.base import LossOutput
from twinkle.metric.base import METRICS, RatioMetric


@METRICS.register
class LossMetric(RatioMetric):
    """``loss``: the summed loss over the summed item count since the last reset, i.e. the
    loss the optimizer saw, not a mean of per-batch means."""

    ratios = (('loss', 'loss', 'items'),)

    def reads_logits(self) -> bool:
        return False

    def accumulate(self, *, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], loss: LossOutput | None) -> None:
        if loss is not None:
            self.add({'loss': loss.loss.float(), 'items': loss.num_items})


@METRICS.register
class Accuracy(RatioMetric):
    """``accuracy``: the share of trained label tokens that are the argmax of the logits (a
    label tied for the maximum counts as a hit). Comparing the label's logit with the maximum
    is an order of magnitude cheaper than ``argmax`` over a large vocabulary."""

    ratios = (('accuracy', 'hits', 'tokens'),)

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index
        super().__init__()

    def reads_logits(self) -> bool:
        return self.ignore_index != IGNORE_INDEX  # the fused layer counts hits at IGNORE_INDEX's mask only

    def accumulate(self, *, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], loss: LossOutput | None) -> None:
        labels = inputs['labels']
        mask = labels != self.ignore_index
        if 'hits' in outputs:  # the fused output layer counted them (no logits)
            hits = outputs['hits'] & mask
        else:
            logits = outputs['logits'].detach()
            label_logits = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            hits = (label_logits >= logits.amax(-1)) & mask
        self.add({'hits': hits.sum(), 'tokens': mask.sum()})
