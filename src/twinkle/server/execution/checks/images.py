"""Rows and prompts with images, as the service takes them from the native API (``images``: data
URLs) and the Tinker API (``ImageChunk`` s): checked against the limits, decoded, and turned into
what a vision-language model takes, by the model's own image processor.

A row's ``input_ids`` already hold each image's pad tokens, one per merged patch, in one run per
image (``VisionTemplate`` encodes them so; the Tinker codec writes ``expected_tokens`` of them per
chunk). Where a request is accepted (``ImageRows.check``, which every route that takes images calls,
both APIs, before the request is queued) its images are

1. counted (``Limits.max_images_per_request``);
2. read from their headers, not decoded: bytes (``max_image_bytes``), format (PNG, JPEG, WebP or
   GIF; PIL reads dozens more), one frame, pixels (``max_image_pixels``), and the request's pixels
   together (``max_image_pixels_per_request``: what decoding them costs, in memory one at a time and
   in time all of them);
3. sized as the image processor resizes them: an aspect ratio it takes, at most its ``max_pixels``
   after resizing (the server's ``max_image_resized_pixels`` where lower), and as many tokens as the
   image's run of pad tokens (a Tinker chunk's ``expected_tokens``);
4. decoded whole, one at a time, and let go: a file whose header reads and whose pixels do not (a
   truncated PNG) is a 400 here, not a failed request later.

On the worker (``ImageRows.attach``) each image is decoded again, one at a time, converted to RGB and
resized at once to the processor's size for it, so that at most one full-size image is held (and
its RGB copy); the processor then takes the small images, and gives the pixels it would give the
full-size ones (it resizes with PIL's bicubic filter, as here). The row then has ``pixel_values``,
``image_grid_thw`` and ``mm_token_type_ids``, as the local ``VisionTemplate`` gives them, and no
label of a row is an image token or read off one (``IGNORE_INDEX``).
"""

from __future__ import annotations

import base64
import binascii
import importlib
import io
import json
import math
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError, DataError
from twinkle.server.config import Limits

Json = Any
#: The token an image chunk's positions hold (``tinker_codec``) until ``ImageRows.fill`` puts the
#: model's image pad id there.
IMAGE_SLOT = -1
#: The file formats decoded, by PIL's name (the only decoders a request reaches), as errors name them.
FORMATS = {'PNG': 'PNG', 'JPEG': 'JPEG', 'WEBP': 'WebP', 'GIF': 'GIF'}
#: What PIL's JPEG opener calls a JPEG that carries more pictures (a phone's MPO): its first picture is the JPEG.
MPO = 'MPO'
ACCEPTED_FORMATS = 'PNG, JPEG, WebP or GIF'
#: The longest side over the shortest that Qwen's image processors take: ``smart_resize`` raises a
#: ValueError past it (transformers/models/qwen2_vl/image_processing_pil_qwen2_vl.py, the
#: ``max(height, width) / min(height, width) > 200`` at its start).
MAX_ASPECT_RATIO = 200
#: What PIL raises on a file whose header reads and whose pixels do not (a truncated PNG: OSError;
#: a bad chunk: SyntaxError; cut short inside a structure: struct.error, EOFError).
DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error)
#: ``smart_resize(height, width, factor, min_pixels, max_pixels) -> (height, width)``.
Resize = Callable[..., tuple[int, int]]


@dataclass(frozen=True)
class ImageSlot:
    """An image chunk of a Tinker datum or prompt: its file's bytes and the ``length`` token
    positions from ``start`` it takes (its ``expected_tokens``)."""

    data: bytes
    start: int
    length: int


#: A Tinker prompt's image chunks, in order.
Images = tuple[ImageSlot, ...]


