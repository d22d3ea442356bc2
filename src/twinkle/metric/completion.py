from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from twinkle.errors import DataError
from twinkle.metric.base import METRICS, Metric


@METRICS.register
class CompletionRewardMetric(Metric):
    """What an RL step sampled, since the last reset.

    ``calculate`` gives, for each reward name, ``{name}_reward`` (mean over all completions) and
    ``{name}_reward_std`` (sample std, divisor ``n - 1``; 0 for fewer than 2 values);
    ``completion_length`` (mean tokens per completion); and ``generate_time_s`` and
    ``weight_sync_time_s`` (mean seconds per ``accumulate`` call that gave them). Figures never
    given are left out; an empty metric gives ``{}``.

    >>> metric = CompletionRewardMetric()
    >>> metric.accumulate(rewards={'accuracy': [1.0, 0.0]}, completion_lengths=[3, 5])
    >>> metric.calculate()
    {'accuracy_reward': 0.5, 'accuracy_reward_std': 0.7071067811865476, 'completion_length': 4.0}
    """

    def __init__(self) -> None:
        self.reset()

    def reads_logits(self) -> bool:
        return False

    def accumulate(
        self,
        inputs: Any = None,
        outputs: Any = None,
        *,
        rewards: Mapping[str, Sequence[float]] | Sequence[float] | None = None,
        completion_lengths: Sequence[int] | None = None,
        generate_time: float | None = None,
        weight_sync_time: float | None = None,
        **kwargs: Any,
    ) -> None:
        """Add one step's figures. ``rewards`` maps a reward name to one float per completion (a
        plain list is named ``'total'``). ``inputs``, ``outputs`` and other keywords (a model's
        ``loss``) are accepted and ignored, so the metric can sit in a model's metric list."""
        if rewards is not None:
            self._add_rewards(rewards)
        if completion_lengths is not None:
            self.lengths.extend(int(length) for length in completion_lengths)
        for key, seconds in (('generate_time_s', generate_time), ('weight_sync_time_s', weight_sync_time)):
            if seconds is not None:
                self.times.setdefault(key, []).append(float(seconds))

    def _add_rewards(self, rewards: Mapping[str, Sequence[float]] | Sequence[float]) -> None:
        named = rewards if isinstance(rewards, Mapping) else {'total': rewards}
        for name, values in named.items():
            try:
                floats = [float(value) for value in values]
            except (TypeError, ValueError) as err:
                raise DataError(f'reward {name!r} must be a list of numbers; {err}') from None
            bad = next((i for i, value in enumerate(floats) if not math.isfinite(value)), None)
            if bad is not None:
                raise DataError(f'reward {name!r} at index {bad} is {floats[bad]}; rewards must be finite numbers')
            self.rewards.setdefault(name, []).extend(floats)

    def calculate(self) -> dict[str, float]:
        result: dict[str, float] = {}
        for name, values in self.rewards.items():
            if values:
                result[f'{name}_reward'] = statistics.fmean(values)
                result[f'{name}_reward_std'] = statistics.stdev(values) if len(values) > 1 else 0.0
        if self.lengths:
            result['completion_length'] = statistics.fmean(self.lengths)
        for key, seconds in self.times.items():
            result[key] = statistics.fmean(seconds)
        return result

    def reset(self) -> None:
        self.rewards: dict[str, list[float]] = {}
        self.lengths: list[int] = []
        self.times: dict[str, list[float]] = {}

    def state(self) -> dict[str, Any]:
        return {
            'rewards': {name: list(values) for name, values in self.rewards.items()},
            'lengths': list(self.lengths),
            'times': {key: list(seconds) for key, seconds in self.times.items()},
        }

    def merge(self, state: dict[str, Any]) -> None:
        for name, values in state['rewards'].items():
            self.rewards.setdefault(name, []).extend(values)
        self.lengths.extend(state['lengths'])
        for key, seconds in state['times'].items():
            self.times.setdefault(key, []).extend(seconds)
