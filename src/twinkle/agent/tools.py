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
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError, validate_call

from twinkle.errors import ConfigurationError

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


class Tool:
    """A Python function a model may call, with its OpenAI-format schema.

    ``fn`` needs type hints and a Google-style docstring with an ``Args:`` line per parameter
    (the model reads them); arguments are checked against the signature (pydantic) before the
    call, so ``{"a": "x"}`` for ``a: int`` is an error the model reads, not a ``TypeError``."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None):
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
        self._call = validate_call(fn)

    async def __call__(self, arguments: Arguments) -> Any:
        if self.is_async:
            return await self._call(**arguments)
        return await asyncio.to_thread(self._call, **arguments)  # a slow tool leaves the others running


class ToolBox:
    """The tools an environment offers, run by name; never raises for what the model wrote."""

    def __init__(self, tools: Sequence[Callable[..., Any] | Tool] = (), max_output_chars: int = 4096):
        if max_output_chars <= 0:
            raise ConfigurationError(f'max_output_chars must be positive; got {max_output_chars}')
        self.tools = {t.name: t for t in (t if isinstance(t, Tool) else Tool(t) for t in tools)}
        if len(self.tools) != len(tools):
            raise ConfigurationError(f'tool names must be unique; got {len(tools)} tools named {sorted(self.tools)}')
        self.max_output_chars = max_output_chars

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools in the OpenAI format, for ``apply_chat_template(tools=...)``."""
        return [tool.schema for tool in self.tools.values()]

    async def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Each call's result, in order; the calls of one turn run at once."""
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
