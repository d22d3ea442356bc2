"""Datasets: rows loaded from a hub id, a local file or memory, then mapped, filtered and
encoded in place. Rows live in a Hugging Face ``datasets.Dataset`` (Arrow on disk), so a
dataset larger than memory works and ``map`` can run in several processes."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import datasets as hf

from twinkle.errors import ConfigurationError, DataError, StateError
from twinkle.hub import resolve_dataset
from twinkle.preprocessor import FILTERS, PREPROCESSORS, DataFilter, Preprocessor
from twinkle.registry import Registry
from twinkle.template import TEMPLATES, Template

T = TypeVar('T')
#: A function of one row: a mapping of the new row's fields, or ``None`` to drop the row (checked
#: by ``_call_row``, as a user's function may return anything).
RowFn: TypeAlias = Callable[[Mapping[str, Any]], object]
#: A preprocessor as ``map`` takes it: a registered name, a ``Preprocessor`` class (built with
#: ``init_args``) or instance, or a function of one row.
PreprocessorSpec: TypeAlias = str | type[Preprocessor] | Preprocessor | RowFn
#: A filter as ``filter`` takes it: likewise, a ``DataFilter`` or a function of one row.
Predicate: TypeAlias = Callable[[Mapping[str, Any]], bool]
FilterSpec: TypeAlias = str | type[DataFilter] | DataFilter | Predicate
#: A batch of rows as ``datasets`` hands it over: each field's values, row by row.
Columns: TypeAlias = dict[str, list[Any]]

#: File extension to the ``datasets`` builder that reads it.
BUILDERS = {
    '.json': 'json',
    '.jsonl': 'json',
    '.csv': 'csv',
    '.parquet': 'parquet',
    '.txt': 'text',
    '.arrow': 'arrow',
}


@dataclass
class DatasetMeta:
    """Where a dataset comes from.

    ``dataset_id`` is ``ms://org/name``, ``hf://org/name``, a local file (json, jsonl, csv,
    parquet, txt) or a directory of such files; ``data`` gives the rows in memory instead (a
    list of dicts, a dict of lists, or a ``datasets.Dataset``). ``data_slice`` picks row indices;
    they wrap around, so ``range(1000)`` over 100 rows repeats each row ten times.
    """

    dataset_id: str = ''
    subset_name: str = 'default'
    split: str = 'train'
    data_slice: Iterable[int] | None = None
    data: Any = None

    def __post_init__(self) -> None:
        if not self.dataset_id and self.data is None:
            raise ConfigurationError('DatasetMeta needs a dataset_id or in-memory data')
        if self.data_slice is not None and not isinstance(self.data_slice, Iterable):
            raise ConfigurationError(f'data_slice must be an iterable of row indices; got {self.data_slice!r}')

    def get_id(self) -> str:
        name = self.dataset_id or f'memory-{id(self.data):x}'
        return f'{name.replace(os.sep, "_").replace(".", "_")}:{self.subset_name}:{self.split}'


class Dataset:
    """Rows for training. ``map``, ``filter`` and ``encode`` change it in place and return it.

    Example::

        dataset = Dataset(DatasetMeta(assets.dataset('self-cognition'), data_slice=range(200)))
        dataset.set_template('Template', model_id=assets.tiny_model(), max_length=256)
        dataset.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community'))
        dataset.encode()
        dataset[0]['input_ids']
    """

    def __init__(self, dataset_meta: DatasetMeta, *, revision: str | None = None, num_proc: int | None = None):
        self.num_proc = num_proc
        self.revision = revision
        self.datasets: dict[str, hf.Dataset] = {}
        self.template: Template | None = None
        self._mixed: hf.Dataset | None = None
        self.add_dataset(dataset_meta)

    # ---- loading ------------------------------------------------------------------------------
    def add_dataset(self, dataset_meta: DatasetMeta) -> Dataset:
        """Load another dataset beside the first; ``mix_dataset`` merges them."""
        key = dataset_meta.get_id()
        if key in self.datasets:
            raise ConfigurationError(f'dataset {key!r} was already added')
        self.datasets[key] = load_rows(dataset_meta, revision=self.revision)
        self._mixed = None
        return self

    def mix_dataset(
        self, interleave: bool = True, probabilities: Sequence[float] | None = None, seed: int | None = None
    ) -> Dataset:
        """Merge the added datasets: interleaved (round robin, or sampled with
        ``probabilities``) or concatenated. Interleaving stops when the first dataset runs out
        (as ``datasets.interleave_datasets`` does by default), so rows of longer datasets past
        that point are left out. Later ``map``/``encode`` calls apply to the mix."""
        parts = list(self.datasets.values())
        if any(part.format.get('type') == 'custom' for part in parts):
            raise StateError('a dataset was encoded lazily: mix_dataset() first, then encode(lazy=True) the mix')
        if len(parts) == 1:
            self._mixed = parts[0]
        elif interleave:
            self._mixed = hf.interleave_datasets(parts, probabilities=probabilities, seed=seed)
        else:
            self._mixed = hf.concatenate_datasets(parts)
        return self

    @property
    def dataset(self) -> hf.Dataset:
        """The mixed dataset after ``mix_dataset``, else the first one added."""
        return self._mixed if self._mixed is not None else next(iter(self.datasets.values()))

    # ---- transforms -----------------------------------------------------------------------------
    def set_template(self, template: str | type[Template] | Template, **kwargs: Any) -> Dataset:
        self.template = TEMPLATES.build(template, Template, **kwargs)
        return self

    def map(
        self,
        preprocessor: PreprocessorSpec,
        dataset_meta: DatasetMeta | None = None,
        init_args: Mapping[str, Any] | None = None,
        load_from_cache_file: bool = False,
        batch_size: int = 1000,
    ) -> Dataset:
        """Apply a preprocessor (an instance, a class or a registered name built with
        ``init_args``, or a plain function of one row) to every row. A ``None`` result drops the
        row; the result's fields replace the row's."""
        fn = as_row_fn(preprocessor, init_args)
        self._transform(dataset_meta, fn, False, load_from_cache_file, batch_size)
        return self

    def filter(
        self, predicate: FilterSpec, dataset_meta: DatasetMeta | None = None, init_args: Mapping[str, Any] | None = None
    ) -> Dataset:
        """Keep the rows for which ``predicate(row)`` is true (a ``DataFilter``, a registered
        filter's name or class built with ``init_args``, or a function of one row)."""
        keep = as_predicate(predicate, init_args)
        key = self._target(dataset_meta)
        self._store(key, self._writable(key).filter(keep, num_proc=self.num_proc, load_from_cache_file=False))
        return self

    def encode(
        self,
        add_generation_prompt: bool = False,
        batched: bool = True,
        load_from_cache_file: bool = False,
        dataset_meta: DatasetMeta | None = None,
        lazy: bool = False,
    ) -> Dataset:
        """Tokenize every row with the template (``set_template`` first). The rows keep their
        other fields (``messages``, ``user_data``); rows the template drops
        (``truncation_strategy='delete'``) leave the dataset.

        ``lazy=True`` stores nothing: each row is encoded when it is read (``datasets``'
        ``with_transform``), for data whose encoded form does not fit on disk or in memory. It
        comes last (no ``map`` or ``filter`` after it), and a lazy row cannot be dropped, so the
        template must not use ``truncation_strategy='delete'``."""
        if self.template is None:
            raise StateError('Dataset.encode() needs a template: call dataset.set_template(...) first')
        fn = partial(self.template.encode, add_generation_prompt=add_generation_prompt)
        if lazy:
            if self.template.truncation_strategy == 'delete':
                raise ConfigurationError(
                    "encode(lazy=True) cannot drop rows: use truncation_strategy 'raise', 'left' or 'right', "
                    "or encode eagerly for 'delete'"
                )
            key = self._target(dataset_meta)
            self._store(key, self._get(key).with_transform(partial(_encode_on_access, fn)))
            return self
        self._transform(dataset_meta, fn, True, load_from_cache_file, 1000 if batched else 1)
        return self

    # ---- plumbing -----------------------------------------------------------------------------
    def _target(self, dataset_meta: DatasetMeta | None) -> str | None:
        """The key of the dataset a transform applies to; ``None`` means the mix."""
        if dataset_meta is not None:
            key = dataset_meta.get_id()
            if key not in self.datasets:
                raise ConfigurationError(f'dataset {key!r} was not added; added: {sorted(self.datasets)}')
            if self._mixed is not None:
                raise StateError('the datasets were already mixed: transform them before mix_dataset()')
            return key
        if self._mixed is not None:
            return None
        if len(self.datasets) > 1:
            raise ConfigurationError(
                f'{len(self.datasets)} datasets were added: pass dataset_meta= to pick one, or call mix_dataset() first'
            )
        return next(iter(self.datasets))

    def _get(self, key: str | None) -> hf.Dataset:
        return self._mixed if key is None else self.datasets[key]

    def _writable(self, key: str | None) -> hf.Dataset:
        """The target dataset of a ``map`` or ``filter``: not one encoded lazily."""
        data = self._get(key)
        if data.format.get('type') == 'custom':
            raise StateError('encode(lazy=True) comes last: map and filter the rows before it')
        return data

    def _store(self, key: str | None, data: hf.Dataset) -> None:
        if key is None:
            self._mixed = data
        else:
            self.datasets[key] = data

    def _transform(
        self, dataset_meta: DatasetMeta | None, fn: RowFn, merge: bool, from_cache: bool, batch_size: int
    ) -> None:
        """Run the row function ``fn`` over the target dataset, in batches (``merge``: keep the
        input fields beside the output).

        The output columns are found first from the first row ``fn`` keeps, so that a batch whose
        rows are all dropped still hands Arrow the same columns (empty) as the others."""
        key = self._target(dataset_meta)
        data = self._writable(key)
        columns = _output_columns(fn, data, merge)
        if columns is None:
            raise DataError(f'every one of the {len(data)} rows was dropped, leaving an empty dataset')
        mapped = data.map(
            partial(_map_batch, fn, merge=merge, columns=columns),
            batched=True,
            batch_size=batch_size,
            remove_columns=data.column_names,
            load_from_cache_file=from_cache,
            num_proc=self.num_proc,
        )
        self._store(key, mapped)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row: dict[str, Any] = self.dataset[index]  # datasets ships no types
        return row

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.dataset)

    def __repr__(self) -> str:
        return f'Dataset({len(self)} rows, columns={self.dataset.column_names})'


