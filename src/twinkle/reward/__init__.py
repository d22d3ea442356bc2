"""Rewards (rows to one float each), looked up by name with ``REWARDS.get('GSM8KAccuracyReward')``."""

from twinkle.reward.base import REWARDS, Reward
from twinkle.reward.format import FormatReward
from twinkle.reward.gsm8k import GSM8KAccuracyReward, GSM8KFormatReward
from twinkle.reward.letter_words import LetterWordsReward
from twinkle.reward.overlong import OverlongPunishment, overlong_penalty

__all__ = [
    'REWARDS',
    'FormatReward',
    'GSM8KAccuracyReward',
    'GSM8KFormatReward',
    'LetterWordsReward',
    'OverlongPunishment',
    'Reward',
    'overlong_penalty',
]
