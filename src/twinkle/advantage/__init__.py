"""Advantages from rewards, looked up by name with ``ADVANTAGES.get('GRPOAdvantage')``; per-token
advantages on a forward's ``[B, T]`` grid (GAE with a critic, REINFORCE++) and DAPO's dynamic sampling."""

from twinkle.advantage.base import ADVANTAGES, Advantage
from twinkle.advantage.dynamic_sampling import DynamicBatch, GroupFilter, filter_groups, sample_until_full
from twinkle.advantage.grpo import GRPOAdvantage
from twinkle.advantage.per_token import gae, per_sequence, token_rewards
from twinkle.advantage.reinforce_pp import reinforce_pp, reinforce_pp_baseline
from twinkle.advantage.rloo import RLOOAdvantage

__all__ = [
    'ADVANTAGES',
    'Advantage',
    'DynamicBatch',
    'GRPOAdvantage',
    'GroupFilter',
    'RLOOAdvantage',
    'filter_groups',
    'gae',
    'per_sequence',
    'reinforce_pp',
    'reinforce_pp_baseline',
    'sample_until_full',
    'token_rewards',
]
