"""A synchronous tool that never returns ends its own episode at the turn's time limit: the rollout
returns about then, the other episodes finish, the hung episode keeps the turn it sampled, and the
process can still exit (the tool's thread is a daemon nothing joins)."""

from __future__ import annotations

import asyncio
import contextvars
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from twinkle.agent import Episode, RolloutEngine, StepResult, ToolBox, ToolCall, ToolEnv
from twinkle.agent.generator import Generation
from twinkle.agent.tools import Tool, ToolThreads, default_tool_threads
from twinkle.data_format import SamplingParams
from twinkle.template import Template

LIMIT_S = 2.0  # the turn's time limit
# What the rollout may take past the limit on a loaded machine (the whole test took 4.8 s here, the
# 2 s limit: a bound of 7 s was too close). The bound, 30 s, still tells a rollout that gave up on
# the tool from one that waited for it: the hung tool waits HANG_S, four times that, unless released.
MARGIN_S = 28.0
HANG_S = 120.0
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "x"}}\n</tool_call>'


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: what to look up
    """
    return '5'


class CallThenAnswer:
    """A generator that calls ``lookup`` on an episode's first turn and answers 5 once a tool has
    answered, whatever the other episodes do (it reads each prompt)."""

    def __init__(self, template: Template):
        self.template = template

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return [self._one(prompt) for prompt in prompts]

    def _one(self, prompt: list[int]) -> Generation:
        text = '5' if '<tool_response>' in self.template.decode(prompt) else CALL
        ids = [*self.template._tokenize(text), self.template.end_of_turn_id()]
        return Generation(ids, [-0.5] * len(ids), 'stop')


class LookupEnv(ToolEnv):
    def __init__(self, tools: ToolBox):
        super().__init__([{'role': 'user', 'content': 'Look up x.'}], tools)

    def grade(self, answer: str) -> float:
        return float(answer.strip() == '5')


class Hang:
    """A sync ``lookup`` that waits until the test releases it (``HANG_S`` at most), and the
    threads it ran in, for the teardown to join."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.threads: list[threading.Thread] = []
        self.rollouts: list[threading.Thread] = []  # rollouts the tool still held when the test failed

    def tool(self, threads: ToolThreads | None = None) -> Tool:
        def lookup(key: str) -> str:
            """Look a key up.

            Args:
                key: what to look up
            """
            self.threads.append(threading.current_thread())
            self.release.wait(HANG_S)
            return '5'

        return Tool(lookup, threads=threads)


@pytest.fixture
def hang() -> Iterator[Hang]:
    hang = Hang()
    yield hang
    hang.release.set()
    for thread in hang.threads + hang.rollouts:
        thread.join(10)
        assert not thread.is_alive(), f'{thread.name} still runs after its release'


@pytest.fixture(scope='module')
def template(tiny_model_dir: str) -> Template:
    return Template(tiny_model_dir)


def rollout_within(
    engine: RolloutEngine, envs: list[LookupEnv], wait_s: float, hang: Hang
) -> tuple[list[Episode], float]:
    """The rollout's episodes and its wall time, run in a thread so that a rollout held past
    ``wait_s`` fails the test instead of hanging it (the ``hang`` fixture's teardown releases the
    tool and joins the thread)."""
    out: list[Episode] = []
    thread = threading.Thread(target=lambda: out.extend(engine.rollout(envs)), name='test-rollout')
    started = time.monotonic()
    thread.start()
    thread.join(wait_s)
    elapsed = time.monotonic() - started
    if thread.is_alive():
        hang.rollouts.append(thread)
        pytest.fail(f'rollout() still ran {elapsed:.1f} s in, with turn_timeout_s={LIMIT_S}')  # teardown joins it
    return out, elapsed


@pytest.mark.slow
def test_a_hung_sync_tool_ends_its_episode_only_and_keeps_its_turn(template, hang):
    envs = [LookupEnv(ToolBox([lookup])), LookupEnv(ToolBox([hang.tool()])), LookupEnv(ToolBox([lookup]))]
    engine = RolloutEngine(CallThenAnswer(template), template, max_turns=4, turn_timeout_s=LIMIT_S)
    episodes, elapsed = rollout_within(engine, envs, LIMIT_S + MARGIN_S + 20, hang)
    assert elapsed < LIMIT_S + MARGIN_S
    assert [e.end for e in episodes] == ['done', 'timeout', 'done']
    assert [e.reward for e in episodes] == [1.0, 0.0, 1.0]
    hung = episodes[1]
    assert hung.error == f'a turn took longer than turn_timeout_s={LIMIT_S}'
    # The turn it sampled stays, with its call answered as timed out; its tokens are the episode's:
    # the opening prompt then the action, and no answer after it.
    [turn] = hung.turns
    assert turn.tool_calls == [ToolCall('lookup', {'key': 'x'})]
    [result] = turn.tool_results
    assert result.timed_out and result.failed and f'turn_timeout_s={LIMIT_S}' in result.content
    assert turn.observation_tokens + turn.action_tokens == hung.tokens
    assert hung.old_logps == turn.action_logprobs == [-0.5] * len(turn.action_tokens)
    assert hung.messages[-1]['role'] == 'assistant'
    # 3 episodes: 2 of 2 turns (a call, then the answer), the hung one of 1; 3 calls, one timed out.
    stats = engine.stats
    assert (stats.turns, stats.tool_calls, stats.tool_errors, stats.tool_timeouts) == (5, 3, 1, 1)
    assert hang.threads[0] in default_tool_threads.abandoned  # until the teardown releases it


