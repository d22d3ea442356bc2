"""Tools a model calls: declared as Python functions, parsed from the text the model writes, run
so that nothing the model does can crash a rollout.

A tool is a plain function (sync or async) with type hints and a Google-style docstring; its
schema is the OpenAI tools format chat templates take, read from the hints and the docstring by
``transformers.utils.get_json_schema`` (what ``apply_chat_template(tools=[fn])`` does)::

    def calculator(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: the expression, e.g. "3 * (4 + 5)"
        '''

    tools = ToolBox([calculator])
    tools.schemas   # [{'type': 'function', 'function': {'name': 'calculator', ...}}]

Qwen's models write calls as ``<tool_call>`` blocks, in one of two formats: Qwen3's JSON
(``{"name": ..., "arguments": {...}}``) and Qwen3.5's (and Qwen3-Coder's) XML-like
``<function=name><parameter=x>value</parameter></function>``. ``parse_tool_calls`` reads both,
several calls in one turn included. A block it cannot read becomes a ``ToolCall`` with an
``error``; ``ToolBox.run`` turns that error, an unknown tool, arguments the signature refuses,
or an exception the tool raises into the text of the tool's answer, so the model reads what
went wrong and the batch goes on. An answer longer than ``max_output_chars`` is cut and says so.

An async tool runs on the event loop; a sync one in a daemon thread of its own (``ToolThreads``),
so a slow one holds only its own episode. A Python thread cannot be stopped from outside: when
its turn times out (``RolloutEngine(turn_timeout_s=...)``) a sync call is *abandoned*, not
stopped: its episode ends, nothing waits for the thread (not ``asyncio.run``'s exit, not the
interpreter's: a tool that never returns does not keep the process alive), a warning names it, and
it runs on until the function returns, its result dropped. Whatever it holds (memory, a
connection, a lock) stays held until then, so no new sync call starts while ``max_abandoned`` are
abandoned: it raises ``StateError``, which ends its episode with ``end='error'``. A tool that may
hang should bound its own wait (a timeout on its request) or be async; code the model wrote runs
in ``twinkle.agent.sandbox``, which kills it at its time limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import itertools
import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError, validate_call

from twinkle.errors import ConfigurationError, StateError
from twinkle.utils.logger import get_logger

logger = get_logger()

#: What the model's call to a tool may carry as arguments: a JSON object.
Arguments = dict[str, Any]

_BLOCK = re.compile(r'<tool_call>(.*?)(?:</tool_call>|\Z)', re.DOTALL)
_FUNCTION = re.compile(r'<function=([^>\n]+)>(.*?)</function>', re.DOTALL)
_PARAMETER = re.compile(r'<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>', re.DOTALL)


@dataclass
class ToolCall:
    """One call the model wrote: the tool's name and its arguments, or why it could not be read
    (``error``; then ``name`` is what could be read of it, maybe '')."""

    name: str
    arguments: Arguments = field(default_factory=dict)
    error: str | None = None

    def as_message_call(self) -> dict[str, Any]:
        """The call as a message's ``tool_calls`` entry (the OpenAI format chat templates read)."""
        return {'type': 'function', 'function': {'name': self.name, 'arguments': self.arguments}}


