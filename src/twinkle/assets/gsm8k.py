"""Grade-school word problems in the schema of GSM8K (Cobbe et al. 2021, arXiv:2110.14168).

Each row is ``{"question": ..., "answer": ...}``. The answer is step-by-step reasoning whose
arithmetic carries calculator annotations, ``48/2 = <<48/2=24>>24``, and ends with a line
``#### <number>``: the result of the last calculation. Problems come from the templates below,
filled by a seeded ``random.Random``; every number is computed here, never written by hand.
"""

from __future__ import annotations

import math
import operator
import random
from collections.abc import Callable

from twinkle.assets.words import NAMES, NOUNS, PLACES

_OPS: dict[str, Callable[[int, int], int]] = {
    '+': operator.add,
    '-': operator.sub,
    '*': operator.mul,
    '/': operator.floordiv,
}


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


def _clips(rng: random.Random) -> Problem:
    name, april, s = rng.choice(NAMES), 2 * rng.randint(10, 60), Solution()
    may_text, may = s.calc(april, '/', 2)
    s.say(f'{name} sold {may_text} clips in May.')
    s.say(f'{name} sold {s.calc(april, "+", may)[0]} clips altogether in April and May.')
    q = (
        f'{name} sold clips to {april} friends in April, and then sold half as many clips in May. '
        f'How many clips did {name} sell altogether in April and May?'
    )
    return q, s


def _change(rng: random.Random) -> Problem:
    name, s = rng.choice(NAMES), Solution()
    n, p, m, c = rng.randint(2, 9), rng.randint(2, 15), rng.randint(2, 9), rng.randint(1, 9)
    a_text, a = s.calc(n, '*', p)
    b_text, b = s.calc(m, '*', c)
    bill = 50 if a + b <= 50 else (100 if a + b <= 100 else 200)
    s.say(f'The notebooks cost {a_text} dollars.')
    s.say(f'The pens cost {b_text} dollars.')
    t_text, total = s.calc(a, '+', b)
    s.say(f'Altogether {name} spends {t_text} dollars.')
    s.say(f'{name} gets {s.calc(bill, "-", total)[0]} dollars in change.')
    q = (
        f'{name} buys {n} notebooks that cost ${p} each and {m} pens that cost ${c} each. '
        f'{name} pays with a ${bill} bill. How much change does {name} get, in dollars?'
    )
    return q, s


def _wage(rng: random.Random) -> Problem:
    name, s = rng.choice(NAMES), Solution()
    w, h, d = rng.randint(8, 30), rng.randint(2, 10), rng.randint(2, 7)
    day_text, per_day = s.calc(w, '*', h)
    s.say(f'{name} earns {day_text} dollars per day.')
    s.say(f'In {d} days {name} earns {s.calc(per_day, "*", d)[0]} dollars.')
    q = f'{name} earns ${w} an hour and works {h} hours a day. How much does {name} earn in {d} days?'
    return q, s


def _reading(rng: random.Random) -> Problem:
    name, s = rng.choice(NAMES), Solution()
    p, k, r = rng.randint(5, 40), rng.randint(2, 12), rng.randint(10, 90)
    total = r + p * k
    left_text, left = s.calc(total, '-', r)
    s.say(f'{name} has {left_text} pages left to read.')
    s.say(f'It will take {s.calc(left, "/", p)[0]} days to finish the book.')
    q = (
        f'A book has {total} pages. {name} has already read {r} pages and reads {p} pages every day. '
        f'How many more days will it take {name} to finish the book?'
    )
    return q, s


def _give_away(rng: random.Random) -> Problem:
    name, k, s = rng.choice(NAMES), rng.choice((2, 3, 4, 5)), Solution()
    apples = k * rng.randint(4, 20)
    give_text, give = s.calc(apples, '/', k)
    e = rng.randint(2, apples - give - 1)
    s.say(f'{name} gives away {give_text} apples.')
    left_text, left = s.calc(apples, '-', give)
    s.say(f'{name} then has {left_text} apples.')
    s.say(f'After eating {e}, {name} has {s.calc(left, "-", e)[0]} apples left.')
    q = (
        f'{name} picked {apples} apples and gave 1/{k} of them to a neighbor. Then {name} ate {e} apples. '
        f'How many apples does {name} have left?'
    )
    return q, s


def _chairs(rng: random.Random) -> Problem:
    r, c, s = rng.randint(3, 12), rng.randint(4, 15), Solution()
    chairs_text, chairs = s.calc(r, '*', c)
    students = rng.randint(2, chairs - 1)
    s.say(f'There are {chairs_text} chairs in the hall.')
    s.say(f'{s.calc(chairs, "-", students)[0]} chairs are empty.')
    q = f'A hall has {r} rows of {c} chairs. If {students} students sit down, how many chairs are empty?'
    return q, s


