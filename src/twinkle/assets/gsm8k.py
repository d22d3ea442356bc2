"""Grade-school word problems in the schema of GSM8K (Cobbe et al. 2021, arXiv:2110.14168).

Each row is ``{"question": ..., "answer": ...}``. The answer is step-by-step reasoning whose
arithmetic carries calculator annotations, ``48/2 = <<48/2=24>>24``, and ends with a line
``#### <number>``: the result of the last calculation. Problems come from the templates in
``TEMPLATE_TEXT``, filled by a seeded ``random.Random``; every number is computed here, never
written by hand.

A template is a block of lines (a line that starts with a space continues the one above)::

    [wage]
    draw: name = choice(NAMES); w = randint(8, 30); h = randint(2, 10); d = randint(2, 7)
    ask:  {name} earns ${w} an hour and works {h} hours a day. How much does {name} earn in {d} days?
    say:  {name} earns [per_day = w * h] dollars per day.
    say:  In {d} days {name} earns [per_day * d] dollars.

``draw`` is a run of Python assignments, evaluated in order with whole numbers, names drawn
before, ``+ - * //``, tuples and the calls ``choice``, ``randint``, ``sample`` (the seeded
generator's), ``gcd`` and ``bill_for``; nothing else is evaluated. ``ask`` is the question and
each ``say`` a line of the reasoning, with ``{name}`` fields; a ``[a op b]`` in a ``say`` line
(``op`` one of ``+ - * /``, operands names or whole numbers) is one annotated calculation,
and ``[x = a op b]`` also names its result for later lines. (Templates in the spirit of
GSM-Symbolic, Mirzadeh et al. 2024, arXiv:2410.05229.)
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from twinkle.assets.words import NAMES, NOUNS, PLACES

_OPS: dict[str, Callable[[int, int], int]] = {
    '+': operator.add,
    '-': operator.sub,
    '*': operator.mul,
    '/': operator.floordiv,
}
#: The operators a ``draw`` may use.
_DRAW_OPS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}
#: ``[x = a op b]`` or ``[a op b]`` in a ``say`` line.
_CALC = re.compile(r'\[(?:(\w+) = )?(\w+) ([-+*/]) (\w+)\]')


class Solution:
    """Collects reasoning lines; ``calc`` does one annotated calculation and remembers it."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.last: int | None = None

    def calc(self, a: int, op: str, b: int) -> tuple[str, int]:
        """``(text, value)`` for ``a op b``, e.g. ``('48/2 = <<48/2=24>>24', 24)``."""
        if op == '/' and a % b:
            raise ArithmeticError(f'{a}/{b} is not a whole number; a template picked bad numbers')
        value = _OPS[op](a, b)
        if value < 0:
            raise ArithmeticError(f'{a}{op}{b} is negative; a template picked bad numbers')
        self.last = value
        return f'{a}{op}{b} = <<{a}{op}{b}={value}>>{value}', value

    def say(self, line: str) -> None:
        self.lines.append(line)

    def answer(self) -> str:
        """The reasoning lines and the final ``#### <last result>`` line."""
        return '\n'.join([*self.lines, f'#### {self.last}'])


Problem = tuple[str, Solution]


@dataclass(frozen=True)
class Template:
    """One problem template (module docstring), parsed."""

    name: str
    draws: tuple[ast.Assign, ...]
    question: str
    steps: tuple[str, ...]

    def __call__(self, rng: random.Random) -> Problem:
        """A problem drawn from ``rng``: its question and its worked solution."""
        values: dict[str, object] = {'NAMES': NAMES, 'NOUNS': NOUNS, 'PLACES': PLACES}
        functions: dict[str, Callable[..., object]] = {
            'choice': rng.choice,
            'randint': rng.randint,
            'sample': rng.sample,
            'gcd': math.gcd,
            'bill_for': bill_for,
        }
        for draw in self.draws:
            _assign(draw.targets[0], _evaluate(draw.value, values, functions), values)
        solution = Solution()
        for step in self.steps:
            solution.say(_CALC.sub(lambda calc: _calculate(calc, values, solution), step).format(**values))
        return self.question.format(**values), solution


def bill_for(total: int) -> int:
    """The smallest bill of $50, $100 or $200 that pays ``total`` (at most $200)."""
    return next((bill for bill in (50, 100) if total <= bill), 200)


