"""Agents: tool calls as the models write them, environments, and the rollout engine on the tiny
model, token in and token out (the trainer scores exactly what the sampler produced)."""

from __future__ import annotations

import asyncio
import doctest
import threading

import pytest
import torch
from agent_envs import Countdown

import twinkle.agent.tools as tools_module
from twinkle.agent import (
    Action,
    RolloutEngine,
    StepResult,
    ToolBox,
    ToolCall,
    ToolEnv,
    env_groups,
    parse_tool_calls,
)
from twinkle.agent.generator import Generation
from twinkle.agent.tasks.guess_number import GuessNumberEnv
from twinkle.data_format import SamplingParams
from twinkle.errors import ConfigurationError
from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler
from twinkle.template import Template


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def fails(reason: str) -> str:
    """Always raises.

    Args:
        reason: what to say
    """
    raise RuntimeError(reason)


def shout(text: str) -> str:
    """Repeat the text many times.

    Args:
        text: what to repeat
    """
    return text * 1000


# ---- parsing the calls models write ---------------------------------------------------------------
def test_doctests() -> None:
    assert doctest.testmod(tools_module).failed == 0


def test_qwen3_calls_round_trip_through_the_chat_template(tiny_model_dir: str) -> None:
    # Two parallel calls after some text, rendered by the embedded tokenizer's chat template (Qwen3's
    # format): what parse_tool_calls reads back from the assistant's text is what was rendered.
    template = Template(tiny_model_dir)
    calls = [ToolCall('add', {'a': 1, 'b': 2}), ToolCall('add', {'a': 30, 'b': -4})]
    message = {'role': 'assistant', 'content': 'Two sums.', 'tool_calls': [c.as_message_call() for c in calls]}
    rendered = template._render([{'role': 'user', 'content': 'q'}, message], False, ToolBox([add]).schemas)
    text = rendered.split('<|im_start|>assistant\n', 1)[1].split('<|im_end|>')[0]
    assert text.count('<tool_call>') == 2
    content, parsed = parse_tool_calls(text)
    assert (content, parsed) == ('Two sums.', calls)