def _ages(rng: random.Random) -> Problem:
    a, b = rng.sample(NAMES, 2)
    y, x, z, s = rng.randint(3, 40), rng.randint(2, 30), rng.randint(2, 15), Solution()
    a_text, a_now = s.calc(y, '+', x)
    s.say(f'{a} is {a_text} years old now.')
    a_later_text, a_later = s.calc(a_now, '+', z)
    s.say(f'In {z} years {a} will be {a_later_text} years old.')
    b_later_text, b_later = s.calc(y, '+', z)
    s.say(f'In {z} years {b} will be {b_later_text} years old.')
    s.say(f'Their ages will add up to {s.calc(a_later, "+", b_later)[0]} years.')
    q = f'{b} is {y} years old, and {a} is {x} years older than {b}. What will the sum of their ages be in {z} years?'
    return q, s


def _savings(rng: random.Random) -> Problem:
    name, w, k, s = rng.choice(NAMES), rng.randint(5, 50), rng.randint(3, 20), Solution()
    saved_text, saved = s.calc(w, '*', k)
    spent = rng.randint(1, saved - 1)
    s.say(f'{name} saves {saved_text} dollars.')
    s.say(f'After buying the gift, {name} has {s.calc(saved, "-", spent)[0]} dollars left.')
    q = (
        f'{name} saves ${w} every week for {k} weeks, then spends ${spent} on a gift. '
        f'How many dollars does {name} have left?'
    )
    return q, s


def _distance(rng: random.Random) -> Problem:
    name, place, s = rng.choice(NAMES), rng.choice(PLACES), Solution()
    v, h, u, g = rng.randint(30, 70), rng.randint(2, 5), rng.randint(20, 60), rng.randint(2, 4)
    first_text, first = s.calc(v, '*', h)
    s.say(f'First {name} drives {first_text} miles.')
    second_text, second = s.calc(u, '*', g)
    s.say(f'Then {name} drives {second_text} miles.')
    s.say(f'In total {name} drives {s.calc(first, "+", second)[0]} miles.')
    q = (
        f'On the way to {place}, {name} drives at {v} miles per hour for {h} hours, then at {u} miles per '
        f'hour for {g} hours. How many miles does {name} drive in total?'
    )
    return q, s


def _baking(rng: random.Random) -> Problem:
    name, f, b, s = rng.choice(NAMES), rng.randint(2, 6), rng.randint(2, 9), Solution()
    need_text, need = s.calc(f, '*', b)
    have = rng.randint(2, need - 1)
    s.say(f'{name} needs {need_text} cups of flour.')
    s.say(f'{name} must buy {s.calc(need, "-", have)[0]} more cups of flour.')
    q = (
        f'A cake recipe needs {f} cups of flour per batch. {name} wants to bake {b} batches and has '
        f'{have} cups of flour. How many more cups of flour does {name} need?'
    )
    return q, s


