"""Preprocessors for the text datasets the cookbook uses."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from twinkle.data_format import Message, Trajectory
from twinkle.preprocessor.base import PREPROCESSORS, Preprocessor

DEFAULT_SYSTEM = 'You are a helpful assistant.'


@PREPROCESSORS.register
class SelfCognitionProcessor(Preprocessor):
    """swift/self-cognition rows (``query``, ``response`` with ``{{NAME}}`` and ``{{AUTHOR}}``
    placeholders) into a system/user/assistant conversation about the named model."""

    required_fields = ('query', 'response')

    def __init__(self, model_name: str, model_author: str, system: str = DEFAULT_SYSTEM):
        self.model_name, self.model_author, self.system = model_name, model_author, system

    def _fill(self, text: str) -> str:
        return text.replace('{{NAME}}', self.model_name).replace('{{AUTHOR}}', self.model_author)

    def preprocess(self, row: Mapping[str, Any]) -> Trajectory:
        return {
            'messages': [
                {'role': 'system', 'content': self.system},
                {'role': 'user', 'content': self._fill(row['query'])},
                {'role': 'assistant', 'content': self._fill(row['response'])},
            ]
        }


GSM8K_SYSTEM = (
    'You are a helpful math assistant. Solve the problem step by step, '
    'then give the final answer on its own line as "#### <number>".'
)
_GSM8K_ANSWER = re.compile(r'####\s*([\-\d,.]+)')


def gsm8k_final_answer(text: str) -> str:
    """The number after the last ``####`` with commas removed, or '' if there is none."""
    matches = _GSM8K_ANSWER.findall(text)
    return matches[-1].replace(',', '').rstrip('.').strip() if matches else ''


@PREPROCESSORS.register
class GSM8KProcessor(Preprocessor):
    """GSM8K rows (``question``, ``answer`` ending in ``#### <number>``) into a math prompt; the
    number goes to ``user_data['ground_truth']`` for rewards. ``add_assistant=True`` keeps the
    worked answer as an assistant turn (for SFT)."""

    required_fields = ('question', 'answer')

    def __init__(self, system: str | None = None, add_assistant: bool = False):
        self.system = GSM8K_SYSTEM if system is None else system
        self.add_assistant = add_assistant

    def preprocess(self, row: Mapping[str, Any]) -> Trajectory:
        messages: list[Message] = [
            {'role': 'system', 'content': self.system},
            {'role': 'user', 'content': row['question']},
        ]
        if self.add_assistant:
            messages.append({'role': 'assistant', 'content': row['answer']})
        return {'messages': messages, 'user_data': {'ground_truth': gsm8k_final_answer(row['answer'])}}


@PREPROCESSORS.register
class AlpacaProcessor(Preprocessor):
    """Alpaca rows (``instruction``, optional ``input``, ``output``) into user/assistant turns."""

    required_fields = ('instruction', 'output')

    def preprocess(self, row: Mapping[str, Any]) -> Trajectory:
        prompt = row['instruction']
        if row.get('input'):
            prompt = f'{prompt}\n{row["input"]}'
        return {'messages': [{'role': 'user', 'content': prompt}, {'role': 'assistant', 'content': row['output']}]}
