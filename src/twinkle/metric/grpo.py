from __future__ import annotations

from typing import Any

import torch

from twinkle.loss.base import LossOutput
from twinkle.metric.base import METRICS, Metric

#: Reported key -> (numerator, denominator) among the sums a policy loss puts in ``metrics``.
_RATIOS = {
    'clip_frac': ('clipped', 'tokens'),
    'kl': ('kl', 'tokens'),
    'entropy': ('entropy', 'tokens'),
    'ratio': ('ratio', 'tokens'),
    'reward_accuracy': ('reward_accuracy', 'pairs'),
    'margin': ('margin', 'pairs'),
}


@METRICS.register
class GRPOMetric(Metric):
    """Per-token means of the statistics a policy loss reports (``GRPOLoss`` and kin, ``DPOLoss``):
    ``clip_frac``, ``kl``, ``entropy``, ``ratio`` over trained tokens; ``reward_accuracy`` and
    ``margin`` over DPO pairs. Each is a ratio of sums since the last reset, so micro-batches of
    different sizes weigh by their tokens, and only the keys the loss reported appear.

    Example: 1 clipped token of 3, then 0 of 1, give ``clip_frac = 1 / 4`` (not the mean of
    1/3 and 0).
    """

    sums: dict[str, torch.Tensor | float]

    def __init__(self) -> None:
        self.reset()

    def accumulate(self, *, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], loss: LossOutput | None) -> None:
        if loss is None:
            return
        for key, value in loss.metrics.items():
            value = value.detach()
            self.sums[key] = self.sums[key] + value if key in self.sums else value

    def calculate(self) -> dict[str, float]:
        values = {key: float(total) for key, total in self.sums.items()}
        return {
            name: values[num] / values[den] for name, (num, den) in _RATIOS.items() if num in values and values.get(den)
        }

    def reset(self) -> None:
        self.sums = {}

    def state(self) -> dict[str, Any]:
        return {'sums': {key: float(total) for key, total in self.sums.items()}}

    def merge(self, state: dict[str, Any]) -> None:
        for key, total in state['sums'].items():
            self.sums[key] = float(self.sums.get(key, 0.0)) + total
