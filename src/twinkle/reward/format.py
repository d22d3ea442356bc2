"""A reward for completions that follow a regular-expression format."""

from __future__ import annotations

import re

from twinkle.errors import ConfigurationError
from twinkle.reward.base import REWARDS, Reward, Row, completion_of

#: DeepSeek-R1's format: reasoning in <think>, then the answer in <answer>.
THINK_ANSWER = r'<think>.*?</think>\s*<answer>.*?</answer>'


@REWARDS.register
class FormatReward(Reward):
    """1.0 when the whole completion (surrounding whitespace stripped) matches ``pattern``,
    else 0.0. The default is the format reward of DeepSeek-R1 (DeepSeek-AI 2025,
    arXiv:2501.12948, section 2.2.2): the reasoning between ``<think>`` tags, then the answer
    between ``<answer>`` tags. ``flags`` default to ``re.DOTALL`` so ``.`` spans lines.

    >>> FormatReward()([{'messages': [{'role': 'assistant', 'content': '<think>2+2</think> <answer>4</answer>'}]}])
    [1.0]
    """

    def __init__(self, pattern: str = THINK_ANSWER, flags: int = re.DOTALL):
        if not isinstance(pattern, str):
            raise ConfigurationError(f'FormatReward pattern must be a string; got {pattern!r}')
        try:
            self.pattern = re.compile(pattern, flags)
        except re.error as err:
            raise ConfigurationError(
                f'FormatReward pattern {pattern!r} is not a valid regular expression: {err}'
            ) from None

    def score(self, row: Row, index: int) -> float:
        return 1.0 if self.pattern.fullmatch(completion_of(row, index).strip()) else 0.0
