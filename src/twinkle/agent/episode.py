"""What one episode of an agent left: every token in order, which of them the model produced
(and with what log-probability), the turns, the rewards, and why it ended.

The tokens are the sampler's own ids with the environment's tokens between turns, never text
decoded and encoded again, so the trainer scores exactly what the sampler produced:
``Episode.to_feature()`` trains the model's tokens only, and ``Episode.old_logps`` are the
sampler's log-probabilities of those tokens in order (what ``GRPOLoss`` takes as ``old_logps``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from twinkle.agent.tools import ToolCall, ToolResult
from twinkle.data_format import InputFeature, Message
from twinkle.template.base import encoded_feature

#: Why an episode ended: the environment said so, or a limit of the rollout, or a failure (the
#: environment raised, or the sampler failed for this episode: ``Episode.error`` says which).
EndReason = Literal['done', 'max_turns', 'max_tokens', 'timeout', 'error']


@dataclass
class Turn:
    """One model turn: what the environment added before it, what the model wrote, and what
    came of it."""

    observation: list[Message]  # the messages the environment added before this turn
    observation_tokens: list[int]  # their tokens, with the header of the assistant turn
    action_tokens: list[int]  # the sampler's ids, the end-of-turn token included when it stopped
    action_logprobs: list[float]  # the sampler's log-probability of each action token
    text: str  # the action decoded (without the end-of-turn token)
    stop_reason: str  # 'stop' (an end of turn) or 'length' (out of tokens for the turn)
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_results: list[ToolResult] = field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Episode:
    """One episode of one environment; ``group`` and ``index`` place it among the episodes of
    the same task (what group-relative advantages compare)."""

    group: int
    index: int
    tokens: list[int] = field(default_factory=list)
    model_mask: list[bool] = field(default_factory=list)  # True where the model produced the token
    logprobs: list[float] = field(default_factory=list)  # the sampler's, 0.0 at environment tokens
    turns: list[Turn] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)  # the conversation, to read or log
    end: EndReason = 'done'
    error: str | None = None
    weight_versions: list[int] = field(default_factory=list)  # the sampler's, one per turn
    user_data: dict[str, Any] = field(default_factory=dict)

    @property
    def reward(self) -> float:
        """The episode's return: its turns' rewards summed (the last one's is the final reward)."""
        return sum(turn.reward for turn in self.turns)

    @property
    def final_reward(self) -> float:
        """What the environment gave for the last turn (0.0 when the episode had none)."""
        return self.turns[-1].reward if self.turns else 0.0

    @property
    def weight_version(self) -> int | None:
        """The oldest weight version any of its turns was sampled with (``None``: no turn)."""
        return min(self.weight_versions) if self.weight_versions else None

    @property
    def num_model_tokens(self) -> int:
        return sum(self.model_mask)

    @property
    def old_logps(self) -> list[float]:
        """The sampler's log-probability of each model token, in order: ``old_logps`` for the
        policy-gradient losses, aligned with ``to_feature()``'s trained labels."""
        return [lp for lp, own in zip(self.logprobs, self.model_mask, strict=True) if own]

    def extend(self, tokens: list[int], logprobs: list[float] | None = None) -> None:
        """Add tokens: the model's with their log-probabilities, the environment's without."""
        self.tokens += tokens
        self.model_mask += [logprobs is not None] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)

    def to_feature(self) -> InputFeature:
        """The episode as a training row: every token in, the model's tokens trained."""
        feature = encoded_feature(list(self.tokens), list(self.model_mask))
        feature['messages'] = list(self.messages)
        feature['user_data'] = {**self.user_data, 'reward': self.reward, 'end': self.end}
        return feature