def _evaluate(node: ast.expr, values: Mapping[str, object], functions: Mapping[str, Callable[..., object]]) -> object:
    """The value of a draw's right-hand side, left to right as Python evaluates it."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.Tuple):
        return tuple(_evaluate(item, values, functions) for item in node.elts)
    if isinstance(node, ast.BinOp) and type(node.op) in _DRAW_OPS:
        left, right = (_whole(_evaluate(side, values, functions), node) for side in (node.left, node.right))
        return _DRAW_OPS[type(node.op)](left, right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
        if node.keywords:
            raise ValueError(f'{ast.unparse(node)!r}: a draw passes arguments by position')
        return functions[node.func.id](*(_evaluate(arg, values, functions) for arg in node.args))
    raise ValueError(
        f'{ast.unparse(node)!r} is not allowed in a draw: it takes whole numbers, names drawn before, + - * //, '
        f'tuples and calls of {sorted(functions)}'
    )


def _whole(value: object, node: ast.expr) -> int:
    if not isinstance(value, int):
        raise TypeError(f'{ast.unparse(node)!r} needs whole numbers; got {value!r}')
    return value


def _assign(target: ast.expr, value: object, values: dict[str, object]) -> None:
    if isinstance(target, ast.Name):
        values[target.id] = value
    elif isinstance(target, ast.Tuple) and isinstance(value, Sequence):
        for item, part in zip(target.elts, value, strict=True):
            _assign(item, part, values)
    else:
        raise ValueError(f'cannot assign {value!r} to {ast.unparse(target)!r} in a draw')


def _calculate(calc: re.Match[str], values: dict[str, object], solution: Solution) -> str:
    """One ``[x = a op b]``: the annotated text, with ``x`` bound to the result."""
    result, a, op, b = calc.groups()
    text, value = solution.calc(_operand(a, values), op, _operand(b, values))
    if result is not None:
        values[result] = value
    return text


def _operand(token: str, values: Mapping[str, object]) -> int:
    value = int(token) if token.isdigit() else values[token]
    if not isinstance(value, int):
        raise TypeError(f'{token!r} is {value!r}, not a whole number to calculate with')
    return value


def parse_templates(text: str) -> tuple[Template, ...]:
    """The templates of ``text`` (module docstring), in order."""
    blocks = re.split(r'^\[(\w+)\]$', text.strip(), flags=re.MULTILINE)[1:]
    return tuple(_parse_block(name, body) for name, body in zip(blocks[::2], blocks[1::2], strict=True))


def _parse_block(name: str, body: str) -> Template:
    fields: list[tuple[str, str]] = []
    for line in body.strip().splitlines():
        if line.startswith(' ') and fields:
            key, value = fields[-1]
            fields[-1] = (key, f'{value} {line.strip()}')
        else:
            key, sep, value = line.partition(':')
            if not sep or key not in ('draw', 'ask', 'say'):
                raise ValueError(f'template {name!r}: a line starts with draw:, ask: or say:; got {line!r}')
            fields.append((key, value.strip()))
    draws = [value for key, value in fields if key == 'draw']
    questions = [value for key, value in fields if key == 'ask']
    steps = tuple(value for key, value in fields if key == 'say')
    if len(questions) != 1 or not steps:
        raise ValueError(f'template {name!r} needs one ask: line and at least one say: line')
    statements = [statement for draw in draws for statement in ast.parse(draw).body]
    if not all(isinstance(s, ast.Assign) and len(s.targets) == 1 for s in statements):
        raise ValueError(f'template {name!r}: a draw is a run of plain assignments; got {draws}')
    return Template(name, tuple(s for s in statements if isinstance(s, ast.Assign)), questions[0], steps)


TEMPLATE_TEXT = """
[clips]
draw: name = choice(NAMES); april = 2 * randint(10, 60)
ask:  {name} sold clips to {april} friends in April, and then sold half as many clips in May.
      How many clips did {name} sell altogether in April and May?
say:  {name} sold [may = april / 2] clips in May.
say:  {name} sold [april + may] clips altogether in April and May.

[change]
draw: name = choice(NAMES); n, p, m, c = randint(2, 9), randint(2, 15), randint(2, 9), randint(1, 9)
draw: bill = bill_for(n * p + m * c)
ask:  {name} buys {n} notebooks that cost ${p} each and {m} pens that cost ${c} each.
      {name} pays with a ${bill} bill. How much change does {name} get, in dollars?
