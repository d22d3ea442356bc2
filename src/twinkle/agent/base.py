"""Environments: what an agent acts in.

An ``Env`` starts an episode with ``reset`` (the first messages: a system prompt, the task),
then answers each model turn with ``step``: the messages it adds (a tool's answers, the user's
next words), a reward, and whether the episode is over. Its methods may be ``async`` (a tool
that waits on a process or the network) or plain; the rollout engine awaits either.

``ToolEnv`` is the usual shape of a tool-using task: a turn with tool calls runs them (through
a ``ToolBox``, so a bad call is an answer the model reads) and the episode goes on; a turn
without one is the final answer, which ``grade`` scores.

A group of environments of one task (``env_groups``) gives the episodes that group-relative
advantages (GRPO, RLOO) compare.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from twinkle.agent.tools import ToolBox, ToolCall, ToolResult
from twinkle.data_format import Message
from twinkle.errors import ConfigurationError

T = TypeVar('T')


@dataclass
class Action:
    """A model turn as the environment sees it: the text (outside tool calls), the calls, and
    the exact token ids."""

    text: str
    tool_calls: list[ToolCall]
    tokens: list[int]
    truncated: bool  # the turn ran out of tokens before its end-of-turn token


@dataclass
class StepResult:
    """The environment's answer to a turn. ``messages`` continue the conversation (none when
    ``done``); ``tool_results`` are the calls' results behind the tool messages, if any."""

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    tool_results: list[ToolResult] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


class Env(ABC):
    """One episode's environment. ``tools`` are offered to the model (rendered by the chat
    template); ``user_data`` goes with the episode (a task id, the answer, for logs)."""

    tools: ToolBox = ToolBox()
    user_data: dict[str, Any]  # set by an environment that has some (the rollout reads it when there)

    @abstractmethod
    def reset(self) -> list[Message] | Awaitable[list[Message]]:
        """The messages that open the episode (at least one; no assistant turn last)."""

    @abstractmethod
    def step(self, action: Action) -> StepResult | Awaitable[StepResult]:
        """The answer to the model's turn."""

    def close(self) -> Awaitable[None] | None:
        """Free what the episode held (a sandbox, a connection)."""
        return None


class ToolEnv(Env):
    """An environment where the model calls tools until it answers; ``grade`` scores the answer.

    ``max_tool_calls`` bounds the calls of one turn (the rest are answered with an error)."""

    def __init__(self, messages: list[Message], tools: ToolBox, max_tool_calls: int = 8):
        if not messages:
            raise ConfigurationError('a ToolEnv needs the messages that open its episode')
        self.messages = messages
        self.tools = tools
        self.max_tool_calls = max_tool_calls

    def reset(self) -> list[Message]:
        return list(self.messages)

    async def step(self, action: Action) -> StepResult:
        if not action.tool_calls:
            return StepResult(reward=await awaited(self.grade(action.text)), done=True)
        calls = action.tool_calls[: self.max_tool_calls]
        results = await self.tools.run(calls)
        for extra in action.tool_calls[self.max_tool_calls :]:
            results.append(ToolResult(extra, f'Error: at most {self.max_tool_calls} tool calls a turn', failed=True))
        messages: list[Message] = [{'role': 'tool', 'content': result.content} for result in results]
        return StepResult(messages=messages, tool_results=results)

    @abstractmethod
    def grade(self, answer: str) -> float | Awaitable[float]:
        """The reward of the final answer."""


def env_groups(make_env: Callable[[int], Env], num_tasks: int, group_size: int) -> list[list[Env]]:
    """``num_tasks`` groups of ``group_size`` environments, ``make_env(task)`` building each
    (the same task for a whole group: its episodes are what GRPO compares)."""
    if num_tasks <= 0 or group_size <= 0:
        raise ConfigurationError(f'num_tasks and group_size must be positive; got {num_tasks} and {group_size}')
    return [[make_env(task) for _ in range(group_size)] for task in range(num_tasks)]


async def awaited(value: T | Awaitable[T]) -> T:
    """``value``, awaited when it is awaitable: an environment's method may be sync or async."""
    if inspect.isawaitable(value):
        return await value
    return value


def flat(groups: Sequence[Sequence[T]]) -> list[T]:
    return [item for group in groups for item in group]
