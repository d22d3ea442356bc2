"""Rewards for GSM8K completions that end in ``#### <number>``, as ``GSM8K_SYSTEM`` asks."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from twinkle.errors import DataError
from twinkle.reward.base import REWARDS, Reward, Row, completion_of, user_data_of

#: A number as GSM8K writes it: optional minus, digits with optional thousands commas, decimals.
_NUMBER = r'-?\d[\d,]*(?:\.\d+)?'
_ANSWER_AFTER_MARK = re.compile(rf'[ \t]*({_NUMBER})')
#: A whole line that is only the final answer; a full stop after the number is allowed.
_ANSWER_LINE = re.compile(rf'^[ \t]*####[ \t]*{_NUMBER}[ \t]*\.?[ \t]*$', re.MULTILINE)


def parse_number(text: str) -> Decimal | None:
    """``text`` as an exact number, thousands commas removed ('1,000' -> 1000), or ``None``."""
    try:
        number = Decimal(text.strip().replace(',', ''))
    except InvalidOperation:
        return None
    return number if number.is_finite() else None


def final_answer(completion: str) -> Decimal | None:
    """The number right after the LAST ``####`` of ``completion``; ``None`` when there is no
    ``####`` or no number follows the last one (an earlier ``####`` does not count)."""
    mark = completion.rfind('####')
    if mark < 0:
        return None
    match = _ANSWER_AFTER_MARK.match(completion, mark + len('####'))
    return parse_number(match.group(1)) if match else None


@REWARDS.register
class GSM8KAccuracyReward(Reward):
    """1.0 when the number after the completion's last ``####`` equals
    ``user_data['ground_truth']`` as a number ('1,234' == '1234', '3.0' == '3'), else 0.0.

    Strict on purpose: a completion without ``####`` scores 0.0 even if its last number is
    right, since the prompt (``GSM8K_SYSTEM``) asks for that format and a lenient fallback would
    reward answers a grader cannot find. Rows without a numeric ground truth raise ``DataError``
    (``GSM8KProcessor`` puts it there).

    >>> row = {'messages': [{'role': 'assistant', 'content': '6 * 7\\n#### 42'}], 'user_data': {'ground_truth': '42'}}
    >>> GSM8KAccuracyReward()([row])
    [1.0]
    """

    def score(self, row: Row, index: int) -> float:
        completion = completion_of(row, index)
        truth = user_data_of(row, index).get('ground_truth')
        expected = parse_number(str(truth)) if isinstance(truth, (str, int, float)) else None
        if expected is None:
            raise DataError(
                f"row {index}: user_data['ground_truth'] must be a number; got {truth!r} "
                f'(GSM8KProcessor puts the answer of a GSM8K row there)'
            )
        return 1.0 if final_answer(completion) == expected else 0.0


@REWARDS.register
class GSM8KFormatReward(Reward):
    """1.0 when the completion has a line that is exactly ``#### <number>`` (surrounding spaces
    and a trailing full stop allowed), the format ``GSM8K_SYSTEM`` asks for; else 0.0. The answer
    is not checked; ``GSM8KAccuracyReward`` does that.

    >>> GSM8KFormatReward()([{'messages': [{'role': 'assistant', 'content': 'so\\n#### 1,234'}]}])
    [1.0]
    """

    def score(self, row: Row, index: int) -> float:
        return 1.0 if _ANSWER_LINE.search(completion_of(row, index)) else 0.0
