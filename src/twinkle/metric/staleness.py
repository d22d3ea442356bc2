"""How stale the samples a step trains on are: the optimizer steps between the weights that drew
them and the weights they train.

Asynchronous RL (sampling while training) trains on samples the sampler drew with older
weights; each ``SampledSequence`` carries the ``weight_version`` it was drawn with, so a sample's
staleness is ``trainer version - sample version`` (0: on-policy). Off-policy samples are what
``RolloutCorrection`` corrects for, and a staleness that grows is a loop falling behind.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from twinkle.errors import DataError
from twinkle.metric.base import METRICS, Metric


@METRICS.register
class StalenessMetric(Metric):
    """Staleness of the samples since the last reset: ``staleness_mean``, ``staleness_max`` and a
    histogram, ``staleness/<k>`` the number of samples ``k`` versions behind (only the values
    seen). Empty: ``{}``.

    >>> metric = StalenessMetric()
    >>> metric.accumulate(staleness=[0, 0, 2])
    >>> metric.accumulate(trainer_version=5, weight_versions=[4])  # 5 - 4 = 1
    >>> metric.calculate()
    {'staleness_mean': 0.75, 'staleness_max': 2.0, 'staleness/0': 2.0, 'staleness/1': 1.0, 'staleness/2': 1.0}
    """

    counts: Counter[int]

    def __init__(self) -> None:
        self.reset()

    def reads_logits(self) -> bool:
        return False

    def accumulate(
        self,
        inputs: Any = None,
        outputs: Any = None,
        *,
        staleness: Sequence[int] | None = None,
        trainer_version: int | None = None,
        weight_versions: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        """Add samples: their ``staleness`` (versions behind, one int >= 0 each), or the
        ``weight_versions`` they were drawn with and the ``trainer_version`` they train. Other
        arguments (a model's ``inputs``, ``outputs``, ``loss``) are ignored, so the metric can
        sit in a model's metric list."""
        if weight_versions is not None:
            if trainer_version is None:
                raise DataError('StalenessMetric got weight_versions= without trainer_version=: staleness is their gap')
            trainer = _version(trainer_version, 'trainer_version')
            self._add([trainer - _version(v, 'weight_versions') for v in weight_versions])
        if staleness is not None:
            self._add([_version(v, 'staleness') for v in staleness])

    def _add(self, values: list[int]) -> None:
        bad = next((v for v in values if v < 0), None)
        if bad is not None:
            raise DataError(
                f"a sample has staleness {bad}: drawn with weights newer than the trainer's; "
                'staleness is trainer version - sample version, >= 0'
            )
        self.counts.update(values)

    def calculate(self) -> dict[str, float]:
        if not self.counts:
            return {}
        values = list(self.counts.elements())
        result = {'staleness_mean': statistics.fmean(values), 'staleness_max': float(max(values))}
        result.update({f'staleness/{k}': float(n) for k, n in sorted(self.counts.items())})
        return result

    def reset(self) -> None:
        self.counts = Counter()

    def state(self) -> dict[str, Any]:
        return {'counts': {str(k): n for k, n in self.counts.items()}}

    def merge(self, state: dict[str, Any]) -> None:
        self.counts.update({int(k): int(n) for k, n in state['counts'].items()})


def _version(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DataError(f'{name} must be integers (weight versions, optimizer steps); got {value!r:.60}')
    return value
