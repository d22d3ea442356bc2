"""The metric interface: ``accumulate`` values, ``calculate`` a dict of floats, ``reset``.

Metrics that a model feeds (``model.add_metric``) take ``accumulate(*, inputs, outputs, loss)``:
the collated batch, the model outputs (``logits``) and the ``LossOutput`` (or ``None``).
Values are kept as detached tensors and turned into floats only in ``calculate``, so a
training step never waits on the device for a metric.
"""

from __future__ import annotations

from typing import Any

from twinkle.registry import Registry


class Metric:
    def accumulate(self, **values: Any) -> None:
        raise NotImplementedError

    def calculate(self) -> dict[str, float]:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError


METRICS: Registry[Metric] = Registry('metric')