say:  The notebooks cost [a = n * p] dollars.
say:  The pens cost [b = m * c] dollars.
say:  Altogether {name} spends [total = a + b] dollars.
say:  {name} gets [bill - total] dollars in change.

[wage]
draw: name = choice(NAMES); w, h, d = randint(8, 30), randint(2, 10), randint(2, 7)
ask:  {name} earns ${w} an hour and works {h} hours a day. How much does {name} earn in {d} days?
say:  {name} earns [per_day = w * h] dollars per day.
say:  In {d} days {name} earns [per_day * d] dollars.

[reading]
draw: name = choice(NAMES); p, k, r = randint(5, 40), randint(2, 12), randint(10, 90); total = r + p * k
ask:  A book has {total} pages. {name} has already read {r} pages and reads {p} pages every day.
      How many more days will it take {name} to finish the book?
say:  {name} has [left = total - r] pages left to read.
say:  It will take [left / p] days to finish the book.

[give_away]
draw: name, k = choice(NAMES), choice((2, 3, 4, 5)); apples = k * randint(4, 20)
draw: e = randint(2, apples - apples // k - 1)
ask:  {name} picked {apples} apples and gave 1/{k} of them to a neighbor. Then {name} ate {e} apples.
      How many apples does {name} have left?
say:  {name} gives away [give = apples / k] apples.
say:  {name} then has [left = apples - give] apples.
say:  After eating {e}, {name} has [left - e] apples left.

[chairs]
draw: r, c = randint(3, 12), randint(4, 15); students = randint(2, r * c - 1)
ask:  A hall has {r} rows of {c} chairs. If {students} students sit down, how many chairs are empty?
say:  There are [chairs = r * c] chairs in the hall.
say:  [chairs - students] chairs are empty.

[ages]
draw: a, b = sample(NAMES, 2); y, x, z = randint(3, 40), randint(2, 30), randint(2, 15)
ask:  {b} is {y} years old, and {a} is {x} years older than {b}. What will the sum of their ages be in
      {z} years?
say:  {a} is [a_now = y + x] years old now.
say:  In {z} years {a} will be [a_later = a_now + z] years old.
say:  In {z} years {b} will be [b_later = y + z] years old.
say:  Their ages will add up to [a_later + b_later] years.

[savings]
draw: name, w, k = choice(NAMES), randint(5, 50), randint(3, 20); spent = randint(1, w * k - 1)
ask:  {name} saves ${w} every week for {k} weeks, then spends ${spent} on a gift.
      How many dollars does {name} have left?
say:  {name} saves [saved = w * k] dollars.
say:  After buying the gift, {name} has [saved - spent] dollars left.

[distance]
draw: name, place = choice(NAMES), choice(PLACES)
draw: v, h, u, g = randint(30, 70), randint(2, 5), randint(20, 60), randint(2, 4)
ask:  On the way to {place}, {name} drives at {v} miles per hour for {h} hours, then at {u} miles per
      hour for {g} hours. How many miles does {name} drive in total?
say:  First {name} drives [first = v * h] miles.
say:  Then {name} drives [second = u * g] miles.
say:  In total {name} drives [first + second] miles.

[baking]
draw: name, f, b = choice(NAMES), randint(2, 6), randint(2, 9); have = randint(2, f * b - 1)
ask:  A cake recipe needs {f} cups of flour per batch. {name} wants to bake {b} batches and has
      {have} cups of flour. How many more cups of flour does {name} need?
say:  {name} needs [need = f * b] cups of flour.
say:  {name} must buy [need - have] more cups of flour.

[discount]
draw: noun, price, d = choice(NOUNS), 20 * randint(2, 30), choice((10, 20, 25, 50)); part = 100 // d
ask:  A {noun} costs ${price}. It is on sale for {d}% off. What is the sale price in dollars?
say:  {d}% is 1/{part}, so the discount is [off = price / part] dollars.
say:  The sale price is [price - off] dollars.

[sharing]
draw: name, k, each = choice(NAMES), randint(2, 9), randint(3, 15); candies = k * each
draw: e = randint(2, each - 1)
ask:  {name} shares {candies} candies equally among {k} friends. Each friend eats {e} candies.
      How many candies does each friend have left?
say:  Each friend gets [share = candies / k] candies.
say:  Each friend has [share - e] candies left.

[garden]
draw: name = choice(NAMES); r, p, t = randint(2, 10), randint(3, 12), randint(2, 9)
ask:  {name}'s garden has {r} rows with {p} tomato plants in each row. Each plant grows {t} tomatoes.
      How many tomatoes grow in the garden?
say:  There are [plants = r * p] tomato plants.
say:  They grow [plants * t] tomatoes.

[marbles]
draw: a, b, c = sample(NAMES, 3); x, f = randint(3, 40), randint(2, 5)
ask:  {a} has {x} marbles. {b} has twice as many marbles as {a}, and {c} has {f} fewer marbles
      than {b}. How many marbles do they have altogether?
say:  {b} has [b_has = x * 2] marbles.
say:  {c} has [c_has = b_has - f] marbles.
say:  {a} and {b} have [ab = x + b_has] marbles together.
say:  All three have [ab + c_has] marbles.

[tickets]
draw: place = choice(PLACES); adult, child, n, m = randint(10, 30), randint(3, 9), randint(2, 4), randint(2, 5)
ask:  At the {place} zoo an adult ticket costs ${adult} and a child ticket costs ${child}.
      How much does a family of {n} adults and {m} children pay?
say:  The adult tickets cost [a = n * adult] dollars.
say:  The child tickets cost [c = m * child] dollars.
say:  The family pays [a + c] dollars.

[legs]
draw: name, d, c = choice(NAMES), randint(2, 12), randint(2, 30)
ask:  {name}'s farm has {d} dogs and {c} chickens. How many legs do the animals have in total?
say:  The dogs have [dog = d * 4] legs.
say:  The chickens have [hen = c * 2] legs.
say:  There are [dog + hen] legs in total.

[episodes]
draw: name, m = choice(NAMES), choice((20, 30, 40, 45, 60, 90))
draw: e = randint(2, 8) * (60 // gcd(m, 60))
ask:  Each episode of a show lasts {m} minutes. {name} watches {e} episodes. How many hours is that?
say:  {name} watches for [minutes = m * e] minutes.
say:  That is [minutes / 60] hours.

[tank]
draw: rate, k, start = randint(2, 12), randint(3, 30), randint(5, 100); capacity = start + rate * k
ask:  A tank holds {capacity} liters and already has {start} liters in it. Water flows in at {rate}
      liters per minute. How many minutes until the tank is full?
say:  The tank needs [rest = capacity - start] more liters.
say:  It takes [rest / rate] minutes to fill.

[bakery]
draw: name, box, price = choice(NAMES), choice((4, 6, 8, 12)), randint(3, 12)
draw: trays, per_tray = randint(2, 10), box * randint(1, 4)
ask:  {name} bakes {trays} trays of {per_tray} cookies and packs them in boxes of {box}.
      Each box sells for ${price}. How many dollars does {name} earn by selling all the boxes?
say:  {name} bakes [cookies = trays * per_tray] cookies.
say:  That fills [boxes = cookies / box] boxes.
say:  {name} earns [boxes * price] dollars.

[running]
draw: name = choice(NAMES); k, w, n = randint(2, 10), randint(5, 20), randint(2, 8)
ask:  {name} runs {k} km every weekday and {w} km on Saturday. How many kilometers does {name} run in
      {n} weeks?
say:  On weekdays {name} runs [weekday = k * 5] km.
say:  Each week {name} runs [week = weekday + w] km.
say:  In {n} weeks {name} runs [week * n] km.
"""

TEMPLATES: tuple[Template, ...] = parse_templates(TEMPLATE_TEXT)

SPLIT_SIZES: dict[str, int] = {'train': 1000, 'test': 200}
SEED = 8_500


def splits() -> dict[str, list[dict[str, str]]]:
    """All splits: distinct problems from one seeded stream, the first ones for train."""
    rng = random.Random(SEED)
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(rows) < sum(SPLIT_SIZES.values()):
        question, solution = rng.choice(TEMPLATES)(rng)
        if question not in seen:  # a membership test only; order comes from the list
            seen.add(question)
            rows.append({'question': question, 'answer': solution.answer()})
    out, start = {}, 0
    for split, size in SPLIT_SIZES.items():
        out[split], start = rows[start : start + size], start + size
    return out
