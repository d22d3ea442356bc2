"""twinkle.dataset: loading local files and in-memory rows, slicing, mapping, encoding, mixing.

Hub ids (an hf cache layout) are covered in tests/utils/test_hub.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets as hf
import pytest

from twinkle import assets
from twinkle.data_format import IGNORE_INDEX
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import ConfigurationError, DataError, StateError
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.template import Template

hf.disable_progress_bars()

ROWS = [{'a': 1, 'b': 'x'}, {'a': 2, 'b': 'y'}, {'a': 3, 'b': 'z'}]


def write(path: Path, rows: list[dict[str, Any]]) -> str:
    """Write ``rows`` in the format named by the suffix of ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == '.jsonl':
        path.write_text(''.join(json.dumps(row) + '\n' for row in rows), encoding='utf-8')
    elif path.suffix == '.json':
        path.write_text(json.dumps(rows), encoding='utf-8')
    elif path.suffix == '.csv':
        keys = list(rows[0])
        lines = [','.join(keys)] + [','.join(str(row[k]) for k in keys) for row in rows]
        path.write_text('\n'.join(lines) + '\n', encoding='utf-8')
    elif path.suffix == '.parquet':
        hf.Dataset.from_list(rows).to_parquet(str(path))
    else:
        raise AssertionError(path)
    return str(path)


def rows_of(dataset: Dataset) -> list[dict[str, Any]]:
    return list(dataset)


# ---------------------------------------------------------------------------------------------
# Loading


@pytest.mark.parametrize('suffix', ['.json', '.jsonl', '.csv', '.parquet'])
def test_loads_table_files(tmp_path: Path, suffix: str) -> None:
    path = write(tmp_path / f'data{suffix}', ROWS)
    dataset = Dataset(DatasetMeta(path))
    assert len(dataset) == 3
    assert rows_of(dataset) == ROWS


def test_loads_text_files_one_row_per_line(tmp_path: Path) -> None:
    path = tmp_path / 'lines.txt'
    path.write_text('first line\nsecond line\nthird\n', encoding='utf-8')
    assert rows_of(Dataset(DatasetMeta(str(path)))) == [
        {'text': 'first line'},
        {'text': 'second line'},
        {'text': 'third'},
    ]


def test_csv_keeps_empty_and_na_strings(tmp_path: Path) -> None:
    # pandas would turn '' and 'NA' into NaN/None by default; text data wants them as written.
    path = tmp_path / 'data.csv'
    path.write_text('q,r\nhello,NA\nworld,\n', encoding='utf-8')
    assert rows_of(Dataset(DatasetMeta(str(path)))) == [{'q': 'hello', 'r': 'NA'}, {'q': 'world', 'r': ''}]


def test_loads_a_directory_of_files_in_name_order(tmp_path: Path) -> None:
    write(tmp_path / 'data' / 'part-1.jsonl', ROWS[1:])
    write(tmp_path / 'data' / 'part-0.jsonl', ROWS[:1])
    (tmp_path / 'data' / '.hidden.jsonl').write_text('{"a": 99, "b": "hidden"}\n')
    (tmp_path / 'data' / 'README.md').write_text('not data')
    assert rows_of(Dataset(DatasetMeta(str(tmp_path / 'data')))) == ROWS


def test_directory_split_and_subset_pick_files(tmp_path: Path) -> None:
    root = tmp_path / 'ds'
    write(root / 'train.jsonl', ROWS[:2])
    write(root / 'test.jsonl', ROWS[2:])
    write(root / 'extra' / 'train.jsonl', [{'a': 7, 'b': 'q'}])
    assert rows_of(Dataset(DatasetMeta(str(root), split='test'))) == ROWS[2:]
    assert rows_of(Dataset(DatasetMeta(str(root), subset_name='extra'))) == [{'a': 7, 'b': 'q'}]
    # The default subset reads the whole folder; split 'train' matches both train files.
    assert rows_of(Dataset(DatasetMeta(str(root)))) == [{'a': 7, 'b': 'q'}, *ROWS[:2]]


@pytest.mark.parametrize(
    ('files', 'error', 'message'),
    [
        ({'a.jsonl': ROWS, 'b.csv': ROWS}, ConfigurationError, 'one type per dataset'),
        ({}, DataError, 'no data files'),
    ],
)
def test_bad_directories(tmp_path: Path, files: dict[str, Any], error: type, message: str) -> None:
    root = tmp_path / 'ds'
    root.mkdir()
    for name, rows in files.items():
        write(root / name, rows)
    with pytest.raises(error, match=message):
        Dataset(DatasetMeta(str(root)))


def test_unsupported_file_type(tmp_path: Path) -> None:
    path = tmp_path / 'data.xml'
    path.write_text('<rows/>')
    with pytest.raises(ConfigurationError, match=r"supported file types are \['.arrow', '.csv'"):
        Dataset(DatasetMeta(str(path)))


