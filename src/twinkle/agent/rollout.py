"""The rollout engine: many episodes at once, token in, token out.

Each episode is a coroutine: it asks the ``Batcher`` for its next turn, reads the model's tool
calls, awaits its environment, and appends the environment's answer as the tokens the chat
template gives for it (``Template.continuation``), never re-encoding what the model wrote. The
episodes' requests meet in the batcher, so the sampler continues all the episodes that are ready
in one call while the others wait on their tools.

    engine = RolloutEngine(sampler, template, SamplingParams(max_tokens=64), max_turns=10)
    episodes = engine.rollout(env_groups(make_env, num_tasks=8, group_size=4))

An episode ends when its environment says so, or at ``max_turns``, at ``max_episode_tokens``
(prompt and environment tokens included), when a turn outlasts ``turn_timeout_s``, or when its
environment raises: that episode ends with ``end='error'``, counted in ``stats``; the others go on.

A turn that times out in its step (a tool, the grading) keeps its ``Turn``: the sampled tokens
and log-probabilities are in ``Episode.tokens`` already, and the turn's tool calls are recorded
as answered ``timed_out``, so the turns and the tokens agree. The step itself is cancelled: an
async tool stops at its next ``await``; a sync one cannot be stopped, and runs on in its thread,
abandoned (``tools.ToolThreads``: nothing waits for it, neither ``rollout()`` nor the process's
exit, and at most ``max_abandoned`` are left at once). One timing out while it samples keeps no
turn: nothing was added to the episode.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from twinkle.agent.base import Action, Env, StepResult, awaited, flat
from twinkle.agent.episode import Episode, Turn
from twinkle.agent.generator import Batcher, Generation, as_generator
from twinkle.agent.tools import ToolResult, parse_tool_calls
from twinkle.data_format import Message, SamplingParams
from twinkle.errors import ConfigurationError, DataError
from twinkle.template import Template
from twinkle.utils.logger import get_logger

logger = get_logger()


@dataclass
class RolloutStats:
    """What one ``rollout`` did, for logs and metrics."""

    episodes: int = 0
    ends: Counter[str] = field(default_factory=Counter)  # episodes by why they ended
    turns: int = 0
    model_tokens: int = 0  # tokens the sampler produced
    tool_calls: int = 0
    tool_errors: int = 0  # calls answered with an error (malformed, unknown, refused, raised, timed out)
    tool_timeouts: int = 0  # calls their turn's timeout gave up before the environment answered
    tool_outputs_cut: int = 0
    sampler_calls: int = 0
    wall_s: float = 0.0

    def as_metrics(self) -> dict[str, float]:
        """Flat numbers for a ``MetricWriter``."""
        metrics = {
            'episodes': float(self.episodes),
            'turns_per_episode': self.turns / max(1, self.episodes),
            'model_tokens': float(self.model_tokens),
            'tool_calls': float(self.tool_calls),
            'tool_errors': float(self.tool_errors),
            'tool_timeouts': float(self.tool_timeouts),
            'tokens_per_s': self.model_tokens / self.wall_s if self.wall_s else 0.0,
        }
        return metrics | {f'ended_{reason}': float(n) for reason, n in self.ends.items()}


class RolloutEngine:
    """Runs episodes of environments on a sampler; see the module docstring.

    ``sampler`` is a twinkle sampler (local, on Ray, or the client's), a ``tinker``
    ``SamplingClient``, or a ``Generator``. ``sampling_params.max_tokens`` is the limit of one
    turn; ``num_samples`` must be 1 (a group of environments gives a task several episodes)."""

    def __init__(
        self,
        sampler: Any,
        template: Template,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        *,
        max_turns: int = 10,
        max_episode_tokens: int = 4096,
        turn_timeout_s: float | None = 300.0,
        max_batch: int = 64,
    ):
        self.params = SamplingParams.from_dict(sampling_params)
        if self.params.num_samples != 1:
            raise ConfigurationError(
                f'a rollout samples one continuation per episode and turn; got num_samples={self.params.num_samples}: '
                'give each task a group of environments instead (env_groups)'
            )
        for name, value in (('max_turns', max_turns), ('max_episode_tokens', max_episode_tokens)):
            if value <= 0:
                raise ConfigurationError(f'{name} must be positive; got {value}')
        if turn_timeout_s is not None and turn_timeout_s <= 0:
            raise ConfigurationError(f'turn_timeout_s must be positive or None; got {turn_timeout_s}')
        self.generator = as_generator(sampler)
        self.template = template
        self.max_turns, self.max_episode_tokens, self.turn_timeout_s = max_turns, max_episode_tokens, turn_timeout_s
        self.max_batch = max_batch
        self.stats = RolloutStats()

    def rollout(self, envs: Sequence[Env] | Sequence[Sequence[Env]]) -> list[Episode]:
        """Run one episode per environment (groups flattened, in order) and return them; each
        episode's ``group`` and ``index`` say where its environment was. Closes the environments."""
        return asyncio.run(self.rollout_async(envs))

    async def rollout_async(self, envs: Sequence[Env] | Sequence[Sequence[Env]]) -> list[Episode]:
        """``rollout`` from inside an event loop."""
        groups = _as_groups(envs)
        started = time.perf_counter()
        batcher = Batcher(self.generator, self.max_batch)
        episodes = [Episode(group=g, index=i) for g, group in enumerate(groups) for i in range(len(group))]
        await asyncio.gather(*(self._run(env, ep, batcher) for env, ep in zip(flat(groups), episodes, strict=True)))
        self.stats = _stats(episodes, batcher.calls, time.perf_counter() - started)
        return episodes

    async def _run(self, env: Env, episode: Episode, batcher: Batcher) -> None:
        episode.user_data = dict(getattr(env, 'user_data', {}) or {})
        try:
            await self._play(env, episode, batcher)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            episode.end, episode.error = 'timeout', f'a turn took longer than turn_timeout_s={self.turn_timeout_s}'
        except Exception as e:  # this episode's environment or sampler failed: the others go on
            episode.end, episode.error = 'error', f'{type(e).__name__}: {e}'
            logger.warning(f'episode {episode.group}.{episode.index} ended with an error: {episode.error}')
        finally:
            try:
                await awaited(env.close())
            except Exception as e:
                logger.warning(f'closing the environment of episode {episode.group}.{episode.index} failed: {e}')

    async def _play(self, env: Env, episode: Episode, batcher: Batcher) -> None:
        schemas = env.tools.schemas or None
        opening = await awaited(env.reset())
        feature = self.template.encode({'messages': opening, 'tools': schemas}, add_generation_prompt=True)
        if feature is None:
            raise DataError('the opening messages are over the template max_length')
        episode.messages = list(opening)
        episode.extend(feature['input_ids'])
        observation, observation_tokens = list(opening), list(feature['input_ids'])
        for _ in range(self.max_turns):
            left = self.max_episode_tokens - len(episode.tokens)
            if left <= 0:
                episode.end = 'max_tokens'
                return
            params = self._params(left, episode)
            generation = await self._timed(batcher.generate(episode.tokens, params))
            action = self._action(generation)
            episode.extend(generation.tokens, generation.logprobs)
            episode.weight_versions.append(generation.weight_version)
            episode.messages.append(_assistant_message(action))
            try:
                result = await self._timed(awaited(env.step(action)))
            except asyncio.TimeoutError:  # the turn's tokens are the episode's already: keep the turn
                episode.turns.append(
                    _turn(observation, observation_tokens, generation, action, self._timed_out(action))
                )
                raise
            episode.turns.append(_turn(observation, observation_tokens, generation, action, result))
            if result.done:
                episode.end = 'done'
                return
            if not result.messages:
                raise DataError('the environment neither ended the episode nor added a message to answer')
            observation = list(result.messages)
            observation_tokens = self._observation_tokens(action, result.messages, schemas)
            episode.extend(observation_tokens)
            episode.messages += observation
        episode.end = 'max_turns'

    def _params(self, left: int, episode: Episode) -> SamplingParams:
        """This turn's parameters: no more tokens than the episode has left, and with a seeded
        rollout a seed of the episode's own (the episodes of a group start from the same prompt,
        and one seed would sample them alike)."""
        params = self.params if self.params.max_tokens <= left else replace(self.params, max_tokens=left)
        if params.seed is None:
            return params
        turn_seed = random.Random(f'{params.seed}:{episode.group}:{episode.index}:{len(episode.turns)}')
        return replace(params, seed=turn_seed.getrandbits(62))

    async def _timed(self, work: Any) -> Any:
        return await asyncio.wait_for(work, self.turn_timeout_s)

    def _timed_out(self, action: Action) -> StepResult:
        """What a turn whose step outlasted ``turn_timeout_s`` gave: each of its calls answered as
        timed out (and nothing added to the episode after the action)."""
        answer = f'Error: timed out: the turn took longer than turn_timeout_s={self.turn_timeout_s}'
        return StepResult(tool_results=[ToolResult(c, answer, failed=True, timed_out=True) for c in action.tool_calls])

    def _action(self, generation: Generation) -> Action:
        tokens = generation.tokens
        closed = bool(tokens) and tokens[-1] == self.template.end_of_turn_id()
        text = self.template.decode(tokens[:-1] if closed else tokens, skip_special_tokens=True)
        content, calls = parse_tool_calls(text)
        return Action(text=content, tool_calls=calls, tokens=list(tokens), truncated=generation.stop_reason != 'stop')

    def _observation_tokens(self, action: Action, messages: list[Message], schemas: Any) -> list[int]:
        """The environment's tokens after a turn: the end-of-turn token when the turn did not end
        with one (out of tokens, or stopped by another stop token or string), then the messages
        and the next assistant header."""
        eot = self.template.end_of_turn_id()
        closing = [] if action.tokens and action.tokens[-1] == eot else [eot]
        return closing + self.template.continuation(messages, schemas)


def _as_groups(envs: Sequence[Env] | Sequence[Sequence[Env]]) -> list[list[Env]]:
    if not envs:
        raise ConfigurationError('rollout needs at least one environment')
    if all(isinstance(env, Env) for env in envs):
        return [[env] for env in envs]  # type: ignore[list-item]
    groups = [list(group) for group in envs]  # type: ignore[arg-type]
    bad = [type(env).__name__ for group in groups for env in group if not isinstance(env, Env)]
    if bad:
        raise ConfigurationError(f'rollout takes Env instances (or groups of them); got {sorted(set(bad))}')
    return groups


def _assistant_message(action: Action) -> Message:
    message: Message = {'role': 'assistant', 'content': action.text}
    calls = [call.as_message_call() for call in action.tool_calls if call.error is None]
    if calls:
        message['tool_calls'] = calls
    return message


def _turn(
    observation: list[Message],
    observation_tokens: list[int],
    generation: Generation,
    action: Action,
    result: StepResult,
) -> Turn:
    return Turn(
        observation=observation,
        observation_tokens=observation_tokens,
        action_tokens=list(generation.tokens),
        action_logprobs=list(generation.logprobs),
        text=action.text,
        stop_reason=generation.stop_reason,
        tool_calls=action.tool_calls,
        tool_results=result.tool_results,
        reward=float(result.reward),
        metrics=dict(result.metrics),
    )


def _stats(episodes: list[Episode], sampler_calls: int, wall_s: float) -> RolloutStats:
    turns = [turn for episode in episodes for turn in episode.turns]
    results = [result for turn in turns for result in turn.tool_results]
    return RolloutStats(
        episodes=len(episodes),
        ends=Counter(episode.end for episode in episodes),
        turns=len(turns),
        model_tokens=sum(episode.num_model_tokens for episode in episodes),
        tool_calls=len(results),
        tool_errors=sum(result.failed for result in results),
        tool_timeouts=sum(result.timed_out for result in results),
        tool_outputs_cut=sum(result.truncated for result in results),
        sampler_calls=sampler_calls,
        wall_s=wall_s,
    )
