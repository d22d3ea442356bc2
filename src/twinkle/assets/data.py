"""Embedded datasets, written as JSONL files into the cache on first use.

Each dataset is a table entry: a recipe version and a function returning all its splits as
rows. ``dataset(name, split)`` builds every split of ``name`` at once (they are cheap and some
are drawn from one stream) and returns the path of one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle.assets import gsm8k, images, self_cognition
from twinkle.assets.cache import build_asset
from twinkle.errors import UnknownNameError, one_of

Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class DatasetRecipe:
    """How to make one embedded dataset."""

    # Bump when the rows change, so cached copies are rebuilt.
    version: int
    # Returns every split by name, rows in file order.
    make_splits: Callable[[], dict[str, Rows]]
    # The split names, known without building.
    splits: tuple[str, ...]
    # Writes the files the rows name (images) into the dataset's folder, beside the JSONL files.
    write_files: Callable[[Path], None] | None = None


DATASET_RECIPES: dict[str, DatasetRecipe] = {
    'self-cognition': DatasetRecipe(2, lambda: {'train': self_cognition.rows()}, ('train',)),
    'gsm8k': DatasetRecipe(2, gsm8k.splits, tuple(gsm8k.SPLIT_SIZES)),
    'shapes': DatasetRecipe(1, images.splits, tuple(images.SPLIT_SIZES), images.write_images),
}
DATASETS: tuple[str, ...] = tuple(DATASET_RECIPES)


def write_jsonl(path: Path, rows: Rows) -> None:
    """One JSON object per line, keys in row order, UTF-8 without escapes, ``\\n`` endings."""
    with path.open('w', encoding='utf-8', newline='\n') as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + '\n')


def _write_splits(recipe: DatasetRecipe, folder: Path) -> None:
    for split, rows in recipe.make_splits().items():
        write_jsonl(folder / f'{split}.jsonl', rows)
    if recipe.write_files is not None:
        recipe.write_files(folder)


def _recipe(name: str) -> DatasetRecipe:
    if name not in DATASET_RECIPES:
        raise UnknownNameError('dataset', name, DATASETS)
    return DATASET_RECIPES[name]


def dataset_splits(name: str) -> tuple[str, ...]:
    """The split names of embedded dataset ``name``, without building it.

    >>> dataset_splits('gsm8k')
    ('train', 'test')
    """
    return _recipe(name).splits


def dataset(name: str, split: str = 'train') -> str:
    """Path of the JSONL file of split ``split`` of embedded dataset ``name``.

    Unknown names raise ``UnknownNameError`` and unknown splits ``ConfigurationError``, each
    listing the valid values.

    >>> from pathlib import Path
    >>> from twinkle.assets import dataset
    >>> Path(dataset('gsm8k', 'test')).name
    'test.jsonl'
    """
    recipe = _recipe(name)
    if split not in recipe.splits:
        raise one_of(f'split of dataset {name!r}', split, recipe.splits)
    folder = build_asset('datasets', f'{name}-v{recipe.version}', lambda tmp: _write_splits(recipe, tmp))
    return str(folder / f'{split}.jsonl')
