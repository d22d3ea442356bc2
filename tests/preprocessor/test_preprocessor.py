"""twinkle.preprocessor: raw rows to trajectories, alone and through ``Dataset.map``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from twinkle import assets
from twinkle.dataset import Dataset, DatasetMeta, IterableDataset
from twinkle.errors import ConfigurationError, DataError, UnknownNameError
from twinkle.preprocessor import (
    FILTERS,
    PREPROCESSORS,
    AlpacaProcessor,
    DataFilter,
    GSM8KProcessor,
    Preprocessor,
    SelfCognitionProcessor,
    gsm8k_final_answer,
)
from twinkle.preprocessor.llm import DEFAULT_SYSTEM, GSM8K_SYSTEM


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding='utf-8') as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------------------
# SelfCognitionProcessor


def test_self_cognition_fills_name_and_author() -> None:
    processor = SelfCognitionProcessor('twinkle LLM', 'ModelScope')
    row = {'query': 'Are you {{NAME}}?', 'response': 'Yes, {{NAME}} by {{AUTHOR}}. {{NAME}}!', 'tag': 'en'}
    assert processor.preprocess(row) == {
        'messages': [
            {'role': 'system', 'content': DEFAULT_SYSTEM},
            {'role': 'user', 'content': 'Are you twinkle LLM?'},
            {'role': 'assistant', 'content': 'Yes, twinkle LLM by ModelScope. twinkle LLM!'},
        ]
    }
    custom = SelfCognitionProcessor('n', 'a', system='Custom.')
    assert custom.preprocess(row)['messages'][0] == {'role': 'system', 'content': 'Custom.'}


def test_self_cognition_on_the_embedded_dataset_leaves_no_placeholder(self_cognition_path: str) -> None:
    raw = read_jsonl(self_cognition_path)
    out = SelfCognitionProcessor('Zed', 'Acme')(raw)
    assert len(out) == len(raw)
    for source, trajectory in zip(raw, out, strict=True):
        answer = trajectory['messages'][2]['content']
        assert '{{' not in answer and '}}' not in answer
        # Each placeholder became one occurrence of its value (neither value occurs in the raw data).
        assert answer.count('Zed') == source['response'].count('{{NAME}}')
        assert answer.count('Acme') == source['response'].count('{{AUTHOR}}')
    assert any('{{NAME}}' in row['response'] for row in raw)  # the check above is not vacuous


# ---------------------------------------------------------------------------------------------
# GSM8KProcessor


@pytest.mark.parametrize(
    ('answer', 'expected'),
    [
        ('12/3 = <<12/3=4>>4 minutes.\n#### 4', '4'),
        ('#### 1,234', '1234'),  # thousands separators go
        ('#### -7', '-7'),
        ('#### 2.5', '2.5'),
        ('#### 12.', '12'),  # a sentence-ending period goes
        ('#### 1\nthen corrected:\n####  9', '9'),  # the last marker wins
        ('no marker here 42', ''),
    ],
)
def test_gsm8k_final_answer(answer: str, expected: str) -> None:
    assert gsm8k_final_answer(answer) == expected


def test_gsm8k_processor_puts_the_ground_truth_in_user_data() -> None:
    row = {'question': 'What is 2+2?', 'answer': '2+2 = <<2+2=4>>4\n#### 4'}
    assert GSM8KProcessor().preprocess(row) == {
        'messages': [{'role': 'system', 'content': GSM8K_SYSTEM}, {'role': 'user', 'content': 'What is 2+2?'}],
        'user_data': {'ground_truth': '4'},
    }
    with_answer = GSM8KProcessor(system='S', add_assistant=True).preprocess(row)
    assert with_answer['messages'] == [
        {'role': 'system', 'content': 'S'},
        {'role': 'user', 'content': 'What is 2+2?'},
        {'role': 'assistant', 'content': '2+2 = <<2+2=4>>4\n#### 4'},
    ]


def test_gsm8k_on_the_embedded_dataset() -> None:
    raw = read_jsonl(assets.dataset('gsm8k', 'test'))
    out = GSM8KProcessor()(raw)
    # Every embedded answer ends with '#### <integer>', so the ground truth is the last line's number.
    expected = [row['answer'].rsplit('\n', 1)[-1].removeprefix('#### ') for row in raw]
    assert [t['user_data']['ground_truth'] for t in out] == expected
    assert all(truth.lstrip('-').isdigit() for truth in expected)


# ---------------------------------------------------------------------------------------------
# AlpacaProcessor


@pytest.mark.parametrize(
    ('row', 'prompt'),
    [
        ({'instruction': 'Translate', 'input': 'hallo', 'output': 'hello'}, 'Translate\nhallo'),
        ({'instruction': 'Say hi', 'input': '', 'output': 'hello'}, 'Say hi'),
        ({'instruction': 'Say hi', 'output': 'hello'}, 'Say hi'),
    ],
)
def test_alpaca_processor(row: dict[str, str], prompt: str) -> None:
    assert AlpacaProcessor().preprocess(row) == {
        'messages': [{'role': 'user', 'content': prompt}, {'role': 'assistant', 'content': 'hello'}]
    }


# ---------------------------------------------------------------------------------------------
# Missing fields, dropping rows, names


@pytest.mark.parametrize(
    ('processor', 'row', 'missing'),
    [
        (SelfCognitionProcessor('n', 'a'), {'query': 'who?', 'tag': 'en'}, 'response'),
        (GSM8KProcessor(), {'question': 'q', 'answer': None}, 'answer'),  # None counts as missing
        (AlpacaProcessor(), {'instruction': 'do it', 'input': 'x'}, 'output'),
    ],
)
def test_a_row_missing_a_field_names_the_row_and_the_field(
    processor: Preprocessor, row: dict[str, Any], missing: str
) -> None:
    with pytest.raises(DataError) as info:
        processor([row])
    message = str(info.value)
    assert f"lacks ['{missing}']" in message
    assert type(processor).__name__ in message
    first_key = next(iter(row))
    assert f'{first_key!r}: {row[first_key]!r}' in message  # the row is shown


def test_long_values_are_shortened_in_the_error() -> None:
    with pytest.raises(DataError) as info:
        AlpacaProcessor()([{'instruction': 'x' * 100}])
    assert "'" + 'x' * 60 + "...'" in str(info.value)
    assert 'x' * 61 not in str(info.value)


def test_missing_field_through_dataset_map(self_cognition_path: str) -> None:
    dataset = Dataset(DatasetMeta(self_cognition_path, data_slice=range(3)))
    with pytest.raises(DataError, match=r"GSM8KProcessor needs fields \['question', 'answer'\]"):
        dataset.map(GSM8KProcessor())


class _EvenOnly(Preprocessor):
    """Keeps rows with an even 'n' (and says so); a ``None`` result drops a row."""

    required_fields = ('n',)

    def preprocess(self, row: Mapping[str, Any]) -> dict[str, Any] | None:
        return {'messages': [{'role': 'user', 'content': str(row['n'])}]} if row['n'] % 2 == 0 else None


def test_a_none_result_drops_the_row() -> None:
    out = _EvenOnly()([{'n': n} for n in range(5)])
    assert [t['messages'][0]['content'] for t in out] == ['0', '2', '4']


def test_unknown_preprocessor_name_lists_the_valid_ones(self_cognition_path: str) -> None:
    dataset = Dataset(DatasetMeta(self_cognition_path, data_slice=range(2)))
    with pytest.raises(UnknownNameError) as info:
        dataset.map('SelfCognition', init_args={'model_name': 'n', 'model_author': 'a'})
    for name in ('AlpacaProcessor', 'GSM8KProcessor', 'SelfCognitionProcessor'):
        assert repr(name) in str(info.value)
    assert set(PREPROCESSORS.names()) >= {'AlpacaProcessor', 'GSM8KProcessor', 'SelfCognitionProcessor'}


# ---------------------------------------------------------------------------------------------
# Through Dataset.map


def test_map_by_name_with_init_args(self_cognition_path: str) -> None:
    raw = read_jsonl(self_cognition_path)[:20]
    dataset = Dataset(DatasetMeta(self_cognition_path, data_slice=range(20)))
    dataset.map('SelfCognitionProcessor', init_args={'model_name': 'Zed', 'model_author': 'Acme'})
    assert dataset.dataset.column_names == ['messages']  # the raw fields are replaced
    expected = SelfCognitionProcessor('Zed', 'Acme')(raw)
    assert [dataset[i] for i in range(20)] == expected


def test_map_by_class_by_instance_and_by_function() -> None:
    rows = [{'instruction': f'i{k}', 'output': f'o{k}'} for k in range(3)]
    expected = AlpacaProcessor()(rows)
    assert list(Dataset(DatasetMeta(data=rows)).map(AlpacaProcessor).dataset) == expected
    assert list(Dataset(DatasetMeta(data=rows)).map(AlpacaProcessor()).dataset) == expected
    upper = Dataset(DatasetMeta(data=rows)).map(lambda row: {'instruction': row['instruction'].upper()})
    assert list(upper.dataset) == [{'instruction': 'I0'}, {'instruction': 'I1'}, {'instruction': 'I2'}]


def test_map_drops_rows_a_preprocessor_returns_none_for() -> None:
    dataset = Dataset(DatasetMeta(data=[{'n': n} for n in range(7)]))
    # batch_size=2: the batches [0, 1], [2, 3], [4, 5], [6] each keep their even row.
    dataset.map(_EvenOnly(), batch_size=2)
    assert [row['messages'][0]['content'] for row in dataset] == ['0', '2', '4', '6']


def test_map_where_whole_batches_are_dropped() -> None:
    # Rows 0-3 are odd or even in pairs; with batch_size=2 the batches [1, 3] and [5, 7] keep nothing,
    # and the first one is the very first batch written.
    dataset = Dataset(DatasetMeta(data=[{'n': n} for n in (1, 3, 2, 4, 5, 7, 8)]))
    dataset.map(_EvenOnly(), batch_size=2)
    assert [row['messages'][0]['content'] for row in dataset] == ['2', '4', '8']


def test_map_that_drops_every_row_raises() -> None:
    dataset = Dataset(DatasetMeta(data=[{'n': 1}, {'n': 3}]))
    with pytest.raises(DataError, match='every one of the 2 rows was dropped'):
        dataset.map(_EvenOnly())


@pytest.mark.parametrize(
    ('preprocessor', 'init_args', 'message'),
    [
        (AlpacaProcessor(), {'system': 'x'}, 'init_args only apply'),
        (42, None, 'Registered names'),
        (dict, None, 'must be a registered name'),  # a class that is not a Preprocessor
    ],
)
def test_map_refuses_what_it_cannot_use(preprocessor: Any, init_args: dict[str, Any] | None, message: str) -> None:
    dataset = Dataset(DatasetMeta(data=[{'instruction': 'i', 'output': 'o'}]))
    with pytest.raises(ConfigurationError, match=message):
        dataset.map(preprocessor, init_args=init_args)


def test_map_function_must_return_a_dict_or_none() -> None:
    dataset = Dataset(DatasetMeta(data=[{'a': 1}]))
    with pytest.raises(DataError, match='returned list'):
        dataset.map(lambda row: [row])


class _MinLength(DataFilter):
    def __init__(self, field: str, minimum: int):
        self.field, self.minimum = field, minimum

    def __call__(self, row: Mapping[str, Any]) -> bool:
        return len(row[self.field]) >= self.minimum


def test_filter_by_class_with_init_args_and_by_registered_name() -> None:
    rows = [{'text': 'a' * k} for k in range(6)]
    kept = Dataset(DatasetMeta(data=rows)).filter(_MinLength, init_args={'field': 'text', 'minimum': 4})
    assert [len(row['text']) for row in kept] == [4, 5]
    FILTERS.register(_MinLength)
    try:
        by_name = Dataset(DatasetMeta(data=rows)).filter('_MinLength', init_args={'field': 'text', 'minimum': 5})
        assert [len(row['text']) for row in by_name] == [5]
    finally:
        FILTERS._table.pop('_MinLength')
    with pytest.raises(UnknownNameError):
        Dataset(DatasetMeta(data=rows)).filter('_MinLength')


@pytest.mark.parametrize(
    ('predicate', 'init_args', 'message'),
    [
        (_MinLength('text', 1), {'minimum': 2}, 'init_args only apply'),  # an instance is built already
        (42, None, 'a filter must be a registered name'),
        (dict, None, 'must be a registered name'),  # a class that is not a DataFilter
    ],
)
def test_filter_refuses_what_it_cannot_use(
    predicate: Any, init_args: dict[str, Any] | None, message: str, tmp_path: Path
) -> None:
    path = tmp_path / 'rows.jsonl'
    path.write_text('{"text": "a"}\n')
    with pytest.raises(ConfigurationError, match=message):
        Dataset(DatasetMeta(str(path))).filter(predicate, init_args=init_args)
    with pytest.raises(ConfigurationError, match=message):  # a stream takes filters the same way
        IterableDataset(path).filter(predicate, init_args=init_args)
