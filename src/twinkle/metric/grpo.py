from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from twinkle.loss.base import LossOutput
from twinkle.metric.base import METRICS, RatioMetric


@METRICS.register
class GRPOMetric(RatioMetric):
    """Per-token means of the statistics a policy loss reports (``GRPOLoss`` and kin, ``DPOLoss``):
    ``clip_frac``, ``kl``, ``entropy``, ``ratio`` over trained tokens; ``reward_accuracy`` and
    ``margin`` over DPO pairs. Each is a ratio of sums since the last reset, so micro-batches of
    different sizes weigh by their tokens, and only the keys the loss reported appear.

    Where the sampler's logprobs were given, over the tokens they cover: ``kl_sample_train_v1``
    and ``kl_sample_train_v2`` (tinker-cookbook's sampler-vs-trainer KL estimates), and the
    importance weights' spread: ``is_weight_mean``, ``is_weight_std`` (population std, from the
    sums of ``w`` and ``w^2``), ``is_weight_min``, ``is_weight_max``, and with a rollout
    correction ``is_truncated_frac`` or ``is_masked_frac``.

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
        ('kl_sample_train_v1', 'kl_sample_train_v1', 'sampled_tokens'),
        ('kl_sample_train_v2', 'kl_sample_train_v2', 'sampled_tokens'),
        ('is_weight_mean', 'is_weight', 'sampled_tokens'),
        ('is_truncated_frac', 'is_truncated', 'sampled_tokens'),
        ('is_masked_frac', 'is_masked', 'sampled_tokens'),
    )
    #: Loss metrics that are extremes, not sums: kept as the smallest (``min``) or largest (``max``) seen.
    extremes: ClassVar[dict[str, str]] = {'is_weight_min': 'min', 'is_weight_max': 'max'}
    seen: dict[str, torch.Tensor | float]

    def reads_logits(self) -> bool:
        return False

    def accumulate(self, *, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], loss: LossOutput | None) -> None:
        if loss is not None:
            self.add(loss.metrics)

    def add(self, values: Mapping[str, torch.Tensor]) -> None:
        super().add({name: value for name, value in values.items() if name not in self.extremes})
        for name, value in values.items():
            if name in self.extremes:
                self._see(name, value.detach())

    def _see(self, name: str, value: torch.Tensor | float) -> None:
        """Keep the smaller (or larger) of ``value`` and the one seen; a tensor stays one (no sync)."""
        current = self.seen.get(name)
        smallest = self.extremes[name] == 'min'
        if current is None:
            self.seen[name] = value
        elif isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
            self.seen[name] = torch.minimum(current, value) if smallest else torch.maximum(current, value)
        else:
            pair = (float(current), float(value))
            self.seen[name] = min(pair) if smallest else max(pair)

    def calculate(self) -> dict[str, float]:
        result = super().calculate()
        if 'is_weight_mean' in result and 'is_weight_sq' in self.sums:
            mean_sq = float(self.sums['is_weight_sq']) / float(self.sums['sampled_tokens'])
            result['is_weight_std'] = math.sqrt(max(mean_sq - result['is_weight_mean'] ** 2, 0.0))
        for name, value in self.seen.items():
            if math.isfinite(float(value)):  # +-inf: no token was seen
                result[name] = float(value)
        return result

    def reset(self) -> None:
        super().reset()
        self.seen = {}

    def state(self) -> dict[str, Any]:
        return {**super().state(), 'extremes': {name: float(value) for name, value in self.seen.items()}}

    def merge(self, state: dict[str, Any]) -> None:
        super().merge(state)
        for name, value in state.get('extremes', {}).items():
            self._see(name, value)
