"""Registered data filters: by length in tokens, exact and near-duplicate text, a rule on a field.

A filter is called with one row and returns whether to keep it (``Dataset.filter``,
``IterableDataset.filter``). Each counts what it saw and dropped, by reason; ``report()`` says
so. The duplicate filters remember what they have kept, so run them in one process (the
``Dataset``'s default ``num_proc=None``) and, on a stream, before it is sharded.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from twinkle.errors import ConfigurationError, DataError
from twinkle.preprocessor.base import FILTERS, DataFilter


class CountingFilter(DataFilter):
    """A filter that counts the rows it saw and those it dropped, by reason."""

    #: Whether the filter remembers rows it kept (a row's fate depends on the rows before it).
    remembers = False

    def __init__(self) -> None:
        self.seen = 0
        self.dropped: Counter[str] = Counter()

    def reset(self) -> None:
        """Forget the rows seen (a new pass over the data)."""
        self.seen = 0
        self.dropped.clear()

    def __call__(self, row: Mapping[str, Any]) -> bool:
        self.seen += 1
        reason = self.reject(row)
        if reason is not None:
            self.dropped[reason] += 1
        return reason is None

    def reject(self, row: Mapping[str, Any]) -> str | None:
        """Why ``row`` is dropped, or None to keep it."""
        raise NotImplementedError

    def report(self) -> dict[str, Any]:
        """Rows seen, kept and dropped (with the reasons)."""
        total = sum(self.dropped.values())
        return {
            'filter': type(self).__name__,
            'seen': self.seen,
            'kept': self.seen - total,
            'dropped': dict(self.dropped),
        }


def field_text(row: Mapping[str, Any], field: str) -> str:
    """The text of ``row[field]``: a string as it is, a conversation's contents joined, else JSON."""
    if field not in row:
        raise DataError(f'the row has no field {field!r}; it has {sorted(row)}')
    return _text(row[field])


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, Mapping) and 'content' in m for m in value):
        return '\n'.join(str(m['content']) for m in value)
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


@FILTERS.register
class LengthFilter(CountingFilter):
    """Keep encoded rows of ``min_tokens`` to ``max_tokens`` tokens (``input_ids``)."""

    def __init__(self, min_tokens: int = 0, max_tokens: int | None = None):
        super().__init__()
        if max_tokens is not None and max_tokens < min_tokens:
            raise ConfigurationError(f'max_tokens={max_tokens} is below min_tokens={min_tokens}')
        self.min_tokens, self.max_tokens = min_tokens, max_tokens

    def reject(self, row: Mapping[str, Any]) -> str | None:
        if 'input_ids' not in row:
            raise DataError('LengthFilter counts tokens of encoded rows: filter after encode()')
        length = len(row['input_ids'])
        if length < self.min_tokens:
            return f'fewer than {self.min_tokens} tokens'
        if self.max_tokens is not None and length > self.max_tokens:
            return f'more than {self.max_tokens} tokens'
        return None


@FILTERS.register
class ExactDedupFilter(CountingFilter):
    """Keep the first row of each exact text of ``field`` (runs of whitespace count as one space)."""

    remembers = True

    def __init__(self, field: str = 'messages'):
        super().__init__()
        self.field = field
        self._hashes: set[bytes] = set()

    def reset(self) -> None:
        super().reset()
        self._hashes.clear()

    def reject(self, row: Mapping[str, Any]) -> str | None:
        normalised = ' '.join(field_text(row, self.field).split())
        digest = hashlib.blake2b(normalised.encode(), digest_size=16).digest()
        if digest in self._hashes:
            return 'exact duplicate'
        self._hashes.add(digest)
        return None


@FILTERS.register
class NearDedupFilter(CountingFilter):
    """Keep a row unless an earlier kept row's text of ``field`` is a near duplicate: estimated
    Jaccard similarity of their word ``ngram`` shingles at least ``threshold`` (MinHash with
    ``num_perm`` permutations and LSH, by ``datasketch``; Broder 1997)."""

    def __init__(self, field: str = 'messages', threshold: float = 0.8, num_perm: int = 128, ngram: int = 3):
        super().__init__()
        from datasketch import MinHashLSH

        if not 0 < threshold <= 1:
            raise ConfigurationError(f'threshold must be in (0, 1]; got {threshold!r}')
        self.field, self.threshold, self.num_perm, self.ngram = field, threshold, num_perm, ngram
        self._index = MinHashLSH(threshold=threshold, num_perm=num_perm)
        self._kept: dict[str, Any] = {}  # key -> MinHash of the rows kept

    remembers = True

    def reset(self) -> None:
        from datasketch import MinHashLSH

        super().reset()
        self._index = MinHashLSH(threshold=self.threshold, num_perm=self.num_perm)
        self._kept.clear()

    def reject(self, row: Mapping[str, Any]) -> str | None:
        from datasketch import MinHash

        words = re.findall(r'\w+', field_text(row, self.field).lower())
        shingles = {' '.join(words[i : i + self.ngram]) for i in range(max(1, len(words) - self.ngram + 1))}
        signature = MinHash(num_perm=self.num_perm)
        signature.update_batch([s.encode() for s in shingles])
        # LSH finds candidates; their estimated similarity decides (LSH alone lets some below the threshold in).
        if any(signature.jaccard(self._kept[key]) >= self.threshold for key in self._index.query(signature)):
            return 'near duplicate'
        key = str(self.seen)
        self._index.insert(key, signature)
        self._kept[key] = signature
        return None


@FILTERS.register
class RuleFilter(CountingFilter):
    """Keep rows whose ``field`` passes ``rule``: a function of the value, or a regular
    expression the field's text must contain (``re.search``)."""

    def __init__(self, field: str, rule: Callable[[Any], bool] | str, reason: str | None = None):
        super().__init__()
        if isinstance(rule, str):
            pattern = re.compile(rule)
            self.rule: Callable[[Any], bool] = lambda value: pattern.search(_text(value)) is not None
        elif callable(rule):
            self.rule = rule
        else:
            raise ConfigurationError(f'rule must be a function of the field or a regular expression; got {rule!r}')
        self.field = field
        self.reason = reason or f'{field} fails the rule'

    def reject(self, row: Mapping[str, Any]) -> str | None:
        if self.field not in row:
            raise DataError(f'the row has no field {self.field!r}; it has {sorted(row)}')
        return None if self.rule(row[self.field]) else self.reason
