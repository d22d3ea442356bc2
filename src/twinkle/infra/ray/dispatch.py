"""How a remote component's method splits its inputs over its ranks, and merges their results.

Each method of a component class declares one ``Dispatch`` (see ``remote_class``):

- ``dispatch``: ``'all'`` (every rank gets the same arguments), ``'slice_dp'`` (every rank gets
  its data shard of the list arguments, see ``slice_inputs``) or ``'rank0'`` (rank 0 alone runs it);
- ``collect``: ``'first'`` (rank 0's result), ``'mean'`` (the average, see ``mean``), ``'flatten'``
  (the shards concatenated in data-rank order, see ``flatten``) or ``'list'`` (every rank's result).

These are pure functions of the values: the Ray side (``proxy.py``) only decides which ranks'
results they see. ``mean`` and ``flatten`` see one result per data shard (ranks that differ only
along ``tp``/``pp``/``cp`` read the same shard and return the same thing).

>>> slice_inputs(([1, 2, 3, 4, 5], 'x'), {'weights': [0.1, 0.2, 0.3, 0.4, 0.5]}, data_rank=1, dp_size=2)
(([4, 5], 'x'), {'weights': [0.4, 0.5]})
>>> COLLECTS['mean']([1.0, 2.0]), COLLECTS['flatten']([[1, 2], [3]])
(1.5, [1, 2, 3])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from twinkle.errors import ConfigurationError, DataError, one_of

DISPATCHES: tuple[str, ...] = ('all', 'slice_dp', 'rank0')


@dataclass(frozen=True)
class Dispatch:
    """How one method runs on a remote component's ranks."""

    # 'all', 'slice_dp' or 'rank0' (see the module docstring).
    dispatch: str = 'all'
    # A name in COLLECTS.
    collect: str = 'first'

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCHES:
            raise one_of('dispatch', self.dispatch, DISPATCHES)
        if self.collect not in COLLECTS:
            raise one_of('collect', self.collect, COLLECTS)

    @classmethod
    def parse(cls, spec: Dispatch | tuple[str, str] | Mapping[str, str]) -> Dispatch:
        """A ``Dispatch``, a ``(dispatch, collect)`` pair or ``{'dispatch': ..., 'collect': ...}``."""
        if isinstance(spec, Dispatch):
            return spec
        if isinstance(spec, Mapping):
            return cls(**spec)
        if isinstance(spec, tuple) and len(spec) == 2:
            return cls(*spec)
        raise ConfigurationError(
            f"a method's dispatch is a (dispatch, collect) pair such as ('slice_dp', 'mean'); got {spec!r}"
        )


# ---- slicing ------------------------------------------------------------------------------------
def _is_rows(value: object) -> bool:
    """Whether ``value`` is a batch of rows that slice_dp splits: a list, a tuple, or an array/tensor."""
    if isinstance(value, (list, tuple)):
        return True
    shape = getattr(value, 'shape', None)
    return shape is not None and len(shape) > 0


def shard_bounds(length: int, data_rank: int, dp_size: int) -> tuple[int, int]:
    """``[start, end)`` of data shard ``data_rank`` when ``length`` rows split into ``dp_size``
    contiguous shards whose sizes differ by at most one (the first ``length % dp_size`` get one more).

    >>> [shard_bounds(5, r, 2) for r in range(2)]
    [(0, 3), (3, 5)]
    """
    base, extra = divmod(length, dp_size)
    start = data_rank * base + min(data_rank, extra)
    return start, start + base + (data_rank < extra)


def slice_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, data_rank: int, dp_size: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Every argument that is a batch of rows as long as the first one (the ``inputs``), cut to
    shard ``data_rank``; the rest (a ``micro_batch_size``, sampling parameters) unchanged.

    The batch length is that of the first list-like argument, positional before keyword; per-row
    loss inputs (``advantages``, ``old_logps``) have the same length and are cut alike.
    """
    if dp_size == 1:
        return args, kwargs
    values = [*args, *kwargs.values()]
    length = next((len(v) for v in values if _is_rows(v)), None)
    if length is None:
        return args, kwargs
    if length < dp_size:
        raise DataError(
            f'{length} rows cannot be split over {dp_size} data-parallel ranks: each needs at least one; '
            f'pass at least {dp_size} rows'
        )
    start, end = shard_bounds(length, data_rank, dp_size)

    def cut(value: Any) -> Any:
        return value[start:end] if _is_rows(value) and len(value) == length else value

    return tuple(cut(v) for v in args), {k: cut(v) for k, v in kwargs.items()}


# ---- collecting ---------------------------------------------------------------------------------
def first(values: Sequence[Any]) -> Any:
    """Rank 0's result."""
    return values[0]


def as_list(values: Sequence[Any]) -> list[Any]:
    """Every rank's result, in rank order."""
    return list(values)


def mean(values: Sequence[Any]) -> Any:
    """The average: of numbers; of dicts key by key (the first result's keys); of ``ModelOutput``
    the ``loss`` and ``metrics``, its other fields rank 0's (a model on a mesh reports the global
    ``num_tokens`` on every rank). ``None`` everywhere stays ``None``."""
    from twinkle.data_format import ModelOutput

    head = values[0]
    if all(v is None for v in values):
        return None
    if isinstance(head, ModelOutput):
        return dataclasses.replace(
            head,
            loss=mean([v.loss for v in values]),
            metrics=mean([v.metrics for v in values]) if head.metrics else {},
        )
    if isinstance(head, Mapping):
        return {key: mean([v[key] for v in values]) for key in head}
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return sum(values) / len(values)
    raise DataError(
        f'collect="mean" averages numbers, dicts of numbers and ModelOutput; got {[type(v).__name__ for v in values]}'
    )


def flatten(values: Sequence[Any]) -> Any:
    """The shards concatenated in data-rank order: lists (and tuples) into one list; ``ModelOutput``
    by rows (``logps``/``logits`` right-padded with zeros to the longest sequence; ``num_tokens``
    added up; the loss averaged)."""
    from twinkle.data_format import ModelOutput

    head = values[0]
    if isinstance(head, ModelOutput):
        return dataclasses.replace(
            mean(values),
            num_tokens=sum(v.num_tokens for v in values),
            logits=_cat_padded([v.logits for v in values]),
            logps=_cat_padded([v.logps for v in values]),
        )
    if all(isinstance(v, (list, tuple)) for v in values):
        return [item for value in values for item in value]
    raise DataError(f'collect="flatten" concatenates lists and ModelOutput; got {[type(v).__name__ for v in values]}')


def _cat_padded(tensors: list[Any]) -> Any:
    """Concatenate ``[rows, seq, ...]`` tensors along rows, right-padding ``seq`` with zeros."""
    if any(t is None for t in tensors):
        return None
    import torch

    longest = max(t.shape[1] for t in tensors)
    padded = []
    for tensor in tensors:
        pad = [0, 0] * (tensor.dim() - 2) + [0, longest - tensor.shape[1]]
        padded.append(torch.nn.functional.pad(tensor, pad))
    return torch.cat(padded)


COLLECTS: dict[str, Callable[[Sequence[Any]], Any]] = {
    'first': first,
    'list': as_list,
    'mean': mean,
    'flatten': flatten,
}
#: What a method that its class does not list gets.
DEFAULT_DISPATCH = Dispatch('all', 'first')
