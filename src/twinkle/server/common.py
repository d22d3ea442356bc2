"""What twinkle's rows become on the Tinker API: :func:`input_feature_to_datum`.

Both sides agree on where the shift lives. A twinkle row (``InputFeature``, from
``Template.encode``) holds ``input_ids`` and ``labels`` already shifted: position ``i`` is
trained to predict ``labels[i]`` (that is ``input_ids[i + 1]``), or nothing where ``labels[i]``
is ``IGNORE_INDEX`` (-100); the loss (``CrossEntropyLoss``) scores ``logits[i]`` against
``labels[i]`` with no further shift. A Tinker ``Datum`` has the same layout: position ``i`` of
``model_input`` predicts ``loss_fn_inputs['target_tokens'][i]``, scaled by ``weights[i]``. So
the tokens go across as they are, the labels become the targets (-100 replaced by token 0, which
weight 0 leaves untrained), and the weights are 1 where a label is trained and 0 elsewhere.

The ``cross_entropy`` loss of the datum, ``-(logprobs * weights).sum()``, is then the token sum
of twinkle's ``CrossEntropyLoss`` on the row: its mean times the trained-token count.

Example (hand-made: the row ``a b c d`` trains ``c`` and ``d``, predicted at positions 1 and 2)::

    >>> datum = input_feature_to_datum({'input_ids': [5, 6, 7, 8], 'labels': [-100, 7, 8, -100]})
    >>> datum.model_input.to_ints()
    [5, 6, 7, 8]
    >>> datum.loss_fn_inputs['target_tokens'].tolist(), datum.loss_fn_inputs['weights'].tolist()
    ([0, 7, 8, 0], [0.0, 1.0, 1.0, 0.0])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tinker import types

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import DataError

#: The target token put where a label is ignored: any id in the vocabulary does, its weight is 0.
MASKED_TARGET = 0


def input_feature_to_datum(feature: Mapping[str, Any]) -> types.Datum:
    """The Tinker ``Datum`` of one encoded twinkle row (``input_ids`` and pre-shifted ``labels``,
    lists, 1-D numpy arrays or 1-D tensors); see the module docstring for the layout."""
    missing = [name for name in ('input_ids', 'labels') if name not in feature]
    if missing:
        raise DataError(
            f'a row to convert needs input_ids and labels (encode it with a Template first); '
            f'it lacks {missing} and has {sorted(feature)}'
        )
    tokens = _int_list('input_ids', feature['input_ids'])
    labels = _int_list('labels', feature['labels'])
    if not tokens:
        raise DataError('input_ids is empty: a datum needs at least one token')
    if len(labels) != len(tokens):
        raise DataError(f'labels has {len(labels)} values for {len(tokens)} input_ids; they must be equally long')
    bad = next((label for label in labels if label < 0 and label != IGNORE_INDEX), None)
    if bad is not None:
        raise DataError(f'labels hold {bad}; a label is a token id (>= 0) or {IGNORE_INDEX} (not trained)')
    targets = [MASKED_TARGET if label == IGNORE_INDEX else label for label in labels]
    weights = [0.0 if label == IGNORE_INDEX else 1.0 for label in labels]
    n = len(tokens)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={
            'target_tokens': types.TensorData(data=targets, dtype='int64', shape=[n]),
            'weights': types.TensorData(data=weights, dtype='float32', shape=[n]),
        },
    )


def _int_list(name: str, values: Any) -> list[int]:
    """``values`` (a list, or an array or tensor with ``tolist``) as a flat list of ints."""
    listed = values.tolist() if hasattr(values, 'tolist') else values
    if not isinstance(listed, (list, tuple)):
        raise DataError(f'{name} must be a list of token ids; got {type(values).__name__}')
    if any(isinstance(v, (list, tuple)) for v in listed):
        raise DataError(f'{name} must be one flat sequence (one row); got nested lists: convert each row apart')
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in listed):
        kinds = sorted({type(v).__name__ for v in listed if not isinstance(v, int) or isinstance(v, bool)})
        raise DataError(f'{name} must hold integer token ids; got values of type {kinds}')
    return list(listed)


__all__ = ['MASKED_TARGET', 'input_feature_to_datum']
