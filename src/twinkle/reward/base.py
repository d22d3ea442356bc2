"""The reward interface: ``reward(trajectories) -> list[float]``, one float per row.

A row is a ``Trajectory`` (``messages``, optional ``user_data``) or an encoded feature that also
carries them, as a sampler's ``SampledSequence.new_input_feature`` does. The completion to score
is the content of the row's LAST assistant message; task data such as the ground truth is in
``row['user_data']``, a dict (a list of ``[key, value]`` pairs, twinkle-kit's wire form, is read
the same way).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from twinkle.errors import DataError
from twinkle.registry import Registry

Row = Mapping[str, Any]


class Reward:
    """Scores rows. Per-row rewards implement ``score``; a reward that scores a batch at once
    (a reward model) overrides ``__call__`` instead."""

    def __call__(self, trajectories: Sequence[Row]) -> list[float]:
        return [float(self.score(row, index)) for index, row in enumerate(trajectories)]

    def score(self, row: Row, index: int) -> float:
        """The reward of ``row``, the ``index``-th of its batch (for error messages)."""
        raise NotImplementedError


def completion_of(row: Row, index: int) -> str:
    """The content of the last assistant message of ``row``; ``DataError`` if there is none."""
    messages = row.get('messages') if isinstance(row, Mapping) else None
    if isinstance(messages, Sequence):
        for message in reversed(messages):
            if isinstance(message, Mapping) and message.get('role') == 'assistant':
                content = message.get('content')
                if not isinstance(content, str):
                    raise DataError(f'row {index}: the last assistant message has content {content!r}, not a string')
                return content
    fields = sorted(row) if isinstance(row, Mapping) else type(row).__name__
    raise DataError(
        f'row {index} has no assistant message to score (fields: {fields}); rewards take sampled rows, '
        f'whose messages end with the completion'
    )


def user_data_of(row: Row, index: int) -> dict[str, Any]:
    """``row['user_data']`` as a dict (empty when absent), from a dict or ``[key, value]`` pairs."""
    data = row.get('user_data')
    if data is None:
        return {}
    if isinstance(data, Mapping):
        return dict(data)
    if _is_sequence(data) and all(_is_sequence(pair) and len(pair) == 2 for pair in data):
        return {key: value for key, value in data}
    raise DataError(f'row {index}: user_data must be a dict or a list of [key, value] pairs; got {data!r}')


def _is_sequence(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str)


REWARDS: Registry[Reward] = Registry('reward')
