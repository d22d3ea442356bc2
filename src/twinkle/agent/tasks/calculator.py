"""GSM8K-schema word problems with a calculator tool: the short tool-use task.

``calculator`` evaluates arithmetic the way a model writes it (``3 * (4 + 5)``, ``48 / 2``) and
nothing else: the expression is parsed with ``ast`` and only numbers, ``+ - * / // % **``, unary
signs and parentheses are evaluated, never ``eval``. The arithmetic is exact (``fractions``),
so ``0.1 + 0.2`` is ``0.3`` and ``48 / 2`` is ``24``, as a GSM8K answer is written; sizes are
bounded before the work is done, so ``9 ** 9 ** 9`` is an error the model reads, not a hang.

``CalculatorEnv`` opens with a system prompt that offers the tool and asks for the final answer
as ``#### <number>``, then the question; the final answer is graded by the same extraction as
``twinkle.reward.gsm8k`` (the number after the last ``####``).

    groups = calculator_envs('train', num_tasks=8, group_size=4, seed=0)
    episodes = RolloutEngine(sampler, template, SamplingParams(max_tokens=256)).rollout(groups)
"""

from __future__ import annotations

import ast
import math
import operator
import random
from collections.abc import Callable, Mapping
from decimal import Decimal, localcontext
from fractions import Fraction
from functools import cache

from twinkle.agent.base import Env, ToolEnv, env_groups
from twinkle.agent.tools import ToolBox
from twinkle.assets import gsm8k
from twinkle.data_format import Message
from twinkle.errors import ConfigurationError, DataError, one_of
from twinkle.reward.gsm8k import final_answer

#: The longest expression the calculator reads: a worked step is short, and the bound keeps the
#: parser and the evaluator's recursion small whatever the model writes.
MAX_EXPRESSION_CHARS = 500
#: The most digits a value may have (numerator or denominator); a larger one is refused.
MAX_DIGITS = 100
#: Significant digits of a result that is not a whole number (1/3 -> 0.333333333333333).
RESULT_DIGITS = 15

Number = Fraction | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_SYMBOLS: dict[type[ast.operator], str] = {
    ast.Add: '+',
    ast.Sub: '-',
    ast.Mult: '*',
    ast.Div: '/',
    ast.FloorDiv: '//',
    ast.Mod: '%',
    ast.Pow: '**',
    ast.BitXor: '^',
    ast.BitAnd: '&',
    ast.BitOr: '|',
    ast.LShift: '<<',
    ast.RShift: '>>',
    ast.MatMult: '@',
}

CALCULATOR_SYSTEM = (
    'You are a helpful math assistant. Solve the problem step by step. To do arithmetic, call the '
    'calculator tool with an expression such as "3 * (4 + 5)"; it answers with the result. When you '
    'know the answer, reply without a tool call and give the final answer on its own line as "#### <number>".'
)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(48 / 2) * 3 - 7"
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise DataError(
            f'the expression has {len(expression)} characters; the calculator reads at most {MAX_EXPRESSION_CHARS}'
        )
    try:
        tree = ast.parse(expression.strip(), mode='eval')
    except SyntaxError as e:
        raise DataError(f'{expression!r} is not an arithmetic expression ({e.msg})') from e
    return format_number(_evaluate(tree.body))


def format_number(value: Number) -> str:
    """A result as a model reads it: a whole number without ``.0``, else at most ``RESULT_DIGITS``
    significant digits, never in exponent notation.

    >>> format_number(Fraction(24)), format_number(Fraction(3, 10)), format_number(Fraction(1, 3)), format_number(2.0)
    ('24', '0.3', '0.333333333333333', '2')
    """
    exact = Fraction(value)
    if exact.denominator == 1:
        return str(exact.numerator)
    with localcontext() as context:
        context.prec = RESULT_DIGITS
        decimal = Decimal(exact.numerator) / Decimal(exact.denominator)
    return format(decimal.normalize(), 'f')