def _discount(rng: random.Random) -> Problem:
    noun, price, d, s = rng.choice(NOUNS), 20 * rng.randint(2, 30), rng.choice((10, 20, 25, 50)), Solution()
    off_text, off = s.calc(price, '/', 100 // d)  # d% is 1/(100/d); 20 | price makes it whole
    s.say(f'{d}% is 1/{100 // d}, so the discount is {off_text} dollars.')
    s.say(f'The sale price is {s.calc(price, "-", off)[0]} dollars.')
    q = f'A {noun} costs ${price}. It is on sale for {d}% off. What is the sale price in dollars?'
    return q, s


def _sharing(rng: random.Random) -> Problem:
    name, k, each, s = rng.choice(NAMES), rng.randint(2, 9), rng.randint(3, 15), Solution()
    candies, e = k * each, rng.randint(2, each - 1)
    share_text, share = s.calc(candies, '/', k)
    s.say(f'Each friend gets {share_text} candies.')
    s.say(f'Each friend has {s.calc(share, "-", e)[0]} candies left.')
    q = (
        f'{name} shares {candies} candies equally among {k} friends. Each friend eats {e} candies. '
        f'How many candies does each friend have left?'
    )
    return q, s


def _garden(rng: random.Random) -> Problem:
    name, s = rng.choice(NAMES), Solution()
    r, p, t = rng.randint(2, 10), rng.randint(3, 12), rng.randint(2, 9)
    plants_text, plants = s.calc(r, '*', p)
    s.say(f'There are {plants_text} tomato plants.')
    s.say(f'They grow {s.calc(plants, "*", t)[0]} tomatoes.')
    q = (
        f"{name}'s garden has {r} rows with {p} tomato plants in each row. Each plant grows {t} tomatoes. "
        f'How many tomatoes grow in the garden?'
    )
    return q, s


def _marbles(rng: random.Random) -> Problem:
    a, b, c = rng.sample(NAMES, 3)
    x, f, s = rng.randint(3, 40), rng.randint(2, 5), Solution()
    b_text, b_has = s.calc(x, '*', 2)
    s.say(f'{b} has {b_text} marbles.')
    c_text, c_has = s.calc(b_has, '-', f)
    s.say(f'{c} has {c_text} marbles.')
    ab_text, ab = s.calc(x, '+', b_has)
    s.say(f'{a} and {b} have {ab_text} marbles together.')
    s.say(f'All three have {s.calc(ab, "+", c_has)[0]} marbles.')
    q = (
        f'{a} has {x} marbles. {b} has twice as many marbles as {a}, and {c} has {f} fewer marbles '
        f'than {b}. How many marbles do they have altogether?'
    )
    return q, s


def _tickets(rng: random.Random) -> Problem:
    place, s = rng.choice(PLACES), Solution()
    adult, child, n, m = rng.randint(10, 30), rng.randint(3, 9), rng.randint(2, 4), rng.randint(2, 5)
    a_text, a = s.calc(n, '*', adult)
    s.say(f'The adult tickets cost {a_text} dollars.')
    c_text, c = s.calc(m, '*', child)
    s.say(f'The child tickets cost {c_text} dollars.')
    s.say(f'The family pays {s.calc(a, "+", c)[0]} dollars.')
    q = (
        f'At the {place} zoo an adult ticket costs ${adult} and a child ticket costs ${child}. '
        f'How much does a family of {n} adults and {m} children pay?'
    )
    return q, s


def _legs(rng: random.Random) -> Problem:
    name, d, c, s = rng.choice(NAMES), rng.randint(2, 12), rng.randint(2, 30), Solution()
    dog_text, dog = s.calc(d, '*', 4)
    s.say(f'The dogs have {dog_text} legs.')
    hen_text, hen = s.calc(c, '*', 2)
    s.say(f'The chickens have {hen_text} legs.')
    s.say(f'There are {s.calc(dog, "+", hen)[0]} legs in total.')
    q = f"{name}'s farm has {d} dogs and {c} chickens. How many legs do the animals have in total?"
    return q, s


def _episodes(rng: random.Random) -> Problem:
    name, m, s = rng.choice(NAMES), rng.choice((20, 30, 40, 45, 60, 90)), Solution()
    e = rng.randint(2, 8) * (60 // math.gcd(m, 60))  # so that m * e is a whole number of hours
    minutes_text, minutes = s.calc(m, '*', e)
    s.say(f'{name} watches for {minutes_text} minutes.')
    s.say(f'That is {s.calc(minutes, "/", 60)[0]} hours.')
    q = f'Each episode of a show lasts {m} minutes. {name} watches {e} episodes. How many hours is that?'
    return q, s


def _tank(rng: random.Random) -> Problem:
    rate, k, start, s = rng.randint(2, 12), rng.randint(3, 30), rng.randint(5, 100), Solution()
    capacity = start + rate * k
    rest_text, rest = s.calc(capacity, '-', start)
    s.say(f'The tank needs {rest_text} more liters.')
    s.say(f'It takes {s.calc(rest, "/", rate)[0]} minutes to fill.')
    q = (
        f'A tank holds {capacity} liters and already has {start} liters in it. Water flows in at {rate} '
        f'liters per minute. How many minutes until the tank is full?'
    )
    return q, s


def _bakery(rng: random.Random) -> Problem:
    name, box, price, s = rng.choice(NAMES), rng.choice((4, 6, 8, 12)), rng.randint(3, 12), Solution()
    trays, per_tray = rng.randint(2, 10), box * rng.randint(1, 4)
    cookies_text, cookies = s.calc(trays, '*', per_tray)
    s.say(f'{name} bakes {cookies_text} cookies.')
    boxes_text, boxes = s.calc(cookies, '/', box)
    s.say(f'That fills {boxes_text} boxes.')
    s.say(f'{name} earns {s.calc(boxes, "*", price)[0]} dollars.')
    q = (
        f'{name} bakes {trays} trays of {per_tray} cookies and packs them in boxes of {box}. '
        f'Each box sells for ${price}. How many dollars does {name} earn by selling all the boxes?'
    )
    return q, s


def _running(rng: random.Random) -> Problem:
    name, s = rng.choice(NAMES), Solution()
    k, w, n = rng.randint(2, 10), rng.randint(5, 20), rng.randint(2, 8)
    weekday_text, weekday = s.calc(k, '*', 5)
    s.say(f'On weekdays {name} runs {weekday_text} km.')
    week_text, week = s.calc(weekday, '+', w)
    s.say(f'Each week {name} runs {week_text} km.')
    s.say(f'In {n} weeks {name} runs {s.calc(week, "*", n)[0]} km.')
    q = f'{name} runs {k} km every weekday and {w} km on Saturday. How many kilometers does {name} run in {n} weeks?'
    return q, s


TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (
    _clips, _change, _wage, _reading, _give_away, _chairs, _ages, _savings, _distance, _baking,
    _discount, _sharing, _garden, _marbles, _tickets, _legs, _episodes, _tank, _bakery, _running,
)  # fmt: skip

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
