"""Embedded agent tasks, each an ``Env`` and a helper that builds groups of them for a rollout.

- ``guess_number``: guess a number from "higher" and "lower" answers (a few turns, no tool);
- ``calculator``: GSM8K-schema word problems with a ``calculator`` tool (a few turns);
- ``read_pages``: count a word in a document read one page per turn with ``read_page`` (many turns).

The ``calculator`` tool itself is ``twinkle.agent.tasks.calculator.calculator`` (not re-exported
here, where its name would hide its module).
"""

from twinkle.agent.tasks.calculator import CalculatorEnv, calculator_envs
from twinkle.agent.tasks.guess_number import GuessNumberEnv
from twinkle.agent.tasks.read_pages import Document, ReadPagesEnv, make_document, read_pages_envs

__all__ = [
    'CalculatorEnv',
    'Document',
    'GuessNumberEnv',
    'ReadPagesEnv',
    'calculator_envs',
    'make_document',
    'read_pages_envs',
]
