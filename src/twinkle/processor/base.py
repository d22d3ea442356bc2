"""Collation: a list of ``InputFeature`` rows into the tensors a model takes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch

from twinkle.data_format import IGNORE_INDEX, InputFeature
from twinkle.errors import DataError, one_of
from twinkle.registry import Registry

#: The per-token fields of an ``InputFeature`` that a batch carries.
TokenField = Literal['input_ids', 'labels', 'attention_mask', 'position_ids', 'completion_mask', 'mm_token_type_ids']
#: The value that pads each of them but ``input_ids`` (padded with the tokenizer's pad token).
_PAD_VALUES: dict[TokenField, int] = {
    'labels': IGNORE_INDEX,
    'attention_mask': 0,
    'position_ids': 0,
    'completion_mask': 0,
    'mm_token_type_ids': 0,
}
#: A batch's image fields: every row's image patches, in row order ([patches, patch values]), each
#: image's (t, h, w) grid ([images, 3]), and how many images each batch row holds ([rows]).
IMAGE_FIELDS = ('pixel_values', 'image_grid_thw', 'image_counts')


class InputProcessor:
    """Pads (or packs) encoded rows into a batch.

    ``padding_side`` is ``'right'`` (training) or ``'left'`` (generation). With
    ``padding_free=True`` the rows are concatenated into a single row whose ``position_ids``
    restart at 0 for each sequence and no attention mask is sent: transformers then builds a
    block-diagonal causal mask, so no compute is spent on padding. It does so only without a
    KV cache, so call the model with ``use_cache=False`` (an eval-mode model otherwise makes a
    cache and silently lets the sequences attend to each other). Packing pays when lengths in
    a batch differ a lot; the logits are the same as with padding.
    """

    def __init__(self, padding_side: Literal['left', 'right'] = 'right', padding_free: bool = False):
        if padding_side not in ('left', 'right'):
            raise one_of('padding_side', padding_side, ['left', 'right'])
        self.padding_side = padding_side
        self.padding_free = padding_free

    def __call__(self, features: Sequence[InputFeature], pad_token_id: int) -> dict[str, torch.Tensor]:
        if not features:
            raise DataError('cannot collate an empty batch')
        for index, feature in enumerate(features):
            if 'input_ids' not in feature or 'labels' not in feature:
                raise DataError(
                    f'batch row {index} is not encoded: it has fields {sorted(feature)}, '
                    "but 'input_ids' and 'labels' are needed (call dataset.encode() or set a template)"
                )
        if any('mm_token_type_ids' in f for f in features):  # text rows beside image rows: no image token
            features = [
                f if 'mm_token_type_ids' in f else {**f, 'mm_token_type_ids': [0] * len(f['input_ids'])}
                for f in features
            ]
        fields = [name for name in get_args(TokenField) if all(name in f for f in features)]
        batch = self._pack(features, fields) if self.padding_free else self._pad(features, fields, pad_token_id)
        if not self.padding_free and 'position_ids' in batch and _restarts(batch, features, self.padding_side):
            raise DataError(
                'a batch row holds packed rows (its position_ids restart): collate it with '
                "InputProcessor(padding_free=True) (model.set_processor('InputProcessor', padding_free=True)), "
                'which keeps attention within each packed row'
            )
        if any('routed_experts' in f for f in features):
            batch['routed_experts'] = self._routed_experts(features, batch['input_ids'].shape[-1])
        if any('pixel_values' in f for f in features):
            batch.update(self._images(features))
        return batch

    def _images(self, features: Sequence[InputFeature]) -> dict[str, torch.Tensor]:
        """The rows' images (``IMAGE_FIELDS``), row after row: the model's vision tower fills each
        row's image tokens with the next image's features, in this order."""
        pixels, grids, counts = [], [], []
        for index, feature in enumerate(features):
            grid = torch.as_tensor(feature.get('image_grid_thw', []), dtype=torch.long).reshape(-1, 3)
            values = torch.as_tensor(feature['pixel_values'], dtype=torch.float32) if len(grid) else None
            patches = int(grid.prod(-1).sum())
            if values is not None and (values.ndim != 2 or len(values) != patches):
                raise DataError(
                    f'batch row {index} has pixel_values of shape {tuple(values.shape)}; its image_grid_thw '
                    f'{grid.tolist()} needs {patches} patch rows'
                )
            if values is not None:
                pixels.append(values)
            grids.append(grid)
            counts.append(len(grid))
        if not pixels:
            raise DataError("the batch's rows carry pixel_values but no image_grid_thw")
        image_counts = torch.tensor([sum(counts)] if self.padding_free else counts, dtype=torch.long)
        return {'pixel_values': torch.cat(pixels), 'image_grid_thw': torch.cat(grids), 'image_counts': image_counts}

    def _routed_experts(self, features: Sequence[InputFeature], width: int) -> torch.Tensor:
        """The rows' recorded experts laid out as their tokens are: [rows, positions, layers, K]
        (one row when packed), -1 (route anew) on padding and on rows without a record."""
        recorded = {
            i: torch.as_tensor(f['routed_experts'], dtype=torch.long)
            for i, f in enumerate(features)
            if 'routed_experts' in f
        }
        shape = next(iter(recorded.values())).shape[1:]
        for i, experts in recorded.items():
            if experts.ndim != 3 or experts.shape[1:] != shape or len(experts) != len(features[i]['input_ids']):
                raise DataError(
                    f'batch row {i} has routed_experts of shape {tuple(experts.shape)}; expected one '
                    f'[layers, top_k] = {list(shape)} per token, {len(features[i]["input_ids"])} tokens'
                )
        rows = [recorded.get(i, torch.full((len(f['input_ids']), *shape), -1)) for i, f in enumerate(features)]
        if self.padding_free:
            return torch.cat(rows)[None]
        out = torch.full((len(rows), width, *shape), -1, dtype=torch.long)
        for i, experts in enumerate(rows):
            if self.padding_side == 'right':
                out[i, : len(experts)] = experts
            else:
                out[i, width - len(experts) :] = experts
        return out

    def _pad(
        self, features: Sequence[InputFeature], fields: list[TokenField], pad_token_id: int
    ) -> dict[str, torch.Tensor]:
        width = max(len(f['input_ids']) for f in features)
        batch: dict[str, torch.Tensor] = {}
        for name in fields:
            pad = pad_token_id if name == 'input_ids' else _PAD_VALUES[name]
            rows = torch.full((len(features), width), pad, dtype=torch.long)
            for i, feature in enumerate(features):
                values = torch.as_tensor(feature[name], dtype=torch.long)
                if self.padding_side == 'right':
                    rows[i, : len(values)] = values
                else:
                    rows[i, width - len(values) :] = values
            batch[name] = rows
        if 'attention_mask' not in batch:
            lengths = torch.tensor([len(f['input_ids']) for f in features])
            positions = torch.arange(width).expand(len(features), width)
            if self.padding_side == 'left':
                positions = positions.flip(-1)
            batch['attention_mask'] = (positions < lengths[:, None]).long()
        return batch

    def _pack(self, features: Sequence[InputFeature], fields: list[TokenField]) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = {
            name: torch.cat([torch.as_tensor(f[name], dtype=torch.long) for f in features])[None]
            for name in fields
            if name != 'attention_mask'
        }
        # Each row's own positions (a packed row's restart at each of its rows), else 0, 1, ...
        positions = [f.get('position_ids', range(len(f['input_ids']))) for f in features]
        batch['position_ids'] = torch.cat([torch.as_tensor(p, dtype=torch.long) for p in positions])[None]
        return batch


def split_rows(batch: dict[str, torch.Tensor], sizes: Sequence[int]) -> list[dict[str, torch.Tensor]]:
    """A collated (padded) batch cut into consecutive parts of ``sizes`` rows, each part with its
    own rows' images (``image_counts`` says how many each row holds): what the mixed pass hands
    each adapter's loss, which may run the part through the model again (a reference forward).
    ``torch.split``, not slices: a slice's backward would write into zeros the size of the whole."""
    token_fields = {k: torch.split(v, list(sizes)) for k, v in batch.items() if k not in IMAGE_FIELDS}
    parts: list[dict[str, torch.Tensor]] = [{k: v[j] for k, v in token_fields.items()} for j in range(len(sizes))]
    if 'image_counts' not in batch:
        return parts
    counts = torch.split(batch['image_counts'], list(sizes))
    images = [int(c.sum()) for c in counts]
    grids = torch.split(batch['image_grid_thw'], images)
    pixels = torch.split(batch['pixel_values'], [int(g.prod(-1).sum()) for g in grids])
    for part, count, grid, values in zip(parts, counts, grids, pixels, strict=True):
        if len(grid):
            part.update(pixel_values=values, image_grid_thw=grid, image_counts=count)
    return parts


def _restarts(batch: dict[str, torch.Tensor], features: Sequence[InputFeature], side: str) -> bool:
    """Whether some row's positions restart within its tokens (rows packed into it): one
    comparison over the padded ``position_ids``, padding left out."""
    positions = batch['position_ids']
    width = positions.shape[-1]
    lengths = torch.tensor([len(f['input_ids']) for f in features])
    columns = torch.arange(width).expand(len(features), width)
    real = columns < lengths[:, None] if side == 'right' else columns >= width - lengths[:, None]
    backwards = (positions[:, 1:] <= positions[:, :-1]) & real[:, 1:] & real[:, :-1]
    return bool(backwards.any())


PROCESSORS: Registry[InputProcessor] = Registry('processor')
PROCESSORS.register(InputProcessor)