# ---- helpers ------------------------------------------------------------------------------------
def as_row_fn(preprocessor: PreprocessorSpec, init_args: Mapping[str, Any] | None) -> RowFn:
    """The function ``map`` runs on each row; a ``Preprocessor`` checks the row first."""
    built = _built(preprocessor, PREPROCESSORS, Preprocessor, init_args)
    if isinstance(built, Preprocessor):
        instance = built

        def run(row: Mapping[str, Any]) -> object:
            instance.check_row(row)
            return instance.preprocess(row)

        return run
    if callable(built):
        return built
    raise ConfigurationError(
        f'a preprocessor must be a registered name, a Preprocessor, or a function of one row; got {preprocessor!r}. '
        f'Registered names: {PREPROCESSORS.names()}'
    )


def as_predicate(predicate: FilterSpec, init_args: Mapping[str, Any] | None) -> Predicate:
    """The function ``filter`` runs on each row: true keeps it."""
    built = _built(predicate, FILTERS, DataFilter, init_args)
    if callable(built):
        return built
    raise ConfigurationError(
        f'a filter must be a registered name, a DataFilter, or a function of one row; got {predicate!r}. '
        f'Registered names: {FILTERS.names()}'
    )


def _built(spec: object, registry: Registry[T], base: type[T], init_args: Mapping[str, Any] | None) -> object:
    """``spec`` built by ``registry`` when it is a name or a class, else as given (and then
    there is nothing to apply ``init_args`` to)."""
    if isinstance(spec, (str, type)):
        return registry.build(spec, base, **(init_args or {}))
    if init_args:
        raise ConfigurationError(
            f'init_args only apply when the {registry.kind} is given by name or class; got {spec!r} with '
            f'init_args {sorted(init_args)}'
        )
    return spec


