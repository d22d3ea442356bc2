"""The metric interface: ``accumulate`` values, ``calculate`` a dict of floats, ``reset``.

Metrics that a model feeds (``model.add_metric``) take ``accumulate(*, inputs, outputs, loss)``:
the collated batch, the model outputs (``logits``) and the ``LossOutput`` (or ``None``).
Values are kept as detached tensors and turned into floats only in ``calculate``, so a
training step never waits on the device for a metric.

Under data parallelism each rank accumulates its own share; before ``calculate`` the model
gathers every rank's ``state()`` (plain Python values) and ``merge``s the others' into its own,
so every rank reports the figures of the global batch. A metric whose ``state()`` is ``None``
(the default) reports its own rank's values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from twinkle.registry import Registry


class Metric:
    def reads_logits(self) -> bool:
        """Whether ``accumulate`` reads ``outputs['logits']``. A model with its fused output layer
        on (``fused_output=True``) makes no logits in a training pass, so an adapter with a
        metric that reads them runs its passes unfused; a metric that reads none says False."""
        return True

    def accumulate(self, *args: Any, **values: Any) -> None:
        """Add one call's values. Each metric declares the keywords it takes (see the module
        docstring); ``*args: Any`` lets a subclass narrow this signature to its own."""
        raise NotImplementedError

    def calculate(self) -> dict[str, float]:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def state(self) -> dict[str, Any] | None:
        """What has been accumulated, as plain Python values (no tensors): what ``merge`` takes."""
        return None

    def merge(self, state: dict[str, Any]) -> None:
        """Add another rank's ``state()`` to this metric, as if this one had accumulated it too."""
        raise NotImplementedError(f'{type(self).__name__} does not merge across ranks')


class RatioMetric(Metric):
    """A metric whose figures are ratios of sums kept since the last reset: ``ratios`` names each
    reported key with its numerator and denominator among the sums.

    A ratio of sums, not a mean of per-batch ratios, so each micro-batch (and each rank) weighs
    by its denominator. A key whose numerator was never added, or whose denominator is 0, is
    left out. Sums stay detached tensors until ``calculate``.

    >>> class HitRate(RatioMetric):
    ...     ratios = (('hit_rate', 'hits', 'tries'),)
    >>> metric = HitRate()
    >>> metric.add({'hits': torch.tensor(1), 'tries': torch.tensor(3)})
    >>> metric.add({'hits': torch.tensor(0), 'tries': torch.tensor(1)})
    >>> metric.calculate()  # 1 / 4, not the mean of 1/3 and 0
    {'hit_rate': 0.25}
    """

    #: (reported key, numerator, denominator), the last two names of sums.
    ratios: ClassVar[tuple[tuple[str, str, str], ...]]
    sums: dict[str, torch.Tensor | float]

    def __init__(self) -> None:
        self.reset()

    def add(self, values: Mapping[str, torch.Tensor]) -> None:
        """Add each value to the sum of its name (a new tensor: the caller's is never aliased)."""
        for name, value in values.items():
            self.sums[name] = self.sums.get(name, 0) + value.detach()

    def calculate(self) -> dict[str, float]:
        values = {name: float(total) for name, total in self.sums.items()}
        return {key: values[num] / values[den] for key, num, den in self.ratios if num in values and values.get(den)}

    def reset(self) -> None:
        self.sums = {}

    def state(self) -> dict[str, Any]:
        return {'sums': {name: float(total) for name, total in self.sums.items()}}

    def merge(self, state: dict[str, Any]) -> None:
        for name, total in state['sums'].items():
            self.sums[name] = float(self.sums.get(name, 0.0)) + total


METRICS: Registry[Metric] = Registry('metric')
