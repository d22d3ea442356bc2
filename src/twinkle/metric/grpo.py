from __future__ import annotations

from typing import Any

import torch

from twinkle.loss.base import LossOutput
from twinkle.metric.base import METRICS, RatioMetric


@METRICS.register
class GRPOMetric(RatioMetric):
    """Per-token means of the statistics a policy loss reports (``GRPOLoss`` and kin, ``DPOLoss``):
    ``clip_frac``, ``kl``, ``entropy``, ``ratio`` over trained tokens; ``reward_accuracy`` and
    ``margin`` over DPO pairs. Each is a ratio of sums since the last reset, so micro-batches of
    different sizes weigh by their tokens, and only the keys the loss reported appear.

    Example: 1 clipped token of 3, then 0 of 1, give ``clip_frac = 1 / 4`` (not the mean of
    1/3 and 0).
    """

    #: (reported key, numerator, denominator) among the sums a policy loss puts in ``metrics``.
    ratios = (
        ('clip_frac', 'clipped', 'tokens'),
        ('kl', 'kl', 'tokens'),
        ('entropy', 'entropy', 'tokens'),
        ('ratio', 'ratio', 'tokens'),
        ('reward_accuracy', 'reward_accuracy', 'pairs'),
        ('margin', 'margin', 'pairs'),
    )

    def accumulate(self, *, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], loss: LossOutput | None) -> None:
        if loss is not None:
            self.add(loss.metrics)
