"""DAPO's soft overlong punishment: a length-aware penalty for completions near the length limit."""

from __future__ import annotations

from collections.abc import Sequence

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError, DataError
from twinkle.reward.base import REWARDS, Reward, Row


def overlong_penalty(length: int, max_length: int, cache_length: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), with
    ``L_max = max_length`` and ``L_cache = cache_length``::

        0                                    if length <= L_max - L_cache
        ((L_max - L_cache) - length) / L_cache   if L_max - L_cache < length <= L_max
        -1                                   if length > L_max

    Added to the task's reward, it tells a truncated completion (whose answer is cut off) from a
    wrong one by its length, with a penalty that grows as the completion runs into the last
    ``L_cache`` tokens, instead of scoring every truncated sample as a failure.

    >>> tuple(overlong_penalty(n, max_length=20, cache_length=4) for n in (16, 18, 20, 21))
    (0.0, -0.5, -1.0, -1.0)
    """
    check_lengths(max_length, cache_length)
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise DataError(f'a completion length must be an integer >= 0; got {length!r}')
    free = max_length - cache_length
    if length <= free:
        return 0.0
    if length <= max_length:
        return (free - length) / cache_length
    return -1.0


def check_lengths(max_length: int, cache_length: int) -> None:
    """``ConfigurationError`` unless ``0 < cache_length <= max_length`` (integers)."""
    for name, value in (('max_length', max_length), ('cache_length', cache_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigurationError(f'{name} must be a positive integer; got {value!r}')
    if cache_length > max_length:
        raise ConfigurationError(
            f'cache_length ({cache_length}) must not exceed max_length ({max_length}): the punished '
            'interval is the last cache_length tokens before the limit'
        )


@REWARDS.register
class OverlongPunishment(Reward):
    """``overlong_penalty`` of each row's completion length, in tokens: the row's trained labels
    (a sampler's ``new_input_feature`` labels its completion). DAPO's setting is
    ``max_length=20480, cache_length=4096`` with the sampler's ``max_tokens`` at ``max_length``.

    >>> row = {'input_ids': [1, 2, 3, 4], 'labels': [-100, 3, 4, 5]}  # three completion tokens
    >>> OverlongPunishment(max_length=4, cache_length=2)([row])
    [-0.5]
    """

    def __init__(self, max_length: int, cache_length: int):
        check_lengths(max_length, cache_length)
        self.max_length, self.cache_length = max_length, cache_length

    def score(self, row: Row, index: int) -> float:
        return overlong_penalty(completion_length(row, index), self.max_length, self.cache_length)


def completion_length(row: Row, index: int) -> int:
    """The completion tokens of an encoded row: its labels that are not ``IGNORE_INDEX``."""
    labels = row.get('labels')
    if not isinstance(labels, Sequence) or isinstance(labels, str):
        raise DataError(
            f'row {index} has no labels to count its completion tokens (fields: {sorted(row)}); '
            "OverlongPunishment takes encoded rows, such as a sampler's new_input_feature"
        )
    return sum(1 for label in labels if label != IGNORE_INDEX)


__all__ = ['OverlongPunishment', 'check_lengths', 'completion_length', 'overlong_penalty']