@pytest.mark.parametrize(
    'data',
    [
        ROWS,
        {'a': [1, 2, 3], 'b': ['x', 'y', 'z']},
        hf.Dataset.from_list(ROWS),
    ],
    ids=['list-of-dicts', 'dict-of-lists', 'datasets.Dataset'],
)
def test_in_memory_rows(data: Any) -> None:
    dataset = Dataset(DatasetMeta(data=data))
    assert rows_of(dataset) == ROWS
    assert dataset[1] == ROWS[1]
    assert repr(dataset) == "Dataset(3 rows, columns=['a', 'b'])"


@pytest.mark.parametrize(
    ('kwargs', 'error'),
    [
        ({}, ConfigurationError),  # neither an id nor rows
        ({'data': [1, 2, 3]}, ConfigurationError),  # rows must be dicts
        ({'data': ROWS, 'data_slice': 5}, ConfigurationError),  # a slice is an iterable of indices
    ],
)
def test_bad_meta(kwargs: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        Dataset(DatasetMeta(**kwargs))


@pytest.mark.parametrize('data', [[], {'a': []}])
def test_an_empty_dataset_is_refused(data: Any) -> None:
    with pytest.raises(DataError, match='has no rows'):
        Dataset(DatasetMeta(data=data))


@pytest.mark.parametrize('content', ['', '\n\n'])
def test_an_empty_file_is_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / 'empty.jsonl'
    path.write_text(content)
    with pytest.raises(DataError, match='has no rows'):
        Dataset(DatasetMeta(str(path)))


def test_data_slice_wraps_around() -> None:
    dataset = Dataset(DatasetMeta(data=ROWS, data_slice=range(10)))
    # Index k picks row k % 3.
    assert [row['a'] for row in dataset] == [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
    picked = Dataset(DatasetMeta(data=ROWS, data_slice=[2, 0, -1]))
    assert [row['a'] for row in picked] == [3, 1, 3]  # -1 % 3 == 2


def test_an_empty_data_slice_is_refused() -> None:
    with pytest.raises(DataError, match='selects no rows'):
        Dataset(DatasetMeta(data=ROWS, data_slice=range(0)))


# ---------------------------------------------------------------------------------------------
# filter, map, encode


def test_filter_keeps_matching_rows() -> None:
    dataset = Dataset(DatasetMeta(data=ROWS)).filter(lambda row: row['a'] != 2)
    assert rows_of(dataset) == [ROWS[0], ROWS[2]]


@pytest.fixture(scope='module')
def cognition_rows(self_cognition_path: str) -> list[dict[str, Any]]:
    with open(self_cognition_path, encoding='utf-8') as f:
        raw = [json.loads(line) for line in f][:40]
    return SelfCognitionProcessor('twinkle', 'ModelScope')(raw)


@pytest.fixture(scope='module')
def template(tiny_model_dir: str) -> Template:
    return Template(tiny_model_dir, max_length=None)


def test_encode_matches_the_template_and_keeps_the_other_fields(
    cognition_rows: list[dict[str, Any]], template: Template, tiny_model_dir: str
) -> None:
    rows = [{**row, 'user_data': {'i': i}} for i, row in enumerate(cognition_rows[:5])]
    dataset = Dataset(DatasetMeta(data=rows)).set_template('Template', model_id=tiny_model_dir, max_length=None)
    dataset.encode()
    for row, encoded in zip(rows, dataset, strict=True):
        assert encoded == {**row, **template.encode(row)}
    assert encoded['labels'][-1] == IGNORE_INDEX


def test_encode_batched_or_not_gives_the_same_rows_and_drops_long_ones(
    cognition_rows: list[dict[str, Any]], template: Template, tiny_model_dir: str
) -> None:
    lengths = [template.encode(row)['length'] for row in cognition_rows]
    limit = sorted(lengths)[len(lengths) // 2]  # the median: about half the rows are longer
    kept = [n for n in lengths if n <= limit]
    assert 0 < len(kept) < len(lengths)
    results = []
    for batched in (True, False):
        dataset = Dataset(DatasetMeta(data=cognition_rows))
        dataset.set_template('Template', model_id=tiny_model_dir, max_length=limit, truncation_strategy='delete')
        dataset.encode(batched=batched)
        assert [row['length'] for row in dataset] == kept
        results.append(rows_of(dataset))
    assert results[0] == results[1]


def test_encode_with_generation_prompt(cognition_rows: list[dict[str, Any]], tiny_model_dir: str) -> None:
    prompts = [{'messages': row['messages'][:2]} for row in cognition_rows[:3]]
    dataset = Dataset(DatasetMeta(data=prompts)).set_template('Template', model_id=tiny_model_dir)
    dataset.encode(add_generation_prompt=True)
    for row in dataset:
        assert set(row['labels']) == {IGNORE_INDEX}
        assert dataset.template.decode(row['input_ids']).endswith('<|im_start|>assistant\n')


def test_encode_needs_a_template() -> None:
    with pytest.raises(StateError, match='set_template'):
        Dataset(DatasetMeta(data=ROWS)).encode()


def test_encode_that_drops_every_row_raises(cognition_rows: list[dict[str, Any]], tiny_model_dir: str) -> None:
    dataset = Dataset(DatasetMeta(data=cognition_rows[:3]))
    dataset.set_template('Template', model_id=tiny_model_dir, max_length=4, truncation_strategy='delete')
    with pytest.raises(DataError, match='dropped'):
        dataset.encode()


def test_encode_reports_unencodable_rows(tiny_model_dir: str) -> None:
    dataset = Dataset(DatasetMeta(data=ROWS)).set_template('Template', model_id=tiny_model_dir)
    with pytest.raises(DataError, match="needs 'messages' or 'text'"):
        dataset.encode()


def test_encode_text_rows(tmp_path: Path, tiny_model_dir: str) -> None:
    path = tmp_path / 'corpus.txt'
    path.write_text('one line\nanother line\n')
    dataset = Dataset(DatasetMeta(str(path))).set_template('Template', model_id=tiny_model_dir).encode()
    assert [dataset.template.decode(row['input_ids']) for row in dataset] == [
        'one line<|im_end|>',
        'another line<|im_end|>',
    ]


# ---------------------------------------------------------------------------------------------
# Several datasets


A = [{'src': 'a', 'i': i} for i in range(3)]
B = [{'src': 'b', 'i': i} for i in range(3)]


def test_mix_concatenates() -> None:
    dataset = Dataset(DatasetMeta(data=A))
    dataset.add_dataset(DatasetMeta(data=B)).mix_dataset(interleave=False)
    assert rows_of(dataset) == A + B


def test_mix_interleaves() -> None:
    dataset = Dataset(DatasetMeta(data=A))
    dataset.add_dataset(DatasetMeta(data=B)).mix_dataset(interleave=True)
    assert [(row['src'], row['i']) for row in dataset] == [(s, i) for i in range(3) for s in 'ab']


def test_transforms_need_a_target_when_several_datasets_are_added() -> None:
    meta_a, meta_b = DatasetMeta(data=A), DatasetMeta(data=B)
    dataset = Dataset(meta_a).add_dataset(meta_b)
    with pytest.raises(ConfigurationError, match='2 datasets were added'):
        dataset.map(lambda row: {'x': row['i']})
    with pytest.raises(ConfigurationError, match='2 datasets were added'):
        dataset.filter(lambda row: True)
    # With dataset_meta the transform reaches only that dataset.
    dataset.map(lambda row: {**row, 'i': row['i'] * 10}, dataset_meta=meta_b)
    dataset.mix_dataset(interleave=False)
    assert [row['i'] for row in dataset] == [0, 1, 2, 0, 10, 20]
    # After mixing, transforms apply to the mix, and a single dataset can no longer be picked.
    dataset.filter(lambda row: row['i'] > 0)
    assert [row['i'] for row in dataset] == [1, 2, 10, 20]
    with pytest.raises(StateError, match='already mixed'):
        dataset.map(lambda row: row, dataset_meta=meta_a)


def test_adding_the_same_dataset_twice_or_picking_an_unknown_one(tmp_path: Path) -> None:
    path = write(tmp_path / 'a.jsonl', ROWS)
    dataset = Dataset(DatasetMeta(path))
    with pytest.raises(ConfigurationError, match='already added'):
        dataset.add_dataset(DatasetMeta(path))
    with pytest.raises(ConfigurationError, match='was not added'):
        dataset.map(lambda row: row, dataset_meta=DatasetMeta(path, split='test'))


def test_lazy_encoding_stores_nothing_and_gives_the_rows_eager_encoding_gives():
    def dataset() -> Dataset:
        data = Dataset(DatasetMeta(assets.dataset('self-cognition'), data_slice=range(12)))
        data.set_template('Template', model_id=assets.tiny_model(), max_length=128)
        return data.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community'))

    eager, lazy = dataset().encode(), dataset().encode(lazy=True)
    assert 'input_ids' in eager.dataset.column_names and 'input_ids' not in lazy.dataset.column_names
    assert [lazy[i]['input_ids'] for i in range(12)] == [eager[i]['input_ids'] for i in range(12)]
    batches = list(DataLoader(lazy, batch_size=5))
    assert [row['labels'] for batch in batches for row in batch] == [eager[i]['labels'] for i in range(12)]
    with pytest.raises(StateError, match='encode\\(lazy=True\\) comes last'):
        lazy.map(lambda row: row)


def test_lazily_encoded_datasets_are_mixed_before_not_after():
    first = DatasetMeta(data=[{'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'a'}]}])
    second = DatasetMeta(
        data=[{'messages': [{'role': 'user', 'content': 'yo'}, {'role': 'assistant', 'content': 'b'}]}]
    )
    data = Dataset(first).add_dataset(second)
    data.set_template('Template', model_id=assets.tiny_model(), max_length=64)
    data.encode(lazy=True, dataset_meta=first)
    with pytest.raises(StateError, match='mix_dataset\\(\\) first, then encode\\(lazy=True\\) the mix'):
        data.mix_dataset()
