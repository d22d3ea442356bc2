"""Scored groups, the rollout item of a GRPO-style loop: a prompt's samples, their rewards and advantages.

``score_group`` turns a sampler's responses into a ``ScoredGroup`` (``num_generations`` samples per
prompt, group-relative advantages); ``trained_rows`` gives a batch of them, as ``AsyncRollouts``
or ``SyncRollouts`` hand it over (``Stamped``), as the sequences and advantages to train on: each
advantage times its item's weight (a stale item kept with ``stale='reweight'``), and with
``skip_flat`` none of a prompt whose samples all scored alike (DAPO's dynamic sampling without the
refill, Yu et al. 2025, arXiv:2503.14476, section 3.2). Their advantages are 0, so they add only a
KL term's pull towards the base model, which once a task is solved goes on unchecked
(docs/async_rl.md, "Stale samples").

>>> group = ScoredGroup(['a', 'b', 'c', 'd'], [1.0, 1.0, 0.0, 1.0], [0.0, 0.0, -1.0, 1.0])
>>> trained_rows([Stamped(group, 0, weight=0.5)], num_generations=2)
(['c', 'd'], [-0.5, 0.5])
>>> trained_rows([Stamped(group, 0)], num_generations=2, skip_flat=False)[0]
['a', 'b', 'c', 'd']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from twinkle.advantage import GRPOAdvantage
from twinkle.advantage.dynamic_sampling import filter_groups
from twinkle.rl.async_rollout import Stamped

S = TypeVar('S')


@dataclass
class ScoredGroup(Generic[S]):
    """The samples of one rollout item (one or more prompts' groups, in order), with a reward and an
    advantage each."""

    sequences: list[S]
    rewards: list[float]
    advantages: list[float]


def score_group(
    responses: Sequence[Any],
    reward_fn: Callable[[list[Any]], list[float]],
    num_generations: int,
    advantage_fn: Callable[..., Any] | None = None,
) -> ScoredGroup[Any]:
    """The sampler's ``responses`` (each with ``num_generations`` ``sequences``) scored by ``reward_fn``
    over their ``new_input_feature``, with group-normalised GRPO advantages (or ``advantage_fn``'s)."""
    sequences = [seq for response in responses for seq in response.sequences]
    rewards = list(reward_fn([seq.new_input_feature for seq in sequences]))
    advantage = advantage_fn or GRPOAdvantage()
    advantages = advantage(rewards, num_generations=num_generations, scale='group').tolist()
    return ScoredGroup(sequences, rewards, advantages)


def trained_rows(
    batch: Sequence[Stamped[ScoredGroup[S]]], num_generations: int, *, skip_flat: bool = True
) -> tuple[list[S], list[float]]:
    """The batch's sequences and advantages (times each item's weight) to train on; see the module docstring."""
    sequences: list[S] = []
    advantages: list[float] = []
    for item in batch:
        group, rows = item.value, list(range(len(item.value.rewards)))
        if skip_flat:
            rows = filter_groups(group.rewards, num_generations).kept_rows
        sequences += [group.sequences[row] for row in rows]
        advantages += [group.advantages[row] * item.weight for row in rows]
    return sequences, advantages
