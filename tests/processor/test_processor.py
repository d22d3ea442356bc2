"""twinkle.processor: collating encoded rows into padded or packed model inputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError, DataError
from twinkle.processor import PROCESSORS, InputProcessor
from twinkle.template import Template

PAD = 99


def feature(ids: list[int], trained_from: int) -> dict[str, Any]:
    """A hand-made encoded row whose positions from ``trained_from`` on predict the next token."""
    n = len(ids)
    labels = [ids[i + 1] if trained_from <= i < n - 1 else IGNORE_INDEX for i in range(n)]
    return {
        'input_ids': ids,
        'attention_mask': [1] * n,
        'position_ids': list(range(n)),
        'labels': labels,
        'completion_mask': [int(label != IGNORE_INDEX) for label in labels],
        'length': n,
    }


ROWS = [feature([5, 6, 7], 1), feature([8, 9], 0)]
X = IGNORE_INDEX


def as_lists(batch: dict[str, torch.Tensor]) -> dict[str, list[list[int]]]:
    return {name: tensor.tolist() for name, tensor in batch.items()}


def test_right_padding() -> None:
    batch = InputProcessor('right')(ROWS, pad_token_id=PAD)
    assert all(t.dtype == torch.long for t in batch.values())
    assert as_lists(batch) == {
        'input_ids': [[5, 6, 7], [8, 9, PAD]],
        'labels': [[X, 7, X], [9, X, X]],
        'attention_mask': [[1, 1, 1], [1, 1, 0]],
        'position_ids': [[0, 1, 2], [0, 1, 0]],
        'completion_mask': [[0, 1, 0], [1, 0, 0]],
    }


def test_left_padding() -> None:
    batch = InputProcessor('left')(ROWS, pad_token_id=PAD)
    assert as_lists(batch) == {
        'input_ids': [[5, 6, 7], [PAD, 8, 9]],
        'labels': [[X, 7, X], [X, 9, X]],
        'attention_mask': [[1, 1, 1], [0, 1, 1]],
        'position_ids': [[0, 1, 2], [0, 0, 1]],
        'completion_mask': [[0, 1, 0], [0, 1, 0]],
    }


@pytest.mark.parametrize(('side', 'mask'), [('right', [[1, 1, 1], [1, 1, 0]]), ('left', [[1, 1, 1], [0, 1, 1]])])
def test_attention_mask_is_made_when_rows_have_none(side: str, mask: list[list[int]]) -> None:
    bare = [{'input_ids': row['input_ids'], 'labels': row['labels']} for row in ROWS]
    batch = InputProcessor(side)(bare, pad_token_id=PAD)
    assert set(batch) == {'input_ids', 'labels', 'attention_mask'}
    assert batch['attention_mask'].tolist() == mask


def test_padding_free_packs_into_one_row() -> None:
    batch = InputProcessor(padding_free=True)(ROWS, pad_token_id=PAD)
    assert as_lists(batch) == {
        'input_ids': [[5, 6, 7, 8, 9]],
        'labels': [[X, 7, X, 9, X]],  # each row's last label is ignored, so no row predicts the next one
        'position_ids': [[0, 1, 2, 0, 1]],  # restart per row: the model builds a block-diagonal mask
        'completion_mask': [[0, 1, 0, 1, 0]],
    }


@pytest.mark.parametrize(
    ('features', 'message'),
    [
        ([], 'empty batch'),
        ([ROWS[0], {'messages': [], 'user_data': {}}], r"batch row 1 is not encoded: it has fields \['messages'"),
        ([{'input_ids': [1, 2]}], "'input_ids' and 'labels' are needed"),
    ],
)
def test_unencoded_rows_are_refused(features: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(DataError, match=message):
        InputProcessor()(features, pad_token_id=PAD)


def test_bad_padding_side() -> None:
    with pytest.raises(ConfigurationError, match="'left', 'right'"):
        InputProcessor('middle')  # type: ignore[arg-type]
    assert PROCESSORS.get('InputProcessor') is InputProcessor


# ---------------------------------------------------------------------------------------------
# Property: padding then stripping gives back every row


_rows = st.lists(
    st.lists(st.integers(0, 50), min_size=1, max_size=12).flatmap(
        lambda ids: st.integers(0, len(ids) - 1).map(lambda start: feature(ids, start))
    ),
    min_size=1,
    max_size=5,
)
FIELDS = ('input_ids', 'labels', 'attention_mask', 'position_ids', 'completion_mask')
PAD_VALUES = {'input_ids': PAD, 'labels': IGNORE_INDEX, 'attention_mask': 0, 'position_ids': 0, 'completion_mask': 0}


@settings(max_examples=80, deadline=None)
@given(features=_rows, side=st.sampled_from(['left', 'right']))
def test_property_padding_then_stripping_recovers_each_row(features: list[dict[str, Any]], side: str) -> None:
    batch = InputProcessor(side)(features, pad_token_id=PAD)
    width = max(f['length'] for f in features)
    for i, f in enumerate(features):
        n = f['length']
        real = slice(0, n) if side == 'right' else slice(width - n, width)
        pad = slice(n, width) if side == 'right' else slice(0, width - n)
        assert batch['attention_mask'][i].sum().item() == n
        for name in FIELDS:
            assert batch[name][i, real].tolist() == f[name]
            assert set(batch[name][i, pad].tolist()) <= {PAD_VALUES[name]}


@settings(max_examples=80, deadline=None)
@given(features=_rows)
def test_property_packing_then_splitting_recovers_each_row(features: list[dict[str, Any]]) -> None:
    batch = InputProcessor(padding_free=True)(features, pad_token_id=PAD)
    assert 'attention_mask' not in batch
    offset = 0
    for f in features:
        n = f['length']
        for name in ('input_ids', 'labels', 'position_ids', 'completion_mask'):
            assert batch[name][0, offset : offset + n].tolist() == f[name]
        offset += n
    assert batch['input_ids'].shape == (1, offset)


# ---------------------------------------------------------------------------------------------
# Packing gives the padded logits on the tiny model


@pytest.fixture(scope='module')
def tiny_model(tiny_model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation='sdpa', dtype=torch.float32).eval()


@pytest.fixture(scope='module')
def encoded(tiny_model_dir: str) -> tuple[Template, list[dict[str, Any]]]:
    template = Template(tiny_model_dir)
    conversations = [
        [('user', 'Who are you?'), ('assistant', 'I am a small test model, trained by nobody at all.')],
        [('user', 'hi'), ('assistant', 'hello')],
        [('system', 'Be brief.'), ('user', 'What is 2 + 3?'), ('assistant', '5')],
    ]
    rows = [{'messages': [{'role': r, 'content': c} for r, c in turns]} for turns in conversations]
    features = template.batch_encode(rows)
    assert len({f['length'] for f in features}) == 3  # different lengths, so padding really happens
    return template, features


def _logits(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: batch[k] for k in ('input_ids', 'attention_mask', 'position_ids') if k in batch}
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


def test_packed_logits_equal_padded_logits(tiny_model: Any, encoded: tuple[Template, list[dict[str, Any]]]) -> None:
    template, features = encoded
    padded = _logits(tiny_model, InputProcessor('right')(features, template.pad_token_id))
    left = _logits(tiny_model, InputProcessor('left')(features, template.pad_token_id))
    packed = _logits(tiny_model, InputProcessor(padding_free=True)(features, template.pad_token_id))
    width, offset = padded.shape[1], 0
    for i, f in enumerate(features):
        n = f['length']
        alone = _logits(tiny_model, {'input_ids': torch.tensor([f['input_ids']])})[0]
        torch.testing.assert_close(padded[i, :n], alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(left[i, width - n :], alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(packed[0, offset : offset + n], alone, atol=1e-5, rtol=0)
        offset += n


def test_packing_depends_on_the_restarting_positions(
    tiny_model: Any, encoded: tuple[Template, list[dict[str, Any]]]
) -> None:
    """The control for the test above: without restarting positions the packed rows see each
    other (a plain causal mask over the whole row), and the second row's logits change."""
    template, features = encoded
    packed = InputProcessor(padding_free=True)(features, template.pad_token_id)
    plain = _logits(tiny_model, {'input_ids': packed['input_ids']})
    alone = _logits(tiny_model, {'input_ids': torch.tensor([features[1]['input_ids']])})[0]
    first = features[0]['length']
    assert (plain[0, first : first + features[1]['length']] - alone).abs().max() > 1e-3
