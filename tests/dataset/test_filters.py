"""Registered data filters on tables and streams: length in tokens, exact and near-duplicate
text, a rule on a field; each reports what it dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twinkle.dataset import Dataset, DatasetMeta, IterableDataset
from twinkle.errors import ConfigurationError, DataError
from twinkle.preprocessor import FILTERS, ExactDedupFilter, LengthFilter, NearDedupFilter, RuleFilter

TEXTS = [
    'the quick brown fox jumps over the lazy dog near the river bank today',
    'the quick brown fox jumps over the lazy dog near the river bank today',  # exact
    '  the quick brown fox jumps over the lazy dog near the river bank today ',  # exact, but for spaces
    'the quick brown fox jumps over the lazy dog near the river bank this morning',  # near
    'a completely different sentence about training language models with adapters',
]


def chats(texts: list[str]) -> list[dict]:
    return [{'messages': [{'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': t}]} for t in texts]


def test_the_filters_are_registered_by_name():
    assert isinstance(FILTERS.build('LengthFilter', object, max_tokens=4), LengthFilter)
    assert {'LengthFilter', 'ExactDedupFilter', 'NearDedupFilter', 'RuleFilter'} <= set(FILTERS.names())


def test_length_in_tokens():
    rows = [{'input_ids': list(range(n))} for n in (2, 5, 9, 14)]
    keep = LengthFilter(min_tokens=4, max_tokens=10)
    assert [len(r['input_ids']) for r in rows if keep(r)] == [5, 9]
    assert keep.report() == {
        'filter': 'LengthFilter',
        'seen': 4,
        'kept': 2,
        'dropped': {'fewer than 4 tokens': 1, 'more than 10 tokens': 1},
    }
    with pytest.raises(DataError, match='filter after encode'):
        keep({'messages': []})
    with pytest.raises(ConfigurationError, match='max_tokens=2 is below min_tokens=3'):
        LengthFilter(3, 2)


def test_exact_and_near_duplicates_on_a_table():
    exact = ExactDedupFilter('messages')
    dataset = Dataset(DatasetMeta(data=chats(TEXTS))).filter(exact)
    assert len(dataset) == 3 and exact.report()['dropped'] == {'exact duplicate': 2}
    near = NearDedupFilter('messages', threshold=0.6)
    dataset.filter(near)
    kept = [row['messages'][1]['content'] for row in dataset]
    assert kept == [TEXTS[0], TEXTS[4]] and near.report()['dropped'] == {'near duplicate': 1}


def test_a_rule_on_a_field_as_a_function_or_a_pattern(tmp_path: Path):
    rows = [{'lang': lang, 'text': text} for lang, text in [('en', 'a1'), ('de', 'b2'), ('en', 'c'), ('fr', 'd4')]]
    path = tmp_path / 'rows.jsonl'
    path.write_text('\n'.join(json.dumps(r) for r in rows))
    english = RuleFilter('lang', lambda lang: lang == 'en', reason='not English')
    digits = RuleFilter('text', r'\d')
    stream = IterableDataset(path).filter(english).filter(digits)
    assert [row['text'] for row in stream] == ['a1']
    assert english.report()['dropped'] == {'not English': 2}
    assert digits.report() == {'filter': 'RuleFilter', 'seen': 2, 'kept': 1, 'dropped': {'text fails the rule': 1}}
    assert stream.counts['dropped'] == 3
    with pytest.raises(DataError, match=r"no field 'missing'"):
        RuleFilter('missing', r'x')({'text': 'x'})


def test_a_rule_pattern_reads_a_conversation_s_text_not_its_json():
    rows = chats(['café au lait', '你好世界', 'plain'])
    assert [RuleFilter('messages', 'café|你好')(row) for row in rows] == [True, True, False]
    assert not RuleFilter('messages', 'assistant')(rows[2])  # roles and keys are not the text