@dataclass
class ToolResult:
    """What running one call gave: the text the model reads, whether it failed, whether it was cut."""

    call: ToolCall
    content: str
    failed: bool = False
    truncated: bool = False
    timed_out: bool = False  # its turn outlasted turn_timeout_s before the environment answered


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The text outside ``<tool_call>`` blocks (stripped), and the calls, in order.

    >>> content, calls = parse_tool_calls('Adding.<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>')
    >>> content, calls[0].name, calls[0].arguments
    ('Adding.', 'add', {'a': 1})
    >>> xml = '<tool_call><function=add>\\n<parameter=a>\\n1\\n</parameter>\\n</function></tool_call>'
    >>> _, (call,) = parse_tool_calls(xml)
    >>> call.name, call.arguments
    ('add', {'a': 1})
    >>> _, (broken,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": ')
    >>> broken.error
    'the <tool_call> block is not closed with </tool_call>'
    """
    calls = []
    for match in _BLOCK.finditer(text):
        if match.group(0).endswith('</tool_call>'):
            calls.append(_parse_block(match.group(1).strip()))
        else:  # the turn ended (a stop, or out of tokens) inside the block
            calls.append(ToolCall(name='', error='the <tool_call> block is not closed with </tool_call>'))
    return _BLOCK.sub('', text).strip(), calls


def _parse_block(body: str) -> ToolCall:
    if body.startswith('<function='):
        return _parse_xml(body)
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(name='', error=f'the call is not valid JSON ({e.msg} at character {e.pos}): {body[:200]!r}')
    if not isinstance(call, dict) or not isinstance(call.get('name'), str):
        return ToolCall(name='', error=f'a call is {{"name": <tool name>, "arguments": {{...}}}}; got {body[:200]!r}')
    arguments = call.get('arguments', {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return ToolCall(name=call['name'], error=f'"arguments" must be a JSON object; got {arguments!r:.200}')
    return ToolCall(name=call['name'], arguments=arguments)


def _parse_xml(body: str) -> ToolCall:
    match = _FUNCTION.search(body)
    if match is None:
        name = body[len('<function=') :].split('>', 1)[0]
        return ToolCall(name=name, error='the <function=...> block is not closed with </function>')
    arguments: Arguments = {}
    for parameter, raw in _PARAMETER.findall(match.group(2)):
        arguments[parameter.strip()] = _xml_value(raw)
    return ToolCall(name=match.group(1).strip(), arguments=arguments)


def _xml_value(raw: str) -> Any:
    """A parameter's value: JSON when it reads as JSON (numbers, lists, objects), else the text."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


@dataclass(eq=False)  # one per call, told apart by identity
class _ThreadCall:
    tool: str
    thread: threading.Thread = field(init=False)
    started: float = field(default_factory=time.monotonic)
    finished: bool = False  # the function returned (or raised)


class ToolThreads:
    """Runs sync tools' calls, each in a daemon thread of its own; see the module docstring.

    A call given up while its thread runs (its turn timed out) is abandoned: the thread runs on
    until the function returns, with nothing waiting for it. While ``max_abandoned`` are, no new
    call starts (``StateError``): each holds what the tool held, and a tool that hangs every time
    would otherwise leave a thread per call for good. One instance (``default_tool_threads``) serves
    every ``Tool`` not given its own."""

    def __init__(self, max_abandoned: int = 32):
        if max_abandoned <= 0:
            raise ConfigurationError(f'max_abandoned must be positive; got {max_abandoned}')
        self.max_abandoned = max_abandoned
        self._lock = threading.Lock()
        self._abandoned: list[_ThreadCall] = []
        self._numbers = itertools.count()

    @property
    def abandoned(self) -> list[threading.Thread]:
        """The threads of the calls given up that still run, oldest first."""
        with self._lock:
            return [call.thread for call in self._abandoned]

    def check_room(self, tool: str) -> None:
        """Raise ``StateError`` when ``max_abandoned`` calls are abandoned and still run."""
        with self._lock:
            held = [call.tool for call in self._abandoned]
        if len(held) >= self.max_abandoned:
            raise StateError(
                f'tool {tool!r} was not run: {len(held)} calls of sync tools ({sorted(set(held))}) still run after '
                f"their turns timed out, at most max_abandoned={self.max_abandoned}: bound the tool's own wait "
                '(a timeout on its request), make it async, or run the code in twinkle.agent.sandbox'
            )

    async def call(self, tool: str, fn: Callable[..., Any], arguments: Arguments) -> Any:
        """``fn(**arguments)`` in a new daemon thread; the result (or exception) once it returns."""
        self.check_room(tool)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        call = _ThreadCall(tool)
        name = f'twinkle-tool-{tool}-{next(self._numbers)}'
        run = functools.partial(contextvars.copy_context().run, fn, **arguments)  # the caller's context, as to_thread
        # A daemon thread, not a ThreadPoolExecutor's: asyncio.run's exit and the interpreter's join those.
        call.thread = threading.Thread(target=self._work, args=(call, run, future), name=name, daemon=True)
        call.thread.start()
        try:
            return await future
        except asyncio.CancelledError:  # the turn timed out (or the rollout was stopped)
            self._abandon(call)
            raise

    def _work(self, call: _ThreadCall, run: Callable[[], Any], future: asyncio.Future[Any]) -> None:
        try:
            settle = _settler(future, run(), None)
        except BaseException as e:  # handed to the awaiting call, as concurrent.futures does
            settle = _settler(future, None, e)
        with self._lock:
            call.finished = True
            abandoned = call in self._abandoned
            if abandoned:
                self._abandoned.remove(call)
        if abandoned:
            took = time.monotonic() - call.started
            logger.info(f'tool {call.tool!r} returned {took:.1f} s after its call began; its turn was given up before')
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits for the result
            future.get_loop().call_soon_threadsafe(settle)

    def _abandon(self, call: _ThreadCall) -> None:
        with self._lock:
            if call.finished:
                return
            self._abandoned.append(call)
            count = len(self._abandoned)
        logger.warning(
            f'tool {call.tool!r} was given up {time.monotonic() - call.started:.1f} s into its call (its turn timed '
            f'out, or the rollout was stopped), but a thread cannot be stopped: {call.thread.name} runs on until '
            f'the function returns ({count} abandoned now; no new sync call starts at '
            f'max_abandoned={self.max_abandoned})'
        )


def _settler(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> Callable[[], None]:
    """What the loop runs to hand a thread's outcome to its awaiting call, unless it gave up."""

    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    return settle


#: The ``ToolThreads`` of every ``Tool`` not given its own: abandoned threads are a process's to bound.
default_tool_threads = ToolThreads()


class Tool:
    """A Python function a model may call, with its OpenAI-format schema.

    ``fn`` needs type hints and a Google-style docstring with an ``Args:`` line per parameter
    (the model reads them); arguments are checked against the signature (pydantic) before the
    call, so ``{"a": "x"}`` for ``a: int`` is an error the model reads, not a ``TypeError``. A sync
    ``fn`` runs in a thread of ``threads`` (``default_tool_threads`` unless given)."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None, *, threads: ToolThreads | None = None):
        from transformers.utils.chat_template_utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as e:  # transformers' own errors (a missing hint, an undocumented argument)
            raise ConfigurationError(f'tool {getattr(fn, "__name__", fn)!r} cannot be described: {e}') from e
        schema['function'].pop('return', None)  # not part of the OpenAI tools format
        if name is not None:
            schema['function']['name'] = name
        self.name: str = schema['function']['name']
        self.schema: dict[str, Any] = schema
        self.is_async = inspect.iscoroutinefunction(fn)
        self.threads = default_tool_threads if threads is None else threads
        self._call = validate_call(fn)

    async def __call__(self, arguments: Arguments) -> Any:
        if self.is_async:
            return await self._call(**arguments)
        return await self.threads.call(self.name, self._call, arguments)  # a slow tool holds only its own episode


class ToolBox:
    """The tools an environment offers, run by name; never raises for what the model wrote."""

    def __init__(
        self,
        tools: Sequence[Callable[..., Any] | Tool] = (),
        max_output_chars: int = 4096,
        *,
        threads: ToolThreads | None = None,  # for the sync functions given (a Tool keeps its own)
    ):
        if max_output_chars <= 0:
            raise ConfigurationError(f'max_output_chars must be positive; got {max_output_chars}')
        self.tools = {t.name: t for t in (t if isinstance(t, Tool) else Tool(t, threads=threads) for t in tools)}
        if len(self.tools) != len(tools):
            raise ConfigurationError(f'tool names must be unique; got {len(tools)} tools named {sorted(self.tools)}')
        self.max_output_chars = max_output_chars

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools in the OpenAI format, for ``apply_chat_template(tools=...)``."""
        return [tool.schema for tool in self.tools.values()]

    async def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Each call's result, in order; the calls of one turn run at once. Raises ``StateError``,
        before any call starts, when a sync tool called has no room for its thread
        (``ToolThreads.max_abandoned``): the rollout's failure, not the model's."""
        called = {self.tools[c.name] for c in calls if c.error is None and c.name in self.tools}
        for tool in called:
            if not tool.is_async:
                tool.threads.check_room(tool.name)
        return list(await asyncio.gather(*(self._run_one(call) for call in calls)))

    async def _run_one(self, call: ToolCall) -> ToolResult:
        if call.error is not None:
            return ToolResult(call, f'Error: {call.error}', failed=True)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(call, f'Error: unknown tool {call.name!r}; the tools are {sorted(self.tools)}', True)
        try:
            output = await tool(call.arguments)
        except ValidationError as e:
            problems = '; '.join(f'{".".join(map(str, p["loc"])) or "arguments"}: {p["msg"]}' for p in e.errors()[:5])
            return ToolResult(call, f'Error: bad arguments for {call.name}: {problems}', failed=True)
        except Exception as e:  # the tool's own failure is the model's to read
            return ToolResult(call, f'Error: {call.name} raised {type(e).__name__}: {e}', failed=True)
        return self._cut(call, output if isinstance(output, str) else json.dumps(output, default=str))

    def _cut(self, call: ToolCall, text: str) -> ToolResult:
        if len(text) <= self.max_output_chars:
            return ToolResult(call, text)
        shown = text[: self.max_output_chars]
        return ToolResult(call, f'{shown}\n[output cut: {len(shown)} of {len(text)} characters shown]', truncated=True)