@pytest.mark.slow
def test_an_abandoned_thread_is_forgotten_once_its_tool_returns(template, hang):
    threads = ToolThreads(max_abandoned=4)
    engine = RolloutEngine(CallThenAnswer(template), template, max_turns=4, turn_timeout_s=LIMIT_S)
    rollout_within(engine, [LookupEnv(ToolBox([hang.tool(threads)]))], LIMIT_S + MARGIN_S + 20, hang)
    assert threads.abandoned == hang.threads
    hang.release.set()
    hang.threads[0].join(10)
    assert threads.abandoned == []


@pytest.mark.slow
def test_past_max_abandoned_a_sync_tool_is_refused_and_its_episode_ends_with_an_error(template, hang):
    # Two episodes whose tool hangs, with room for one abandoned thread: the first turn of both
    # starts its thread (the room is counted when a call is given up), both time out, and a third
    # episode's call, in the next rollout, is refused before it runs.
    threads = ToolThreads(max_abandoned=1)
    engine = RolloutEngine(CallThenAnswer(template), template, max_turns=4, turn_timeout_s=LIMIT_S)
    envs = [LookupEnv(ToolBox([hang.tool(threads)])) for _ in range(2)]
    episodes, _ = rollout_within(engine, envs, LIMIT_S + MARGIN_S + 20, hang)
    assert [e.end for e in episodes] == ['timeout', 'timeout'] and len(threads.abandoned) == 2
    [refused], _ = rollout_within(engine, [LookupEnv(ToolBox([hang.tool(threads)]))], MARGIN_S + 20, hang)
    assert refused.end == 'error' and len(hang.threads) == 2
    assert refused.error is not None and refused.error.startswith("StateError: tool 'lookup' was not run: 2 calls")
    assert 'max_abandoned=1' in refused.error


def test_a_sync_tool_runs_in_the_callers_context() -> None:
    # As with asyncio.to_thread: what the caller set (a request id, a trace) the tool reads.
    request = contextvars.ContextVar('request', default='unset')
    ran_in: list[threading.Thread] = []

    def whose(key: str) -> str:
        """Say whose call this is.

        Args:
            key: anything
        """
        ran_in.append(threading.current_thread())
        return request.get()

    async def run() -> str:
        request.set('episode 7')
        [result] = await ToolBox([whose]).run([ToolCall('whose', {'key': 'x'})])
        return result.content

    assert asyncio.run(run()) == 'episode 7'
    [thread] = ran_in
    thread.join(10)
    assert thread is not threading.main_thread() and thread.daemon and not thread.is_alive()


def test_bad_tool_threads_settings_are_refused() -> None:
    with pytest.raises(ValueError, match='max_abandoned must be positive; got 0'):
        ToolThreads(max_abandoned=0)


@pytest.mark.slow
def test_a_slow_async_step_keeps_its_turn_too(template):
    # An environment whose own step outlasts the limit (no sync tool): the turn stays, its call
    # answered as timed out.
    class SlowGrade(LookupEnv):
        async def step(self, action):  # type: ignore[no-untyped-def]
            await asyncio.sleep(30)
            return StepResult(done=True)

    engine = RolloutEngine(CallThenAnswer(template), template, max_turns=4, turn_timeout_s=LIMIT_S)
    [episode] = engine.rollout([SlowGrade(ToolBox([lookup]))])
    assert episode.end == 'timeout' and len(episode.turns) == 1
    assert episode.turns[0].tool_results[0].timed_out
    assert episode.turns[0].observation_tokens + episode.turns[0].action_tokens == episode.tokens


SCRIPT = textwrap.dedent(
    '''
    import sys, threading, time

    from twinkle.agent import RolloutEngine, ToolBox, ToolEnv
    from twinkle.agent.generator import Generation
    from twinkle.template import Template


    def lookup(key: str) -> str:
        """Never returns.

        Args:
            key: what to look up
        """
        threading.Event().wait()
        return key


    class Env(ToolEnv):
        def grade(self, answer):
            return 0.0


    class Calls:
        def generate(self, prompts, params):
            ids = [*template._tokenize(CALL), template.end_of_turn_id()]
            return [Generation(ids, [-0.5] * len(ids), 'stop') for _ in prompts]


    CALL = '<tool_call>\\n{"name": "lookup", "arguments": {"key": "x"}}\\n</tool_call>'
    template = Template(sys.argv[1])
    engine = RolloutEngine(Calls(), template, max_turns=2, turn_timeout_s=float(sys.argv[2]))
    started = time.monotonic()
    [episode] = engine.rollout([Env([{'role': 'user', 'content': 'Look up x.'}], ToolBox([lookup]))])
    print(episode.end, time.monotonic() - started, time.time(), flush=True)
    '''
)


@pytest.mark.integration
def test_a_process_whose_sync_tool_never_returns_exits_after_the_rollout(tmp_path: Path, tiny_model_dir: str):
    script = tmp_path / 'hung_tool.py'
    script.write_text(SCRIPT)
    # A held process is killed at the timeout (and the test fails); importing twinkle takes seconds.
    done = subprocess.run(
        [sys.executable, str(script), tiny_model_dir, str(LIMIT_S)], capture_output=True, text=True, timeout=120
    )
    exited = time.time()
    assert done.returncode == 0, done.stderr[-4000:]
    end, rollout_s, printed_at = done.stdout.split()
    assert end == 'timeout' and float(rollout_s) < LIMIT_S + MARGIN_S
    # The interpreter's exit waited for no thread: about 3 s of teardown here, with or without the hung
    # tool; a joined thread would hold it until the timeout.
    assert exited - float(printed_at) < 30
