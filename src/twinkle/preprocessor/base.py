"""Preprocessors turn raw rows into trajectories; filters keep or drop rows.

A preprocessor implements ``preprocess(row) -> Trajectory | None`` (``None`` drops the row);
calling it on a list of rows maps them all. ``Dataset.map`` runs it batched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from twinkle.data_format import Trajectory
from twinkle.errors import DataError
from twinkle.registry import Registry


class Preprocessor:
    #: Fields every input row must have; checked before ``preprocess`` runs.
    required_fields: tuple[str, ...] = ()

    def preprocess(self, row: Mapping[str, Any]) -> Trajectory | None:
        raise NotImplementedError

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> list[Trajectory]:
        results = []
        for row in rows:
            self.check_row(row)
            result = self.preprocess(row)
            if result is not None:
                results.append(result)
        return results

    def check_row(self, row: Mapping[str, Any]) -> None:
        missing = [name for name in self.required_fields if row.get(name) is None]
        if missing:
            shown = {k: (v[:60] + '...' if isinstance(v, str) and len(v) > 60 else v) for k, v in row.items()}
            raise DataError(
                f'{type(self).__name__} needs fields {list(self.required_fields)}; the row {shown} lacks {missing}'
            )


class DataFilter:
    """``__call__(row) -> bool``: True keeps the row."""

    def __call__(self, row: Mapping[str, Any]) -> bool:
        raise NotImplementedError


PREPROCESSORS: Registry[Preprocessor] = Registry('preprocessor')
FILTERS: Registry[DataFilter] = Registry('filter')
