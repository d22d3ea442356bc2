"""Reinforcement-learning loops: rollouts that overlap training, with bounded staleness, or the synchronous loop."""

from twinkle.rl.async_rollout import AsyncRollouts, AsyncRolloutStats, Session, Stamped, batch_staleness
from twinkle.rl.groups import ScoredGroup, score_group, trained_rows
from twinkle.rl.partial import generate_partial
from twinkle.rl.sync_rollout import SyncRollouts

__all__ = [
    'AsyncRolloutStats',
    'AsyncRollouts',
    'ScoredGroup',
    'Session',
    'Stamped',
    'SyncRollouts',
    'batch_staleness',
    'generate_partial',
    'score_group',
    'trained_rows',
]
