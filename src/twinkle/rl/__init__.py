"""Reinforcement-learning loops: rollouts that overlap training, with bounded staleness."""

from twinkle.rl.async_rollout import AsyncRollouts, AsyncRolloutStats, Session, Stamped
from twinkle.rl.partial import generate_partial

__all__ = ['AsyncRolloutStats', 'AsyncRollouts', 'Session', 'Stamped', 'generate_partial']