@dataclass(frozen=True)
class RowImages:
    """A row's or prompt's images, as ``ImageRows.check`` takes them from either API: what errors
    call it (``'input row 2'``, ``'datum 0'``), its token ids (each image's run of pad tokens; a
    Tinker chunk's positions hold ``IMAGE_SLOT``) and its image files, in order."""

    where: str
    ids: Sequence[int]
    files: Sequence[bytes]

    @classmethod
    def of_slots(cls, where: str, tokens: Sequence[int], slots: Sequence[ImageSlot]) -> RowImages:
        """A Tinker datum's or prompt's tokens and image chunks."""
        return cls(where, tokens, [slot.data for slot in slots])


@dataclass(frozen=True)
class Header:
    """What an image file's header says, before its pixels are decoded."""

    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


class ImageRows:
    """The images of a vision-language model's rows: its image processor, its image pad token, the
    limits. ``ImageRows.of`` gives None for a model that takes no images."""

    def __init__(self, processor: Any, image_token_id: int, limits: Limits):
        self.processor = processor
        self.image_token_id = image_token_id
        self.merge_size = int(processor.merge_size)
        self.factor = int(processor.patch_size) * self.merge_size  # the side of a merged patch
        self.limits = limits
        own = int(processor.size['longest_edge'])
        cap = limits.max_image_resized_pixels
        #: Pixels of an image after resizing, at most: the processor's, or the server's where lower.
        self.max_pixels = own if cap is None else min(own, cap)
        self.max_pixels_named = (
            "the image processor's max_pixels" if cap is None or own <= cap else 'limits.max_image_resized_pixels'
        )
        self.min_pixels = min(int(processor.size['shortest_edge']), self.max_pixels)
        self._smart_resize = _smart_resize_of(processor)
        self._decoding = threading.Lock()  # one full-size image at a time, the route's checks and the worker's

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

    # ---- where a request is accepted -------------------------------------------------------------
    def check(self, rows: Sequence[RowImages]) -> None:
        """Every limit on a request's images, before it is queued (the module's steps 1 to 4): the
        headers of all first, then each image's size and tokens, then each decoded whole."""
        self.check_count(sum(len(row.files) for row in rows))
        headers = [[self._header(f'{row.where} image {j}', data) for j, data in enumerate(row.files)] for row in rows]
        self._check_total([header for row in headers for header in row])
        for row, sizes in zip(rows, headers, strict=True):
            ids = [self.image_token_id if token == IMAGE_SLOT else token for token in row.ids]
            runs = self._runs(row.where, ids, len(row.files))
            for j, ((start, end), header) in enumerate(zip(runs, sizes, strict=True)):
                where = f'{row.where} image {j}'
                height, width = self.resized(where, header)
                tokens = height * width // self.factor**2
                self._check_tokens(where, end - start, tokens, self._shape(height, width))
        for row in rows:
            for j, data in enumerate(row.files):
                self._verify(f'{row.where} image {j}', data)

    def check_count(self, count: int) -> None:
        """A request's images within ``max_images_per_request``."""
        limit = self.limits.max_images_per_request
        if count > limit:
            raise DataError(
                f'the request holds {count} images, over the limit of {limit} per request '
                '(limits.max_images_per_request)'
            )

    def _check_total(self, headers: Sequence[Header]) -> None:
        total, limit = sum(header.pixels for header in headers), self.limits.max_image_pixels_per_request
        if total > limit:
            raise DataError(
                f"the request's {len(headers)} images are {total} pixels (width x height, before resizing), over "
                f'the limit of {limit} per request (limits.max_image_pixels_per_request)'
            )

    def resized(self, where: str, header: Header) -> tuple[int, int]:
        """The (height, width) the image processor resizes the image to, within its aspect ratio and
        at most ``max_pixels``."""
        width, height = header.width, header.height
        ratio = max(width, height) / min(width, height)
        if ratio > MAX_ASPECT_RATIO:
            raise DataError(
                f'{where} is {width} x {height} pixels, an aspect ratio of {ratio:.1f}, over the limit of '
                f'{MAX_ASPECT_RATIO} of the image processor ({type(self.processor).__name__}); accepted: a long side '
                f'at most {MAX_ASPECT_RATIO} times the short one'
            )
        try:
            size = self._smart_resize(
                height, width, factor=self.factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels
            )
        except ValueError as e:  # a limit of a processor's own beyond the aspect ratio
            raise DataError(f'{where} is {width} x {height} pixels, which the image processor refuses: {e}') from None
        if size[0] * size[1] > self.max_pixels:  # a long, thin image: its short side is held at one merged patch
            raise DataError(
                f'{where} is {width} x {height} pixels, resized to {size[1]} x {size[0]} = {size[0] * size[1]} '
                f'pixels, over the limit of {self.max_pixels} after resizing ({self.max_pixels_named}); accepted: '
                'an image less long and thin, or smaller'
            )
        return size

    # ---- on the worker ----------------------------------------------------------------------------
    def attach(self, where: str, row: dict[str, Json], images: Sequence[bytes]) -> dict[str, Json]:
        """``row`` (``input_ids``, and ``labels`` if it is trained) with its images' pixels, grids and
        image token types; ``where`` names it in errors (``'input row 2'``)."""
        ids: list[int] = row['input_ids']
        runs = self._runs(where, ids, len(images))
        pictures = [self._decode(f'{where} image {j}', data) for j, data in enumerate(images)]
        size = {'shortest_edge': self.min_pixels, 'longest_edge': self.max_pixels}
        pixels = self.processor(images=pictures, size=size, return_tensors='pt')
        grids: list[list[int]] = pixels['image_grid_thw'].tolist()
        for j, ((start, end), grid) in enumerate(zip(runs, grids, strict=True)):
            shape = self._shape(grid[1] * self.processor.patch_size, grid[2] * self.processor.patch_size, grid)
            self._check_tokens(f'{where} image {j}', end - start, math.prod(grid) // self.merge_size**2, shape)
        kinds = [0] * len(ids)
        for start, end in runs:
            kinds[start:end] = [1] * (end - start)
        out = {**row, 'pixel_values': pixels['pixel_values'], 'image_grid_thw': grids, 'mm_token_type_ids': kinds}
        if 'labels' in row:  # pre-shifted: label j is token j + 1; none is an image token, none is read off one
            touches = [a or b for a, b in zip(kinds, [*kinds[1:], 0], strict=True)]
            out['labels'] = [IGNORE_INDEX if t else label for label, t in zip(row['labels'], touches, strict=True)]
        return out

    def fill(self, where: str, tokens: Sequence[int], slots: Sequence[ImageSlot]) -> dict[str, Json]:
        """A Tinker datum's or prompt's row: ``tokens`` with each image chunk's slots holding the
        image pad id, and the images attached (their ``expected_tokens`` checked)."""
        ids = list(tokens)
        for slot in slots:
            ids[slot.start : slot.start + slot.length] = [self.image_token_id] * slot.length
        return self.attach(where, {'input_ids': ids}, [slot.data for slot in slots])

    # ---- the steps ----------------------------------------------------------------------------------
    def _runs(self, where: str, ids: Sequence[int], images: int) -> list[tuple[int, int]]:
        runs = _pad_runs(ids, self.image_token_id)
        if len(runs) != images:
            raise DataError(
                f'{where} has {images} images but {len(runs)} runs of image pad tokens '
                f'(id {self.image_token_id}); each image needs one run, as many pads as its merged patches'
            )
        return runs

    def _shape(self, height: int, width: int, grid: list[int] | None = None) -> str:
        merge = self.merge_size
        patches = f'; a grid of {" x ".join(map(str, grid))} patches, merged {merge} x {merge}' if grid else ''
        return f'resized to {width} x {height} pixels, at most {self.max_pixels} ({self.max_pixels_named}){patches}'

    def _check_tokens(self, where: str, pads: int, tokens: int, shape: str) -> None:
        if pads != tokens:
            raise DataError(f'{where} has {pads} pad tokens, but the image is {tokens} tokens ({shape})')

    def _header(self, where: str, data: bytes) -> Header:
        with self._open(where, data) as (_, header):
            return header

    def _verify(self, where: str, data: bytes) -> None:
        """Decode ``data`` whole (the header alone says nothing of the pixels), and let it go."""
        with self._decoding, self._open(where, data) as (image, _):
            _load(where, image)

    def _decode(self, where: str, data: bytes) -> Any:
        """An RGB PIL image of ``data`` at the size the processor resizes it to: the full-size one
        let go before the next is decoded (``_decoding``)."""
        from PIL import Image

        with self._decoding, self._open(where, data) as (image, header):
            height, width = self.resized(where, header)
            _load(where, image)
            rgb = image if image.mode == 'RGB' else image.convert('RGB')  # the local template's conversion
            resample = Image.Resampling(int(self.processor.resample))  # the processor's own filter
            small = rgb.resize((width, height), resample) if rgb.size != (width, height) else rgb.copy()
            rgb.close()
            return small

    @contextmanager
    def _open(self, where: str, data: bytes) -> Iterator[tuple[Any, Header]]:
        """The PIL image of ``data`` and its header (its pixels not decoded), within the byte and pixel
        limits: an accepted format, one frame."""
        from PIL import Image, UnidentifiedImageError

        limits = self.limits
        if len(data) > limits.max_image_bytes:
            raise DataError(
                f'{where} has {len(data)} bytes, over the limit of {limits.max_image_bytes} per image '
                '(limits.max_image_bytes)'
            )
        try:
            image = Image.open(io.BytesIO(data), formats=list(FORMATS))
        except Image.DecompressionBombError as e:  # PIL's own bound, past twice its MAX_IMAGE_PIXELS
            raise DataError(f'{where} is over the limit of {limits.max_image_pixels} pixels per image: {e}') from None
        except (UnidentifiedImageError, *DECODE_ERRORS):
            raise DataError(f'{where} cannot be decoded as an image: it is not a {ACCEPTED_FORMATS} file') from None
        with image:
            header = Header(*image.size)
            if min(header.width, header.height) < 1:
                raise DataError(f'{where} is {header.width} x {header.height} pixels: it has none')
            if header.pixels > limits.max_image_pixels:
                raise DataError(
                    f'{where} is {header.width} x {header.height} = {header.pixels} pixels, over the limit of '
                    f'{limits.max_image_pixels} per image (limits.max_image_pixels)'
                )
            frames = _frames(where, image)
            if frames > 1 and image.format != MPO:
                raise DataError(
                    f'{where} is an animated {FORMATS[str(image.format)]} of {frames} frames; accepted: a still image'
                )
            yield image, header


def _load(where: str, image: Any) -> None:
    try:
        image.load()
    except DECODE_ERRORS as e:
        raise DataError(f'{where} cannot be decoded as an image: {e or type(e).__name__}') from None


def _frames(where: str, image: Any) -> int:
    """The frames of an image (an animated GIF, PNG or WebP has more than one), read without decoding them."""
    try:
        return int(getattr(image, 'n_frames', 1))
    except DECODE_ERRORS as e:
        raise DataError(f'{where} cannot be decoded as an image: {e or type(e).__name__}') from None


def _smart_resize_of(processor: Any) -> Resize:
    """The processor's own ``smart_resize`` (its module's): the size it resizes an image to."""
    module = importlib.import_module(type(processor).__module__)
    resize: Resize | None = getattr(module, 'smart_resize', None)
    if not callable(resize):
        raise ConfigurationError(
            f'the image processor {type(processor).__name__} has no smart_resize: the service takes images for '
            "Qwen2-VL's family of image processors (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5)"
        )
    return resize


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
