"""Count a word in a document read one page per turn: the long many-turn task.

In the manner of tinker-cookbook's ``rl_numerics_check``: the model cannot see the document,
only a ``read_page(page)`` tool, one call a turn; it must read every page and report how many
times a word occurs. The right answer needs every page, so an episode is ``pages + 1`` turns
(give the ``RolloutEngine`` ``max_turns`` at least that), each turn adding a tool answer: the
task exercises long multi-turn rollouts, their token bookkeeping and their tool plumbing, with a
reward that is checked exactly.

The documents are synthetic and embedded: ``pages`` pages of ``words_per_page`` words, drawn
from a few nouns of ``twinkle.assets.words`` by a ``random.Random`` seeded with the document's
id, so a document is the same in every process (a ``str`` seed does not depend on
``PYTHONHASHSEED``).

    groups = read_pages_envs(num_tasks=8, group_size=4, seed=0)
    episodes = RolloutEngine(sampler, template, SamplingParams(max_tokens=128), max_turns=10).rollout(groups)
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

from twinkle.agent.base import Env, ToolEnv, env_groups
from twinkle.agent.tools import ToolBox
from twinkle.assets.words import NOUNS
from twinkle.data_format import Message
from twinkle.errors import ConfigurationError, DataError

MIN_PAGES, MAX_PAGES = 4, 8  # the pages of a document when the caller does not say
WORDS_PER_PAGE = 40
#: Distinct words in one document: few enough that the asked word occurs a few times a page.
VOCABULARY_SIZE = 12
_VOCABULARY = sorted(set(NOUNS))  # sorted: a set's order would differ between processes
#: A number in the final answer: digits with an optional decimal part ('14' and '14.0' agree).
_NUMBER = re.compile(r'-?\d+(?:\.\d+)?')

READ_PAGES_SYSTEM = (
    'You answer a question about a document you cannot see. Read it with the read_page tool, one page '
    'per turn; the pages are numbered from 1. When you have read every page, reply without a tool call '
    'and end your reply with the answer as a number.'
)


@dataclass(frozen=True)
class Document:
    """A document's pages (whitespace-separated words) and the word the question asks about."""

    pages: tuple[str, ...]
    word: str

    @property
    def count(self) -> int:
        """How many times ``word`` occurs as a whole word: the right answer."""
        return sum(page.split().count(self.word) for page in self.pages)


def make_document(seed: int | str, pages: int | None = None, words_per_page: int = WORDS_PER_PAGE) -> Document:
    """The document of ``seed``: ``pages`` pages (``MIN_PAGES`` to ``MAX_PAGES``, drawn, when
    ``None``) of ``words_per_page`` words from ``VOCABULARY_SIZE`` nouns, one of them asked about."""
    rng = random.Random(seed)
    n_pages = rng.randint(MIN_PAGES, MAX_PAGES) if pages is None else pages
    if n_pages <= 0 or words_per_page <= 0:
        raise ConfigurationError(f'pages and words_per_page must be positive; got {n_pages} and {words_per_page}')
    vocabulary = rng.sample(_VOCABULARY, VOCABULARY_SIZE)
    text = tuple(' '.join(rng.choices(vocabulary, k=words_per_page)) for _ in range(n_pages))
    return Document(pages=text, word=rng.choice(vocabulary))


def page_reader(document: Document) -> Callable[[int], str]:
    """The ``read_page`` tool of ``document``; a page out of range raises ``DataError`` naming
    the range, which the ``ToolBox`` hands the model as the tool's answer."""

    def read_page(page: int) -> str:
        """Read one page of the document.

        Args:
            page: the page number, from 1 to the number of pages
        """
        if not 1 <= page <= len(document.pages):
            raise DataError(f'there is no page {page}; the pages are 1 to {len(document.pages)}')
        return document.pages[page - 1]

    return read_page


def reported_count(answer: str) -> Decimal | None:
    """The last number of ``answer`` (the count the model reports), or ``None`` if it has none.

    >>> reported_count('Pages 1 to 5 hold the word 14 times.'), reported_count('no idea')
    (Decimal('14'), None)
    """
    numbers = _NUMBER.findall(answer)
    return Decimal(numbers[-1]) if numbers else None


class ReadPagesEnv(ToolEnv):
    """One document and its question; 1.0 when the final answer's last number is the count, else
    0.0. No partial credit: the count is known exactly from the pages, and credit for a near
    count would reward guessing a typical total without reading.

    ``max_tool_calls=1`` keeps to one page a turn (a second call in a turn is answered with an
    error), which is what makes the episode long. ``user_data`` holds ``document_id``, ``word``,
    ``pages`` and ``ground_truth`` (the count)."""

    def __init__(self, document: Document, document_id: str = '', max_tool_calls: int = 1):
        question = (
            f'The document has {len(document.pages)} pages. '
            f'How many times does the word "{document.word}" occur in the document?'
        )
        messages: list[Message] = [
            {'role': 'system', 'content': READ_PAGES_SYSTEM},
            {'role': 'user', 'content': question},
        ]
        super().__init__(messages, ToolBox([page_reader(document)]), max_tool_calls)
        self.document = document
        self.user_data = {
            'task': 'read_pages',
            'document_id': document_id,
            'word': document.word,
            'pages': len(document.pages),
            'ground_truth': document.count,
        }

    def grade(self, answer: str) -> float:
        return 1.0 if reported_count(answer) == self.document.count else 0.0


def read_pages_envs(
    num_tasks: int = 8,
    group_size: int = 4,
    seed: int = 0,
    pages: int | None = None,
    words_per_page: int = WORDS_PER_PAGE,
) -> list[list[Env]]:
    """``num_tasks`` groups of ``group_size`` ``ReadPagesEnv``s; group ``t`` reads the document
    ``'read_pages/{seed}/{t}'`` (its id and its seed), of ``pages`` pages (drawn when ``None``)."""

    def make_env(task: int) -> Env:
        document_id = f'read_pages/{seed}/{task}'
        return ReadPagesEnv(make_document(document_id, pages, words_per_page), document_id)

    return env_groups(make_env, num_tasks, group_size)