def _map_batch(fn: RowFn, batch: Columns, merge: bool = False, columns: Sequence[str] = ()) -> Columns:
    """Run a row function over a column batch; ``merge`` keeps the input fields beside the output.
    The result has ``columns`` (plus any new field a row brings), even when every row is dropped."""
    names = list(batch)
    size = len(batch[names[0]]) if names else 0
    rows = []
    for i in range(size):
        row = {name: batch[name][i] for name in names}
        result = _call_row(fn, row)
        if result is not None:
            rows.append({**row, **result} if merge else dict(result))
    keys = list(dict.fromkeys([*columns, *(key for row in rows for key in row)]))
    return {key: [row.get(key) for row in rows] for key in keys}


def _encode_on_access(fn: RowFn, batch: Columns) -> Columns:
    """``with_transform``'s function: the rows read, each with its encoding beside its fields."""
    names = list(batch)
    rows = [{name: batch[name][i] for name in names} for i in range(len(batch[names[0]]) if names else 0)]
    encoded = []
    for row in rows:
        result = _call_row(fn, row)
        if result is None:
            raise DataError(f'the template dropped a row read lazily (fields {sorted(row)}); encode it eagerly')
        encoded.append({**row, **result})
    keys = list(dict.fromkeys(key for row in encoded for key in row))
    return {key: [row.get(key) for row in encoded] for key in keys}


