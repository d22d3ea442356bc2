"""Guess the number: the environment thinks of a whole number, the model guesses, the
environment answers "higher" or "lower", over several turns (tinker-cookbook's ``guess_number``
recipe, made small enough for the embedded tiny model to learn from scratch).

The model's guess is the first whole number in its turn. Finding the number is worth 1.0, and
every guess the answers so far allow (a repeated guess, or a guess under one already answered
"higher", is not) earns ``closeness_reward / max_guesses`` times how close it came
(``1 - |guess - number| / (high - low)``): so each part of a good strategy pays on its own, a
first guess in the middle of the range (closest on average) before guesses that follow
"higher" and "lower", before finding the number often. With a reward for finding alone, a
policy guessing at random learns nothing of where to start, which pays only through what later
guesses make of it. ``format_reward`` is given for each turn that held a guess at all.
"""

from __future__ import annotations

import random
import re

from twinkle.agent.base import Action, Env, StepResult
from twinkle.data_format import Message
from twinkle.errors import ConfigurationError

_NUMBER = re.compile(r'\d+')


class GuessNumberEnv(Env):
    """One game: a number in ``[low, high]`` drawn from ``seed``, ``max_guesses`` turns."""

    def __init__(
        self,
        seed: int,
        low: int = 1,
        high: int = 9,
        max_guesses: int = 4,
        closeness_reward: float = 0.5,
        format_reward: float = 0.0,
    ):
        if low >= high or max_guesses <= 0:
            raise ConfigurationError(f'need low < high and max_guesses > 0; got {low}, {high}, {max_guesses}')
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.closeness_reward, self.format_reward = closeness_reward, format_reward
        self.target = random.Random(seed).randint(low, high)
        self.guesses: list[int] = []
        self.turns = 0
        self.allowed = (low, high)  # the numbers the answers so far leave
        self.user_data = {'target': self.target}

    def reset(self) -> list[Message]:
        self.guesses, self.turns, self.allowed = [], 0, (self.low, self.high)
        return [{'role': 'user', 'content': f'Guess my number from {self.low} to {self.high}. Reply with one number.'}]

    def step(self, action: Action) -> StepResult:
        self.turns += 1
        match = _NUMBER.search(action.text)
        if match is None:
            return self._next(f'Reply with a number from {self.low} to {self.high}.', reward=0.0)
        guess = int(match.group())
        self.guesses.append(guess)
        low, high = self.allowed
        reward = self.format_reward
        if low <= guess <= high:
            reward += self.closeness_reward * self.closeness(guess) / self.max_guesses
        self.allowed = (max(low, guess + 1), high) if guess < self.target else (low, min(high, guess - 1))
        if guess == self.target:
            return StepResult(reward=1.0 + reward, done=True, metrics={'found': 1.0})
        return self._next('Higher.' if guess < self.target else 'Lower.', reward=reward)

    def _next(self, says: str, reward: float) -> StepResult:
        if self.turns < self.max_guesses:
            return StepResult(messages=[{'role': 'user', 'content': says}], reward=reward)
        return StepResult(reward=reward, done=True, metrics={'found': 0.0})

    def closeness(self, guess: int) -> float:
        """How close ``guess`` is: 1 at the number, 0 a whole range away or more."""
        return max(0.0, 1.0 - abs(guess - self.target) / (self.high - self.low))


def guess_number_envs(
    num_tasks: int, group_size: int, seed: int, high: int = 9, max_guesses: int = 4, closeness_reward: float = 0.5
) -> list[list[Env]]:
    """``num_tasks`` games (numbers drawn from ``seed``), each played by ``group_size`` episodes."""
    seeds = random.Random(seed).sample(range(1 << 30), num_tasks)

    def game(task: int) -> Env:
        return GuessNumberEnv(seeds[task], high=high, max_guesses=max_guesses, closeness_reward=closeness_reward)

    return [[game(task) for _ in range(group_size)] for task in range(num_tasks)]
