"""Environments the agent tests share."""

from __future__ import annotations

from twinkle.agent import Action, Env, StepResult


class Countdown(Env):
    """Answers every turn with the next user message until ``turns`` turns; reward 0.25 a turn."""

    def __init__(self, turns: int = 3, raise_at: int | None = None):
        self.turns, self.raise_at, self.seen = turns, raise_at, 0
        self.closed = False

    def reset(self) -> list[dict[str, str]]:
        return [{'role': 'user', 'content': 'Count down with me.'}]

    async def step(self, action: Action) -> StepResult:
        self.seen += 1
        if self.seen == self.raise_at:
            raise ValueError('the environment broke')
        done = self.seen >= self.turns
        return StepResult(
            messages=[] if done else [{'role': 'user', 'content': f'{self.turns - self.seen} left'}],
            reward=0.25,
            done=done,
        )

    def close(self) -> None:
        self.closed = True