def test_qwen3_5_xml_calls_are_read() -> None:
    # Qwen3.5's (and Qwen3-Coder's) format: values are JSON when they read as JSON, else text.
    text = (
        'Let me look.\n\n<tool_call>\n<function=search>\n<parameter=query>\nred apples\n</parameter>\n'
        '<parameter=limit>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n'
        '<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == 'Let me look.'
    assert calls == [ToolCall('search', {'query': 'red apples', 'limit': 3}), ToolCall('add', {'a': 1, 'b': 2})]


@pytest.mark.parametrize(
    ('text', 'name', 'error'),
    [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>', '', 'not valid JSON'),
        ('<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', '', 'a call is {"name"'),
        ('<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>', 'add', '"arguments" must be a JSON object'),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', '', 'not closed with </tool_call>'),
        ('<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</tool_call>', 'add', 'not closed with </fu'),
    ],
)
def test_malformed_calls_become_errors(text: str, name: str, error: str) -> None:
    _, [call] = parse_tool_calls(text)
    assert call.name == name
    assert call.error is not None and error in call.error


def test_arguments_written_as_a_json_string_are_read() -> None:
    _, [call] = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>')
    assert call == ToolCall('add', {'a': 1, 'b': 2})


# ---- running tools --------------------------------------------------------------------------------
def test_a_tool_schema_comes_from_hints_and_docstring() -> None:
    [schema] = ToolBox([add]).schemas
    assert schema == {
        'type': 'function',
        'function': {
            'name': 'add',
            'description': 'Add two whole numbers.',
            'parameters': {
                'type': 'object',
                'properties': {
                    'a': {'type': 'integer', 'description': 'the first'},
                    'b': {'type': 'integer', 'description': 'the second'},
                },
                'required': ['a', 'b'],
            },
        },
    }


def test_an_undocumented_tool_or_two_of_one_name_are_refused() -> None:
    def bare(x: int) -> int:
        return x

    with pytest.raises(ConfigurationError, match="tool 'bare' cannot be described"):
        ToolBox([bare])
    with pytest.raises(ConfigurationError, match='tool names must be unique'):
        ToolBox([add, add])


def test_every_failure_of_a_call_is_an_answer_the_model_reads() -> None:
    box = ToolBox([add, fails, shout], max_output_chars=50)
    calls = [
        ToolCall('add', {'a': 2, 'b': 3}),
        ToolCall('add', {'a': 'two', 'b': 3}),  # refused by the signature
        ToolCall('add', {'a': 1}),  # a required argument missing
        ToolCall('multiply', {'a': 1}),
        ToolCall('fails', {'reason': 'disk full'}),
        ToolCall('', error='the call is not valid JSON'),
        ToolCall('shout', {'text': 'ab'}),
    ]
    results = asyncio.run(box.run(calls))
    assert [r.failed for r in results] == [False, True, True, True, True, True, False]
    assert results[0].content == '5'
    assert results[1].content.startswith('Error: bad arguments for add: a: ')
    assert results[2].content == 'Error: bad arguments for add: b: Missing required argument'
    assert results[3].content == "Error: unknown tool 'multiply'; the tools are ['add', 'fails', 'shout']"
    assert results[4].content == 'Error: fails raised RuntimeError: disk full'
    assert results[5].content == 'Error: the call is not valid JSON'
    assert results[6].truncated and results[6].content == 'ab' * 25 + '\n[output cut: 50 of 2000 characters shown]'


def test_the_calls_of_one_turn_run_at_once() -> None:
    # Two async tools that each wait for the other to have started: run one after the other they
    # would wait forever (the timeout turns that into a failure the test sees).
    started = {'left': asyncio.Event, 'right': asyncio.Event}
    events: dict[str, asyncio.Event] = {}

    async def meet(side: str) -> str:
        """Wait until both sides have started.

        Args:
            side: left or right
        """
        events[side].set()
        other = 'right' if side == 'left' else 'left'
        await asyncio.wait_for(events[other].wait(), 5)
        return side

    async def run() -> list[str]:
        events.update({side: event() for side, event in started.items()})
        results = await ToolBox([meet]).run([ToolCall('meet', {'side': 'left'}), ToolCall('meet', {'side': 'right'})])
        return [r.content for r in results]

    assert asyncio.run(run()) == ['left', 'right']


# ---- the template's continuation ------------------------------------------------------------------
def test_continuation_tokens_are_those_of_the_whole_conversation(tiny_model_dir: str) -> None:
    # prompt + the assistant turn's tokens + continuation == the template's encoding of the whole
    # conversation, for a user turn and for a run of tool answers.
    template = Template(tiny_model_dir)
    schemas = ToolBox([add]).schemas
    opening = [{'role': 'system', 'content': 'Use tools.'}, {'role': 'user', 'content': 'Add 2 and 3.'}]
    turn = {
        'role': 'assistant',
        'content': 'Sure.',
        'tool_calls': [ToolCall('add', {'a': 2, 'b': 3}).as_message_call()],
    }
    answers = [{'role': 'tool', 'content': '5'}, {'role': 'tool', 'content': 'again 5'}]
    prompt = template.encode({'messages': opening, 'tools': schemas}, add_generation_prompt=True)['input_ids']
    whole = template.encode({'messages': [*opening, turn], 'tools': schemas})['input_ids']
    action = whole[len(prompt) : whole.index(template.end_of_turn_id(), len(prompt)) + 1]
    for added in (answers, [{'role': 'user', 'content': 'Thanks. And 4?'}]):
        expected = template.encode({'messages': [*opening, turn, *added], 'tools': schemas}, add_generation_prompt=True)
        assert prompt + action + template.continuation(added, schemas) == expected['input_ids']


# ---- the engine on the tiny model -----------------------------------------------------------------
@pytest.fixture(scope='module')
def sampler(tiny_model_dir: str) -> TorchSampler:
    return TorchSampler(tiny_model_dir, device='cpu')


@pytest.fixture(scope='module')
def template(tiny_model_dir: str) -> Template:
    return Template(tiny_model_dir)


def test_a_multi_turn_episode_is_the_sampler_tokens_and_the_trainer_agrees(sampler, template, tiny_model_dir):
    torch.manual_seed(0)
    engine = RolloutEngine(sampler, template, SamplingParams(max_tokens=6), max_turns=5)
    episodes = engine.rollout([Countdown(turns=4) for _ in range(3)])
    assert [e.end for e in episodes] == ['done'] * 3
    for episode in episodes:
        assert len(episode.turns) == 4 and episode.reward == pytest.approx(1.0)
        # The tokens are: the opening prompt, then per turn the sampled ids and the environment's.
        rebuilt = list(episode.turns[0].observation_tokens)
        for turn in episode.turns:
            rebuilt += turn.action_tokens
            if turn is not episode.turns[-1]:
                rebuilt += episode.turns[episode.turns.index(turn) + 1].observation_tokens
        assert rebuilt == episode.tokens
        assert episode.num_model_tokens == sum(len(t.action_tokens) for t in episode.turns)
        assert episode.old_logps == [lp for t in episode.turns for lp in t.action_logprobs]
    # The trainer's teacher-forced log-probabilities of the model's tokens are the sampler's.
    trainer = TransformersModel(tiny_model_dir, device='cpu')
    features = [e.to_feature() for e in episodes]
    logps = trainer.forward_only(inputs=features).logps
    for row, (episode, feature) in enumerate(zip(episodes, features, strict=True)):
        mask = torch.tensor(feature['completion_mask']).bool()
        trained = logps[row, : len(feature['labels'])][mask]
        assert torch.allclose(trained, torch.tensor(episode.old_logps), atol=1e-4, rtol=0)


def test_an_environment_that_raises_ends_its_episode_only(sampler, template):
    envs = [Countdown(turns=3), Countdown(turns=3, raise_at=2), Countdown(turns=3)]
    engine = RolloutEngine(sampler, template, SamplingParams(max_tokens=4), max_turns=5)
    episodes = engine.rollout(envs)
    assert [e.end for e in episodes] == ['done', 'error', 'done']
    assert episodes[1].error == 'ValueError: the environment broke' and len(episodes[1].turns) == 1
    assert engine.stats.ends == {'done': 2, 'error': 1}
    assert all(env.closed for env in envs)


def test_the_limits_end_episodes(sampler, template):
    turns = RolloutEngine(sampler, template, SamplingParams(max_tokens=4), max_turns=2).rollout([Countdown(9)])
    assert turns[0].end == 'max_turns' and len(turns[0].turns) == 2
    engine = RolloutEngine(sampler, template, SamplingParams(max_tokens=8), max_turns=9, max_episode_tokens=40)
    [episode] = engine.rollout([Countdown(9)])
    assert episode.end == 'max_tokens' and len(episode.tokens) <= 40 + 8
    # The last turn was cut to what the budget had left: never more than max_episode_tokens in all.
    assert len(episode.tokens) - len(episode.turns[-1].action_tokens) < 40


def test_a_slow_environment_times_out_alone(template):
    class Slow(Countdown):
        async def step(self, action: Action) -> StepResult:
            await asyncio.sleep(30)
            return StepResult(done=True)

    # A scripted generator answers at once, so only the slow step meets the limit, however busy the
    # machine (the tiny model's first call alone can take over a second on 2 loaded cores).
    engine = RolloutEngine(Scripted(template, ['Hi.', 'Hi.']), template, turn_timeout_s=1.0)
    episodes = engine.rollout([Slow(), Countdown(turns=1)])
    assert [e.end for e in episodes] == ['timeout', 'done']
    assert 'turn_timeout_s=1.0' in episodes[0].error
    # The slow episode keeps the turn it sampled: its tokens are the episode's last.
    [turn] = episodes[0].turns
    assert turn.observation_tokens + turn.action_tokens == episodes[0].tokens


def test_a_seeded_rollout_repeats_and_its_episodes_differ(sampler, template):
    # One seed for the rollout; a group of 4 episodes of one task must not sample alike (GRPO would
    # see no difference), and the same seed gives the same episodes again.
    engine = RolloutEngine(sampler, template, SamplingParams(max_tokens=8, seed=11), max_turns=2)
    first = [e.tokens for e in engine.rollout([Countdown(turns=2) for _ in range(4)])]
    again = [e.tokens for e in engine.rollout([Countdown(turns=2) for _ in range(4)])]
    assert first == again
    assert len({tuple(tokens) for tokens in first}) == 4


def test_episodes_share_sampler_calls(sampler, template):
    # 8 episodes of 3 turns each: 3 calls of 8 prompts, not 24 calls.
    engine = RolloutEngine(sampler, template, SamplingParams(max_tokens=4), max_turns=3)
    engine.rollout(env_groups(lambda task: Countdown(turns=3), num_tasks=2, group_size=4))
    assert engine.stats.turns == 24 and engine.stats.sampler_calls == 3


class Scripted:
    """A generator that writes given texts, one per turn, whatever the prompt."""

    def __init__(self, template: Template, texts: list[str]):
        self.template, self.texts, self.turn = template, texts, 0
        self.lock = threading.Lock()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        with self.lock:
            text, self.turn = self.texts[self.turn], self.turn + 1
        ids = [*self.template._tokenize(text), self.template.end_of_turn_id()]
        return [Generation(list(ids), [-0.5] * len(ids), 'stop') for _ in prompts]


class AddEnv(ToolEnv):
    def __init__(self) -> None:
        super().__init__([{'role': 'user', 'content': 'What is 2 + 3?'}], ToolBox([add]))

    def grade(self, answer: str) -> float:
        return float(answer.strip() == '5')


def test_tool_calls_are_run_and_answered_in_the_conversation(template):
    texts = [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": {"a": "x"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
        '5',
    ]
    [episode] = RolloutEngine(Scripted(template, texts), template, max_turns=5).rollout([AddEnv()])
    assert episode.end == 'done' and episode.reward == 1.0
    tool_answers = [m['content'] for m in episode.messages if m['role'] == 'tool']
    assert tool_answers[0] == '5'
    assert tool_answers[1].startswith('Error: bad arguments for add')
    assert tool_answers[2] == "Error: unknown tool 'nope'; the tools are ['add']"
    assert [len(t.tool_calls) for t in episode.turns] == [1, 2, 0]
    # Written as the template writes calls, the conversation renders to the episode's very tokens
    # (and the newline the template puts after the last end of turn).
    whole = template.encode({'messages': episode.messages, 'tools': ToolBox([add]).schemas})['input_ids']
    assert whole[: len(episode.tokens)] == episode.tokens
    assert template.decode(whole[len(episode.tokens) :]) == '\n'
    assert episode.num_model_tokens == sum(len(template._tokenize(t)) + 1 for t in texts)


def test_guess_number_rewards_finding_and_closeness() -> None:
    def play(env: GuessNumberEnv, text: str) -> StepResult:
        return env.step(Action(text=text, tool_calls=[], tokens=[], truncated=False))

    env = GuessNumberEnv(seed=3, max_guesses=3)
    target = env.target
    env.reset()
    no_guess = play(env, 'hmm')
    assert (no_guess.reward, no_guess.done) == (0.0, False)
    assert no_guess.messages[0]['content'] == 'Reply with a number from 1 to 9.'
    # A guess earns 0.5 / 3 guesses * (1 - |guess - number| / 8), the range 1..9 being 8 wide.
    wrong = target % 9 + 1  # another number in 1..9
    closeness = 0.5 / 3 * (1 - abs(wrong - target) / 8)
    first = play(env, str(wrong))
    assert first.reward == pytest.approx(closeness)
    assert first.messages[0]['content'] == ('Higher.' if wrong < target else 'Lower.')
    last = play(env, f'then {wrong}!')  # the third turn ends a lost game; the answer ruled this guess out
    assert last.done and last.reward == 0.0 and last.metrics == {'found': 0.0}
    # A guess the answers allow earns its closeness, one they rule out (beyond a "higher") nothing.
    game = GuessNumberEnv(seed=3, max_guesses=3)
    game.reset()
    assert play(game, '1').reward == pytest.approx(0.5 / 3 * (1 - (target - 1) / 8))  # the number is not 1
    assert play(game, '1').reward == 0.0 and play(game, str(target)).reward == pytest.approx(1 + 0.5 / 3)
    found = GuessNumberEnv(seed=3, max_guesses=3)
    found.reset()
    right = play(found, f'It is {target}.')
    assert right.done and right.reward == pytest.approx(1 + 0.5 / 3) and right.metrics == {'found': 1.0}


def test_bad_engine_settings_are_refused(sampler, template):
    with pytest.raises(ConfigurationError, match='num_samples=4'):
        RolloutEngine(sampler, template, SamplingParams(num_samples=4))
    with pytest.raises(ConfigurationError, match='max_turns must be positive; got 0'):
        RolloutEngine(sampler, template, max_turns=0)
    with pytest.raises(ConfigurationError, match='cannot sample with a int'):
        RolloutEngine(3, template)
