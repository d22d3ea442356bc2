"""DAPO's dynamic sampling: keep only the groups whose rewards differ, and sample until the batch is full.

A group whose samples all scored alike (all right or all wrong) has group-relative advantages of
exactly 0: it adds tokens to the batch and nothing to the gradient, and as the policy improves
more and more groups are all right. DAPO (Yu et al. 2025, arXiv:2503.14476, section 3.2, eq. 11's
constraint ``0 < |{o_i correct}| < G``) drops those groups and samples more prompts until the
batch holds as many informative groups as it should, so every step's gradient has the same
number of prompts behind it.

Groups are contiguous, ``num_generations`` rows each, as in ``twinkle.advantage.base``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from twinkle.advantage.base import Rewards, _as_rewards
from twinkle.errors import ConfigurationError, DataError

Row = TypeVar('Row')


@dataclass(frozen=True)
class GroupFilter:
    """Which groups of a batch carry a signal: ``kept_groups`` (group indices, in order) and
    ``kept_rows`` (their rows' indices), ``dropped`` (groups whose rewards were all equal), and
    ``refill``: how many more groups the caller needs to reach its target (0 without one)."""

    kept_groups: list[int]
    kept_rows: list[int]
    dropped: int
    refill: int = 0


def filter_groups(rewards: Rewards, num_generations: int, target_groups: int | None = None) -> GroupFilter:
    """The groups of ``rewards`` (``[N]``, contiguous groups of ``num_generations``) whose rewards
    are not all equal; ``refill`` is ``target_groups`` minus the groups kept (at least 0).

    >>> kept = filter_groups([1.0, 1.0, 0.0, 1.0, 0.0, 0.0], num_generations=2, target_groups=3)
    >>> kept.kept_groups, kept.kept_rows, kept.dropped, kept.refill
    ([1], [2, 3], 2, 2)
    """
    _check_positive('num_generations', num_generations)
    if target_groups is not None:
        _check_positive('target_groups', target_groups)
    rewards_N = _as_rewards(rewards)
    if rewards_N.numel() % num_generations:
        raise DataError(
            f'got {rewards_N.numel()} rewards, not a multiple of num_generations={num_generations}; '
            'each prompt needs exactly num_generations samples, in contiguous groups'
        )
    rewards_P_G = rewards_N.reshape(-1, num_generations)
    varied_P = (rewards_P_G != rewards_P_G[:, :1]).any(dim=1)
    kept = [int(i) for i in varied_P.nonzero().flatten()]
    rows = [group * num_generations + j for group in kept for j in range(num_generations)]
    refill = 0 if target_groups is None else max(0, target_groups - len(kept))
    return GroupFilter(kept, rows, dropped=int(rewards_P_G.shape[0]) - len(kept), refill=refill)


@dataclass
class DynamicBatch(Generic[Row]):
    """A batch dynamic sampling filled: ``target_groups`` groups of ``num_generations`` rows,
    each with rewards that differ; ``tries``: the sampling calls it took; ``sampled_groups`` and
    ``dropped_groups``: all the groups sampled and those left out (all equal, or past the target)."""

    rows: list[Row] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    tries: int = 0
    sampled_groups: int = 0
    dropped_groups: int = 0


#: ``sample(groups)``: that many new groups, as (rows, rewards), ``groups * num_generations`` of each.
Sampler = Callable[[int], tuple[Sequence[Row], Rewards]]


def sample_until_full(
    sample: Sampler[Row], target_groups: int, num_generations: int, max_tries: int = 8
) -> DynamicBatch[Row]:
    """Call ``sample(n)`` for the ``n`` groups still missing, keep the groups whose rewards differ,
    until ``target_groups`` are kept (groups past the target are dropped); ``DataError`` if
    ``max_tries`` calls do not fill the batch (the prompts are all too easy or too hard for the
    policy: raise ``max_tries`` or change the prompts)."""
    _check_positive('target_groups', target_groups)
    _check_positive('max_tries', max_tries)
    batch: DynamicBatch[Row] = DynamicBatch()
    while len(batch.rows) < target_groups * num_generations:
        if batch.tries == max_tries:
            full = len(batch.rows) // num_generations
            raise DataError(
                f'dynamic sampling kept {full} of {target_groups} groups after max_tries={max_tries} tries '
                f'({batch.sampled_groups} groups sampled, every other one scored alike); raise max_tries, or '
                'use prompts whose samples score differently'
            )
        wanted = target_groups - len(batch.rows) // num_generations
        rows, rewards = sample(wanted)
        rewards_N = _as_rewards(rewards)
        if len(rows) != rewards_N.numel() or len(rows) != wanted * num_generations:
            raise DataError(
                f'sample({wanted}) returned {len(rows)} rows and {rewards_N.numel()} rewards; it must return '
                f'{wanted} groups of num_generations={num_generations}: {wanted * num_generations} of each'
            )
        kept = filter_groups(rewards_N, num_generations)
        room = target_groups - len(batch.rows) // num_generations
        rows_kept = kept.kept_rows[: room * num_generations]
        batch.rows.extend(rows[i] for i in rows_kept)
        batch.rewards.extend(float(rewards_N[i]) for i in rows_kept)
        batch.tries += 1
        batch.sampled_groups += wanted
        batch.dropped_groups += wanted - len(rows_kept) // num_generations
    return batch


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigurationError(f'{name} must be a positive integer; got {value!r}')


__all__ = ['DynamicBatch', 'GroupFilter', 'Sampler', 'filter_groups', 'sample_until_full']