def _call_row(fn: RowFn, row: Mapping[str, Any]) -> Mapping[str, Any] | None:
    result = fn(row)
    if result is not None and not isinstance(result, Mapping):
        raise DataError(f'a preprocessor returned {type(result).__name__} for row {row}; expected a dict or None')
    return result


def _output_columns(fn: RowFn, data: hf.Dataset, merge: bool) -> list[str] | None:
    """The columns mapping ``fn`` makes: those of the first row it keeps, or ``None`` when it
    drops every row."""
    for row in data:
        result = _call_row(fn, row)
        if result is not None:
            return list({**row, **result} if merge else result)
    return None


def load_rows(meta: DatasetMeta, revision: str | None = None) -> hf.Dataset:
    """Load the rows a ``DatasetMeta`` points at and apply its ``data_slice``."""
    data = _from_memory(meta.data) if meta.data is not None else _from_files(meta, revision)
    name = meta.dataset_id or '(in memory)'
    if len(data) == 0:
        raise DataError(f'dataset {name} split {meta.split!r} has no rows')
    if meta.data_slice is not None:
        data = data.select([index % len(data) for index in meta.data_slice])
        if len(data) == 0:
            raise DataError(f'data_slice {meta.data_slice!r} selects no rows of dataset {name}')
    return data


def _from_memory(data: Any) -> hf.Dataset:
    if isinstance(data, hf.Dataset):
        return data
    if isinstance(data, Mapping):
        return hf.Dataset.from_dict(dict(data))
    if isinstance(data, Sequence) and all(isinstance(row, Mapping) for row in data):
        return hf.Dataset.from_list([dict(row) for row in data])
    raise ConfigurationError(
        f'in-memory data must be a list of dicts, a dict of lists or a datasets.Dataset; got {type(data)}'
    )


def _from_files(meta: DatasetMeta, revision: str | None) -> hf.Dataset:
    path = Path(resolve_dataset(meta.dataset_id, revision=revision))
    files = [path] if path.is_file() else _data_files(path, meta)
    builders = {BUILDERS.get(_suffix(f)) for f in files}
    if None in builders or len(builders) != 1:
        raise ConfigurationError(
            f'cannot read {meta.dataset_id!r}: found {[str(f) for f in files][:5]}; '
            f'supported file types are {sorted(BUILDERS)}, one type per dataset'
        )
    if all(_is_blank(f) for f in files):
        raise DataError(f'dataset {meta.dataset_id!r} has no rows: its files are empty ({[str(f) for f in files][:5]})')
    kwargs = {'keep_default_na': False} if builders == {'csv'} else {}
    try:
        return hf.load_dataset(builders.pop(), data_files=[str(f) for f in files], split='train', **kwargs)
    except StopIteration as e:  # datasets' json builder, on files holding only whitespace
        raise DataError(f'dataset {meta.dataset_id!r} has no rows ({[str(f) for f in files][:5]})') from e


def _is_blank(path: Path) -> bool:
    """Empty, or (when small) only whitespace: no rows, which ``datasets`` reports obscurely."""
    size = path.stat().st_size
    return size == 0 or (size <= 65536 and not path.read_bytes().strip())


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def _data_files(root: Path, meta: DatasetMeta) -> list[Path]:
    """The data files of a dataset folder: those of the subset folder if there is one, and of
    the split if file names tell splits apart."""
    if meta.subset_name != 'default' and (root / meta.subset_name).is_dir():
        root = root / meta.subset_name
    files = sorted(p for p in root.rglob('*') if p.is_file() and _suffix(p) in BUILDERS and not p.name.startswith('.'))
    if not files:
        raise DataError(f'no data files ({sorted(BUILDERS)}) under {root} for dataset {meta.dataset_id!r}')
    split_files = [p for p in files if meta.split in p.relative_to(root).as_posix()]
    return split_files or files
