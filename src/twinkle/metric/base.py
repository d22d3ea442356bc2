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

from typing import Any

from twinkle.registry import Registry


class Metric:
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


METRICS: Registry[Metric] = Registry('metric')
