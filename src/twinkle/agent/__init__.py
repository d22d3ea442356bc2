"""Agents: environments, tools, and multi-turn rollouts, token in and token out.

``Env`` and ``ToolEnv`` (``base``), tools from Python functions and the parser of the calls
models write (``tools``), the ``Episode`` a rollout leaves (``episode``), the samplers it runs
on (``generator``), the engine (``rollout``), a sandbox for code (``sandbox``), and embedded tasks
(``tasks``).
"""

from twinkle.agent.base import Action, Env, StepResult, ToolEnv, env_groups
from twinkle.agent.episode import EndReason, Episode, Turn
from twinkle.agent.generator import Batcher, Generation, Generator, SamplerGenerator, TinkerGenerator, as_generator
from twinkle.agent.rollout import RolloutEngine, RolloutStats
from twinkle.agent.tools import Tool, ToolBox, ToolCall, ToolResult, parse_tool_calls

__all__ = [
    'Action',
    'Batcher',
    'EndReason',
    'Env',
    'Episode',
    'Generation',
    'Generator',
    'RolloutEngine',
    'RolloutStats',
    'SamplerGenerator',
    'StepResult',
    'TinkerGenerator',
    'Tool',
    'ToolBox',
    'ToolCall',
    'ToolEnv',
    'ToolResult',
    'Turn',
    'as_generator',
    'env_groups',
    'parse_tool_calls',
]