def _evaluate(node: ast.expr) -> Number:
    """The value of one node of the parsed expression; anything but arithmetic is refused."""
    if isinstance(node, ast.Constant):
        return _literal(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        return _checked(_apply(node.op, left, right))
    raise DataError(_refusal(node))


def _literal(value: object) -> Number:
    if type(value) is int:
        return _checked(Fraction(value))
    if type(value) is float:
        if not math.isfinite(value):
            raise DataError(f'the number {value} is too large for the calculator')
        return _checked(Fraction(repr(value)))  # the number as written: 0.1 is 1/10, not a binary fraction
    raise DataError(f'{value!r} is not a number; the calculator takes whole and decimal numbers only')


def _apply(op: ast.operator, left: Number, right: Number) -> Number:
    try:
        if isinstance(op, ast.Pow):
            return _power(left, right)
        if type(op) in _BINARY:
            return _BINARY[type(op)](left, right)
    except ZeroDivisionError as e:
        raise DataError(f'{_show(left, op, right)} divides by zero') from e
    except OverflowError as e:
        raise DataError(f'{_show(left, op, right)} is too large for the calculator') from e
    raise DataError(f'the operator {_symbol(op)!r} is not arithmetic here; use + - * / // % ** (** for powers)')


def _power(base: Number, exponent: Number) -> Number:
    """``base ** exponent``, refused before it is computed when the result would pass ``MAX_DIGITS``."""
    if isinstance(exponent, Fraction) and exponent.denominator == 1 and isinstance(base, Fraction):
        size = max(abs(base.numerator), base.denominator)
        if size > 1 and abs(exponent.numerator) * math.log10(size) > MAX_DIGITS:
            raise DataError(
                f'{_show(base, ast.Pow(), exponent)} has more than {MAX_DIGITS} digits; '
                'the calculator refuses numbers that large'
            )
        power: Fraction = base**exponent.numerator
        return power
    root: float | complex = float(base) ** float(exponent)  # not exact, and complex for a negative base
    if isinstance(root, complex):
        raise DataError(f'{_show(base, ast.Pow(), exponent)} is not a real number')
    return root


def _checked(value: Number | int) -> Number:
    """``value`` (a ``Fraction`` unless it is a float: ``Fraction // Fraction`` gives an int),
    unless it is not finite or has more than ``MAX_DIGITS`` digits."""
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(f'the result {value} is not a finite number')
    exact = Fraction(value)
    if max(abs(exact.numerator), exact.denominator) >= 10**MAX_DIGITS:
        raise DataError(f'a value has more than {MAX_DIGITS} digits; the calculator refuses numbers that large')
    return value if isinstance(value, float) else exact


def _show(left: Number, op: ast.operator, right: Number) -> str:
    """``left op right`` as text, a negative operand in parentheses (``(-8) ** 0.5``)."""
    left_text, right_text = (f'({format_number(v)})' if v < 0 else format_number(v) for v in (left, right))
    return f'{left_text} {_symbol(op)} {right_text}'


def _symbol(op: ast.operator) -> str:
    return _SYMBOLS.get(type(op), type(op).__name__)


def _refusal(node: ast.expr) -> str:
    """Why ``node`` is not evaluated, in words that tell the model what to write instead."""
    text = ast.unparse(node)
    if isinstance(node, ast.Name):
        return f'{text!r} is a name; the calculator takes numbers only (write the value, not a variable)'
    if isinstance(node, ast.Call):
        return f'{text!r} calls a function; the calculator has none (use ** 0.5 for a square root)'
    if isinstance(node, ast.Tuple):
        return 'the expression has a comma; write one expression, numbers without thousands commas (1000, not 1,000)'
    return f'{text!r} is not arithmetic; the calculator takes numbers, + - * / // % **, and parentheses'


class CalculatorEnv(ToolEnv):
    """One GSM8K-schema problem (``{'question', 'answer'}``, the answer ending in ``#### <number>``)
    with ``calculator``; 1.0 when the final answer's number after ``####`` equals the problem's.

    ``user_data`` holds ``problem_id`` and ``ground_truth`` (the key ``GSM8KAccuracyReward``
    reads, so an episode's row can be scored by it too)."""

    def __init__(self, problem: Mapping[str, str], problem_id: str = '', max_tool_calls: int = 8):
        expected = final_answer(problem.get('answer', ''))
        if expected is None or 'question' not in problem:
            raise DataError(
                f'problem {problem_id!r} needs a question and an answer ending in "#### <number>"; '
                f'got fields {sorted(problem)} with answer {problem.get("answer", "")[-60:]!r}'
            )
        messages: list[Message] = [
            {'role': 'system', 'content': CALCULATOR_SYSTEM},
            {'role': 'user', 'content': problem['question']},
        ]
        super().__init__(messages, ToolBox([calculator]), max_tool_calls)
        self.expected = expected
        self.user_data = {'task': 'calculator', 'problem_id': problem_id, 'ground_truth': str(expected)}

    def grade(self, answer: str) -> float:
        return 1.0 if final_answer(answer) == self.expected else 0.0


@cache
def gsm8k_problems(split: str) -> tuple[Mapping[str, str], ...]:
    """The embedded GSM8K-schema problems of ``split`` (``twinkle.assets.gsm8k``), built once."""
    if split not in gsm8k.SPLIT_SIZES:
        raise one_of('split of the embedded gsm8k problems', split, gsm8k.SPLIT_SIZES)
    return tuple(gsm8k.splits()[split])


def calculator_envs(split: str = 'train', num_tasks: int = 8, group_size: int = 4, seed: int = 0) -> list[list[Env]]:
    """``num_tasks`` groups of ``group_size`` ``CalculatorEnv``s, each group one problem of
    ``split`` drawn without repeats by a ``random.Random(seed)``."""
    problems = gsm8k_problems(split)
    if not 0 < num_tasks <= len(problems):
        raise ConfigurationError(f'num_tasks must be 1 to {len(problems)} (the {split!r} problems); got {num_tasks}')
    picks = random.Random(seed).sample(range(len(problems)), num_tasks)
    return env_groups(
        lambda task: CalculatorEnv(problems[picks[task]], problem_id=f'gsm8k/{split}/{picks[task]}'),
        num_tasks,
        group_size,
    )
