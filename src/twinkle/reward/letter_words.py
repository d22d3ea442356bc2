"""The letter-words task: "Write words that start with the letter s.", and its reward.

The cookbook's GRPO, async GRPO and PPO recipes train the embedded tiny model on it from
scratch: the embedded tokenizer has whole-word tokens with a leading space for each letter, so
even the random policy writes such a word now and then (``cookbook/grpo_letter_words.py`` says
why that is enough for RL to start). A prompt row carries its letter in ``user_data``, which
the reward reads back.

>>> row = letter_words_prompt('s')
>>> row['messages'][0]['content'], row['user_data']
('Write words that start with the letter s.', {'letter': 's'})
>>> row['messages'].append({'role': 'assistant', 'content': 'sun Sea moon sky'})
>>> LetterWordsReward(target_words=4)([row])  # 3 of the 4 words asked for
[0.75]
"""

from __future__ import annotations

import random
import re
from typing import Any

from twinkle.reward.base import REWARDS, Reward, Row, completion_of, user_data_of


@REWARDS.register
class LetterWordsReward(Reward):
    """The share of ``target_words`` words in the completion that start with the letter the
    prompt asks for (``user_data['letter']``, either case), capped at 1."""

    def __init__(self, target_words: int = 4):
        self.target_words = target_words

    def score(self, row: Row, index: int) -> float:
        letter = str(user_data_of(row, index)['letter'])
        words: list[str] = re.findall(r'\S+', completion_of(row, index))
        hits = sum(word[0].lower() == letter for word in words)
        return min(1.0, hits / self.target_words)


def letter_words_prompt(letter: str) -> dict[str, Any]:
    """The prompt row asking for words that start with ``letter``."""
    return {
        'messages': [{'role': 'user', 'content': f'Write words that start with the letter {letter}.'}],
        'user_data': {'letter': letter},
    }


def letter_words_prompts(letters: str, count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` prompt rows, each for a letter of ``letters`` drawn from ``random.Random(seed)``:
    the same rows for the same seed, however the run splits them across steps, ranks or threads.

    >>> [row['user_data']['letter'] for row in letter_words_prompts('sc', 4, seed=0)]
    ['c', 'c', 's', 'c']
    """
    rng = random.Random(seed)
    return [letter_words_prompt(rng.choice(letters)) for _ in range(count)]
