"""Advantages from rewards, looked up by name with ``ADVANTAGES.get('GRPOAdvantage')``."""

from twinkle.advantage.base import ADVANTAGES, Advantage
from twinkle.advantage.grpo import GRPOAdvantage
from twinkle.advantage.rloo import RLOOAdvantage

__all__ = ['ADVANTAGES', 'Advantage', 'GRPOAdvantage', 'RLOOAdvantage']
