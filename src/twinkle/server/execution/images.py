"""Rows and prompts with images, as the service takes them from the native API (``images``: data
URLs) and the Tinker API (``ImageChunk`` s): checked against the limits, decoded, and turned into
what a vision-language model takes, by the model's own image processor.

A row's ``input_ids`` already hold each image's pad tokens, one per merged patch, in one run per
image (``VisionTemplate`` encodes them so; the Tinker codec writes ``expected_tokens`` of them per
chunk). Here each image is

1. held to the limits (``Limits.max_images_per_request``, ``max_image_bytes``, ``max_image_pixels``;
   the pixel count is read from the file's header before the pixels are decoded);
2. decoded to RGB (a file PIL cannot decode is a 400 naming it);
3. run through the image processor, whose grid gives its token count, which must equal the length
   of its run of pad tokens (``expected_tokens`` of a Tinker chunk is checked so).

The row then has ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``, as the local
``VisionTemplate`` gives them, and no label of a row is an image token or read off one
(``IGNORE_INDEX``).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import DataError
from twinkle.server.config import Limits

Json = Any
#: The token an image chunk's positions hold (``tinker_codec``) until ``ImageRows.fill`` puts the
#: model's image pad id there.
IMAGE_SLOT = -1


@dataclass(frozen=True)
class ImageSlot:
    """An image chunk of a Tinker datum or prompt: its file's bytes and the ``length`` token
    positions from ``start`` it takes (its ``expected_tokens``)."""

    data: bytes
    start: int
    length: int


#: A Tinker prompt's image chunks, in order.
Images = tuple[ImageSlot, ...]


class ImageRows:
    """The images of a vision-language model's rows: its image processor, its image pad token, the
    limits. ``ImageRows.of`` gives None for a model that takes no images."""

    def __init__(self, processor: Any, image_token_id: int, limits: Limits):
        self.processor = processor
        self.image_token_id = image_token_id
        self.merge_size = int(processor.merge_size)
        self.limits = limits

    @classmethod
    def of(cls, model_id: str, limits: Limits) -> ImageRows | None:
        """The model's ``ImageRows``, or None when its folder has no image processor or its config
        names no ``image_token_id`` (a text model)."""
        from twinkle.hub import resolve_model

        folder = Path(resolve_model(model_id))
        config = folder / 'config.json'
        if not (folder / 'preprocessor_config.json').is_file() or not config.is_file():
            return None
        token = json.loads(config.read_text(encoding='utf-8')).get('image_token_id')
        if not isinstance(token, int):
            return None
        from twinkle.template.vision import load_image_processor

        return cls(load_image_processor(str(folder)), token, limits)

    def check_count(self, count: int) -> None:
        """A request's images within ``max_images_per_request``."""
        limit = self.limits.max_images_per_request
        if count > limit:
            raise DataError(f'the request holds {count} images, over the limit of {limit} per request')

    def check(self, where: str, row: dict[str, Json], images: Sequence[bytes]) -> None:
        """What ``attach`` checks, from the files' headers alone (where a request is accepted, before
        it is queued): one run of pads per image, each within the limits and as long as its tokens."""
        runs = self._runs(where, row['input_ids'], len(images))
        for j, ((start, end), data) in enumerate(zip(runs, images, strict=True)):
            with self._open(f'{where} image {j}', data) as image:
                width, height = image.size
            patches = self.processor.get_number_of_image_patches(height, width, images_kwargs={})
            self._check_tokens(f'{where} image {j}', end - start, patches // self.merge_size**2, None)

    def attach(self, where: str, row: dict[str, Json], images: Sequence[bytes]) -> dict[str, Json]:
        """``row`` (``input_ids``, and ``labels`` if it is trained) with its images' pixels, grids and
        image token types; ``where`` names it in errors (``'input row 2'``)."""
        ids: list[int] = row['input_ids']
        runs = self._runs(where, ids, len(images))
        pictures = [self._decode(f'{where} image {j}', data) for j, data in enumerate(images)]
        pixels = self.processor(images=pictures, return_tensors='pt')
        grids: list[list[int]] = pixels['image_grid_thw'].tolist()
        for j, ((start, end), grid) in enumerate(zip(runs, grids, strict=True)):
            self._check_tokens(f'{where} image {j}', end - start, math.prod(grid) // self.merge_size**2, grid)
        kinds = [0] * len(ids)
        for start, end in runs:
            kinds[start:end] = [1] * (end - start)
        out = {**row, 'pixel_values': pixels['pixel_values'], 'image_grid_thw': grids, 'mm_token_type_ids': kinds}
        if 'labels' in row:  # pre-shifted: label j is token j + 1; none is an image token, none is read off one
            touches = [a or b for a, b in zip(kinds, [*kinds[1:], 0], strict=True)]
            out['labels'] = [IGNORE_INDEX if t else label for label, t in zip(row['labels'], touches, strict=True)]
        return out

    def _runs(self, where: str, ids: Sequence[int], images: int) -> list[tuple[int, int]]:
        runs = _pad_runs(ids, self.image_token_id)
        if len(runs) != images:
            raise DataError(
                f'{where} has {images} images but {len(runs)} runs of image pad tokens '
                f'(id {self.image_token_id}); each image needs one run, as many pads as its merged patches'
            )
        return runs

    def _check_tokens(self, where: str, pads: int, tokens: int, grid: list[int] | None) -> None:
        if pads == tokens:
            return
        merge = self.merge_size
        shape = f' (a grid of {" x ".join(map(str, grid))} patches, merged {merge} x {merge})' if grid else ''
        raise DataError(f'{where} has {pads} pad tokens, but the image is {tokens} tokens{shape}')

    def fill(self, where: str, tokens: Sequence[int], slots: Sequence[ImageSlot]) -> dict[str, Json]:
        """A Tinker datum's or prompt's row: ``tokens`` with each image chunk's slots holding the
        image pad id, and the images attached (their ``expected_tokens`` checked)."""
        ids = list(tokens)
        for slot in slots:
            ids[slot.start : slot.start + slot.length] = [self.image_token_id] * slot.length
        return self.attach(where, {'input_ids': ids}, [slot.data for slot in slots])

    def _decode(self, where: str, data: bytes) -> Any:
        """An RGB PIL image of ``data``, within the byte and pixel limits."""
        with self._open(where, data) as image:
            try:
                return image.convert('RGB')
            except (OSError, ValueError) as e:  # a header that reads and pixels that do not
                raise DataError(f'{where} cannot be decoded as an image ({type(e).__name__})') from None

    @contextmanager
    def _open(self, where: str, data: bytes) -> Iterator[Any]:
        """The PIL image of ``data``, its header read (not its pixels), within the byte and pixel limits."""
        from PIL import Image, UnidentifiedImageError

        limits = self.limits
        if len(data) > limits.max_image_bytes:
            raise DataError(f'{where} has {len(data)} bytes, over the limit of {limits.max_image_bytes} per image')
        try:
            image = Image.open(io.BytesIO(data))
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError, ValueError) as e:
            raise DataError(f'{where} cannot be decoded as an image ({type(e).__name__})') from None
        with image:
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise DataError(
                    f'{where} is {width} x {height} = {width * height} pixels, over the limit of '
                    f'{limits.max_image_pixels} per image'
                )
            yield image


def data_url_bytes(where: str, url: str) -> bytes:
    """The bytes of a base64 data URL (``twinkle.wire.ImageURL`` checked its form)."""
    header, _, payload = url.partition(',')
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError):
        raise DataError(f'{where}: the data URL ({header}) is not valid base64') from None


def _pad_runs(ids: Sequence[int], pad: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` of each run of ``pad`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, token in enumerate([*ids, None]):
        if token == pad and start is None:
            start = i
        elif token != pad and start is not None:
            runs.append((start, i))
            start = None
    return runs
