"""A generated, seeded training corpus for the embedded tokenizer.

English and Chinese sentences from small grammars over the word lists in ``words.py``, a little
Markdown, Python and JSON, and emoji, so that the learned merges cover what tests and cookbook
recipes feed the tiny models. Every function here is a pure function of its seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from twinkle.assets import words as W


def past(verb: str) -> str:
    """Simple past of an English verb ('walk' -> 'walked', 'carry' -> 'carried', 'go' -> 'went')."""
    if verb in W.IRREGULAR_PAST:
        return W.IRREGULAR_PAST[verb]
    if verb.endswith('e'):
        return verb + 'd'
    if verb.endswith('y') and verb[-2] not in 'aeiou':
        return verb[:-1] + 'ied'
    return verb + 'ed'


_DOUBLES_FINAL = ('run', 'swim', 'sit', 'win', 'get', 'forget')  # 'run' -> 'running'


def gerund(verb: str) -> str:
    """'-ing' form of an English verb ('make' -> 'making', 'play' -> 'playing', 'run' -> 'running')."""
    if verb in _DOUBLES_FINAL:
        return verb + verb[-1] + 'ing'
    if verb.endswith('e') and not verb.endswith('ee'):
        return verb[:-1] + 'ing'
    return verb + 'ing'


_UNCOUNTED: tuple[str, ...] = (
    'sheep',
    'fish',
    'rice',
    'milk',
    'juice',
    'tea',
    'coffee',
    'bread',
    'cheese',
    'weather',
    'air',
)
_UNCOUNTED += ('information', 'money', 'health', 'energy', 'knowledge', 'evidence', 'news', 'education')
_IRREGULAR_PLURAL = {'child': 'children', 'life': 'lives', 'knife': 'knives', 'leaf': 'leaves'}


def plural(noun: str) -> str:
    """Plural of an English noun ('box' -> 'boxes', 'city' -> 'cities', 'sheep' -> 'sheep')."""
    if noun in _UNCOUNTED:
        return noun
    if noun in _IRREGULAR_PLURAL:
        return _IRREGULAR_PLURAL[noun]
    if noun.endswith(('s', 'x', 'ch', 'sh')):
        return noun + 'es'
    if noun.endswith('y') and noun[-2] not in 'aeiou':
        return noun[:-1] + 'ies'
    return noun + 's'


_ALL_VERBS = W.VERBS + list(W.IRREGULAR_PAST)

_EN_TEMPLATES = (
    '{name} {past} the {adj} {noun} near the {noun2}.',
    'The {noun} was {adv} {adj} {when}.',
    '{name} and {name2} {past} to {place} {when} to {verb} some {nouns}.',
    'Why did {name} {verb} the {noun} {when}?',
    'In {place}, many {nouns} are {adj}, but this {noun} is {adj2}.',
    'I think that {nouns} {verb} {adv} when the {noun2} is {adj}.',
    '"What a {adj} {noun}!" said {name}.',
    'We are {ing} {topic} because it is {adj} and {adj2}.',
    'Step {n}: {verb} the {noun}, then {verb2} the {noun2}.',
    'There were {n} {nouns} and {m} {nouns2} in the {noun3}.',
    '{name} has been {ing} {topic} for {n} years, and {pron} still finds it {adj}.',
    'Could you {verb} the {adj} {noun} for me, please?',
    'If the {noun} is {adj}, {name} will {verb} it {when}.',
    'Every {noun} in the {noun2} {past} {adv}, which made {name} {adj}.',
    'The {adj} {nouns} of {place} are known for their {adj2} {nouns2}.',
)

_ZH_TEMPLATES = (
    '{name}{when}在{place}{verb}{noun}。',
    '这个{noun}很{adj}，{name}非常{verb2}它。',
    '{name}和{name2}一起{verb}{noun}，觉得非常{adj}。',
    '我们{when}去{place}{verb}{noun}，你要不要一起来？',
    '{when}，{name}买了{n}个{noun}和{m}个{noun2}。',
    '为什么{name}{when}要{verb}{noun}呢？',
    '{place}的{noun}又{adj}又{adj2}。',
    '老师说：“请大家认真{verb}{noun}。”',
)


def _en_fields(rng: random.Random) -> dict[str, object]:
    verb, verb2 = rng.choice(_ALL_VERBS), rng.choice(_ALL_VERBS)
    return {
        'name': rng.choice(W.NAMES),
        'name2': rng.choice(W.NAMES),
        'pron': rng.choice(('he', 'she', 'they')),
        'verb': verb,
        'verb2': verb2,
        'past': past(verb),
        'ing': gerund(verb2),
        'noun': rng.choice(W.NOUNS),
        'noun2': rng.choice(W.NOUNS),
        'noun3': rng.choice(W.NOUNS),
        'nouns': plural(rng.choice(W.NOUNS)),
        'nouns2': plural(rng.choice(W.NOUNS)),
        'adj': rng.choice(W.ADJECTIVES),
        'adj2': rng.choice(W.ADJECTIVES),
        'adv': rng.choice(W.ADVERBS),
        'when': rng.choice(('today', 'yesterday', 'last week', 'in the morning', 'every day', 'at night')),
        'place': rng.choice(W.PLACES),
        'topic': rng.choice(W.TOPICS),
        'n': rng.randint(2, 99),
        'm': rng.randint(2, 999),
    }


def english_sentence(rng: random.Random) -> str:
    """One generated English sentence."""
    return rng.choice(_EN_TEMPLATES).format(**_en_fields(rng))


def chinese_sentence(rng: random.Random) -> str:
    """One generated Chinese sentence."""
    fields = {
        'name': rng.choice(W.ZH_NAMES),
        'name2': rng.choice(W.ZH_NAMES),
        'verb': rng.choice(W.ZH_VERBS),
        'verb2': rng.choice(W.ZH_VERBS),
        'noun': rng.choice(W.ZH_NOUNS),
        'noun2': rng.choice(W.ZH_NOUNS),
        'adj': rng.choice(W.ZH_ADJECTIVES),
        'adj2': rng.choice(W.ZH_ADJECTIVES),
        'when': rng.choice(W.ZH_TIMES),
        'place': rng.choice(W.ZH_PLACES),
        'n': rng.randint(2, 20),
        'm': rng.randint(2, 20),
    }
    return rng.choice(_ZH_TEMPLATES).format(**fields)


def code_snippet(rng: random.Random) -> str:
    """A short Python function or JSON object, for indentation, brackets and identifiers."""
    verb, noun, n = rng.choice(W.VERBS), rng.choice(W.NOUNS), rng.randint(1, 9)
    if rng.random() < 0.5:
        return json.dumps({'name': rng.choice(W.NAMES), noun: n, 'tags': [verb, rng.choice(W.ADJECTIVES)]})
    return (
        f'def {verb}_{plural(noun)}(items: list[int], scale: int = {n}) -> list[int]:\n'
        f'    """{past(verb).capitalize()} each {noun}."""\n'
        f'    result = []\n'
        f'    for item in items:\n'
        f'        if item > {n}:\n'
        f'            result.append(item * scale)\n'
        f'    return result\n'
    )


def paragraph(rng: random.Random) -> str:
    """A Markdown-ish paragraph mixing the sentence kinds, with the odd emoji."""
    if rng.random() < 0.3:
        body = ''.join(chinese_sentence(rng) for _ in range(rng.randint(2, 6)))
    else:
        body = ' '.join(english_sentence(rng) for _ in range(rng.randint(2, 6)))
    if rng.random() < 0.1:
        body += ' ' + rng.choice(W.EMOJI)
    style = rng.random()
    if style < 0.1:
        return f'# {rng.choice(W.TOPICS).capitalize()}\n\n{body}'
    if style < 0.2:
        return f'- {body}\n- **{rng.choice(W.ADJECTIVES)}** {rng.choice(W.NOUNS)}'
    if style < 0.25:
        return f'```python\n{code_snippet(rng)}```'
    return body


def generated_text(seed: int, n_paragraphs: int) -> Iterator[str]:
    """``n_paragraphs`` paragraphs from one seeded stream."""
    rng = random.Random(seed)
    for _ in range(n_paragraphs):
        yield paragraph(rng)
