"""Packing: encoded rows laid end to end into sequences of up to ``max_length`` tokens.

Rows of skewed lengths padded to the longest in a batch spend most of the compute on padding.
``PackingDataset`` packs them first-fit-decreasing (each row, longest first, into the first
sequence with room; Johnson 1973, at most 11/9 of the optimal number of sequences plus 1). A
packed sequence keeps every row's own ``position_ids`` (restarting at 0) and its labels (which
are pre-shifted within the row, so no label crosses into the next row). Collated with
``InputProcessor(padding_free=True)``, transformers sees the positions restart and masks
attention to each row (a block-diagonal causal mask; varlen flash attention on a GPU), so a
packed batch gives each row's loss and gradients as the same rows padded do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

from twinkle.data_format import RL_ROW_FIELDS, InputFeature
from twinkle.errors import ConfigurationError, DataError

#: The per-token fields a packed sequence concatenates (each row's own ``position_ids`` are made
#: when it has none).
PACKED_FIELDS = ('input_ids', 'labels', 'completion_mask', 'routed_experts')


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity``: longest first, each
    into the first bin with room. Bins keep their rows in the order they were placed."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if length > capacity:
            raise DataError(f'row {index} has {length} tokens, more than max_length={capacity}: it cannot be packed')
        target = next((b for b, free in enumerate(room) if free >= length), None)
        if target is None:
            bins.append([index])
            room.append(capacity - length)
        else:
            bins[target].append(index)
            room[target] -= length
    return bins


def pack(rows: Sequence[InputFeature], max_length: int) -> list[InputFeature]:
    """``rows`` packed into sequences of at most ``max_length`` tokens (first-fit-decreasing)."""
    if not isinstance(max_length, int) or max_length < 1:
        raise ConfigurationError(f'max_length must be a positive integer; got {max_length!r}')
    for index, row in enumerate(rows):
        if 'input_ids' not in row or 'labels' not in row:
            raise DataError(f'row {index} is not encoded (fields {sorted(row)}): encode the dataset before packing')
    groups = first_fit_decreasing([len(row['input_ids']) for row in rows], max_length)
    return [_concatenate([rows[i] for i in group]) for group in groups]


def _concatenate(rows: list[InputFeature]) -> InputFeature:
    fields: list[Mapping[str, Any]] = list(rows)  # the rows, read by the computed names below
    packed: dict[str, Any] = {}
    for name in (*PACKED_FIELDS, *RL_ROW_FIELDS):
        holders = sum(name in row for row in rows)
        if 0 < holders < len(rows):
            raise DataError(f'{holders} of the {len(rows)} rows packed together have {name!r} and the others not')
    for name in PACKED_FIELDS:
        if name in rows[0]:
            packed[name] = [value for row in fields for value in row[name]]
    packed['position_ids'] = [p for row in rows for p in row.get('position_ids', range(len(row['input_ids'])))]
    packed['length'] = len(packed['input_ids'])
    packed['packed_rows'] = len(rows)
    for name in RL_ROW_FIELDS:  # RL loss inputs follow their rows, one entry per row
        if all(name in row for row in rows):
            packed[name] = [row[name] for row in fields]
    if any('image_grid_thw' in row for row in rows):  # images follow their rows, in row order
        packed.update(_images(rows))
    # Every key set above is a field of InputFeature: PACKED_FIELDS, RL_ROW_FIELDS and the three named.
    return cast(InputFeature, packed)


def _images(rows: list[InputFeature]) -> dict[str, Any]:
    """The packed rows' images (``VisionTemplate``'s fields): the vision tower fills the packed
    sequence's image tokens image by image, so each row's images come in the order of its tokens."""
    import torch

    return {
        'mm_token_type_ids': [k for row in rows for k in row.get('mm_token_type_ids', [0] * len(row['input_ids']))],
        'image_grid_thw': [grid for row in rows for grid in row.get('image_grid_thw', [])],
        'pixel_values': torch.cat(
            [torch.as_tensor(row['pixel_values'], dtype=torch.float32) for row in rows if 'pixel_values' in row]
        ),
    }


class PackingDataset(Sequence[InputFeature]):
    """Encoded rows (a ``Dataset`` after ``encode()``, or a list of features) packed into
    sequences of up to ``max_length`` tokens; a ``DataLoader`` takes it like a dataset. Train on
    it with ``model.set_processor('InputProcessor', padding_free=True)``.

    ``buffer_size`` rows are packed at a time (all of them: None), so a row is packed only with
    rows near it in the data's order."""

    def __init__(self, dataset: Iterable[InputFeature], max_length: int, buffer_size: int | None = None):
        if buffer_size is not None and (not isinstance(buffer_size, int) or buffer_size < 1):
            raise ConfigurationError(f'buffer_size must be a positive integer or None; got {buffer_size!r}')
        self.max_length = max_length
        self.rows: list[InputFeature] = []
        self.source_rows = 0
        for chunk in _chunks(iter(dataset), buffer_size):
            self.rows += pack(chunk, max_length)
            self.source_rows += len(chunk)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> InputFeature:  # type: ignore[override]
        return self.rows[index]

    @property
    def fill(self) -> float:
        """The share of the packed sequences' ``max_length`` slots that hold tokens."""
        return sum(len(row['input_ids']) for row in self.rows) / (len(self.rows) * self.max_length)


def _chunks(rows: Iterator[InputFeature], size: int | None) -> Iterator[list[InputFeature]]:
    chunk: list[InputFeature] = []
    for row in rows:
        chunk.append(row)
        if size is not None and len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
