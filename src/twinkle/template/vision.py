"""Conversations with images: token ids, labels, and the pixels and grids a vision tower takes.

An image is a content part of a message, in Qwen-VL's form or OpenAI's::

    {'type': 'image', 'image': '/data/cat.png'}      # a local path, bytes, or a PIL.Image
    {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,iVBOR...'}}

The chat template renders each image as ``<|vision_start|><|image_pad|><|vision_end|>``; the
model's image processor (``AutoImageProcessor`` from the model folder) turns the images into
``pixel_values`` (one row per patch, every image's patches in order) and ``image_grid_thw`` (each
image's temporal, height and width patches). Each image's one ``<|image_pad|>`` is then repeated
``t * h * w // merge_size**2`` times, one token per merged patch, which is what Qwen's processors
(``Qwen2VLProcessor``, ``Qwen3VLProcessor``) do. The project expands the tokens itself rather than
calling ``AutoProcessor``: transformers' Qwen3-VL processor always builds its video processor,
which needs torchvision, and torchvision cannot be installed beside the CPU torch the project pins;
the image processor alone (its PIL backend) needs nothing more. ``tests/model/test_vlm_training.py``
checks the expansion against the count the grid gives.

Image tokens are never trained on: their labels are ``IGNORE_INDEX``. A row's ``mm_token_type_ids``
is 1 on its image tokens (transformers' multimodal RoPE reads it to place each image in 2-D).
Remote images (``http://``, ``https://``) are refused: nothing is fetched while training.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from twinkle.data_format import IGNORE_INDEX, InputFeature, Message, Trajectory
from twinkle.data_format.images import ACCEPTED_IMAGES, has_images, image_value, is_image_part
from twinkle.errors import ConfigurationError, DataError, SequenceTooLongError
from twinkle.template.base import TEMPLATES, Template, _tools, encoded_feature

IMAGE_PAD = '<|image_pad|>'


@TEMPLATES.register
class VisionTemplate(Template):
    """A ``Template`` that also takes images (see the module docstring), for Qwen-VL-style models
    (Qwen2-VL to Qwen3.5): an image processor whose output has ``image_grid_thw`` and a
    ``merge_size``, and an ``<|image_pad|>`` token.

    Example::

        template = VisionTemplate(tiny_model('tiny-qwen3.5-vl'))
        question = [{'type': 'image', 'image': 'cat.png'}, {'type': 'text', 'text': 'What is it?'}]
        feature = template.encode({'messages': [{'role': 'user', 'content': question},
                                                {'role': 'assistant', 'content': 'A cat.'}]})
        # feature['pixel_values'] [patches, 3 * 2 * 16 * 16], feature['image_grid_thw'] [[1, 4, 4]]
    """

    takes_images = True

    def __init__(self, model_id: str, image_processor: Any = None, **kwargs: Any):
        super().__init__(model_id, **kwargs)
        self.image_processor = image_processor if image_processor is not None else load_image_processor(model_id)
        self.merge_size: int = int(getattr(self.image_processor, 'merge_size', 0) or 0)
        if self.merge_size < 1:
            raise ConfigurationError(
                f'the image processor of {model_id!r} ({type(self.image_processor).__name__}) has no merge_size; '
                'VisionTemplate takes Qwen-VL-style image processors (Qwen2VLImageProcessor)'
            )
        self.image_token_id: int = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if self.image_token_id is None or self.image_token_id == self.tokenizer.unk_token_id:
            raise ConfigurationError(f'the tokenizer of {model_id!r} has no {IMAGE_PAD} token')

    def encode(self, row: Mapping[str, Any], add_generation_prompt: bool = False) -> InputFeature | None:
        """``Template.encode``, and for a row with images its ``pixel_values``, ``image_grid_thw``
        and ``mm_token_type_ids``, each image's pad token repeated once per merged patch."""
        if 'messages' not in row or not isinstance(row['messages'], list) or not has_images(row['messages']):
            return super().encode(row, add_generation_prompt)
        messages, pictures = split_images(row['messages'])
        messages = self._messages({'messages': messages})
        ids, trained = self._encode_messages(messages, add_generation_prompt, _tools(row))
        pixels = self.image_processor(images=pictures, return_tensors='pt')
        grids: list[list[int]] = pixels['image_grid_thw'].tolist()
        ids, trained, image_mask = self._expand(ids, trained, grids)
        kept = self._truncate_images(ids, trained, image_mask)
        if kept is None:
            return None
        feature = encoded_feature(kept[0], kept[1])
        feature['labels'] = [IGNORE_INDEX if m else label for label, m in zip(feature['labels'], kept[2], strict=True)]
        feature['completion_mask'] = [int(label != IGNORE_INDEX) for label in feature['labels']]
        feature['mm_token_type_ids'] = kept[2]
        feature['pixel_values'] = pixels['pixel_values']
        feature['image_grid_thw'] = grids
        if 'user_data' in row:
            feature['user_data'] = row['user_data']
        return feature

    def batch_encode(
        self, rows: Sequence[Trajectory | Mapping[str, Any]], add_generation_prompt: bool = False
    ) -> list[InputFeature]:
        """``Template.batch_encode``; a row's bad image is reported with the row's index."""
        out = []
        for index, row in enumerate(rows):
            try:
                feature = self.encode(row, add_generation_prompt)
            except DataError as e:
                raise type(e)(f'row {index}: {e}') from e
            if feature is not None:
                out.append(feature)
        return out

    def _expand(
        self, ids: list[int], trained: list[bool], grids: list[list[int]]
    ) -> tuple[list[int], list[bool], list[int]]:
        """Each image's single pad token repeated ``t * h * w // merge_size**2`` times (untrained),
        and the 0/1 mask of image tokens."""
        pads = [i for i, token in enumerate(ids) if token == self.image_token_id]
        if len(pads) != len(grids):
            raise ConfigurationError(
                f'the chat template of {self.model_id!r} rendered {len(pads)} {IMAGE_PAD} tokens for '
                f'{len(grids)} images: it must render each image part as one {IMAGE_PAD}'
            )
        out_ids: list[int] = []
        out_trained: list[bool] = []
        mask: list[int] = []
        cursor = 0
        for at, (t, h, w) in zip(pads, grids, strict=True):
            count = t * h * w // self.merge_size**2
            out_ids += ids[cursor:at] + [self.image_token_id] * count
            out_trained += trained[cursor:at] + [False] * count
            mask += [0] * (at - cursor) + [1] * count
            cursor = at + 1
        rest = len(ids) - cursor
        return out_ids + ids[cursor:], out_trained + trained[cursor:], mask + [0] * rest

    def _truncate_images(
        self, ids: list[int], trained: list[bool], mask: list[int]
    ) -> tuple[list[int], list[bool], list[int]] | None:
        """``_truncate`` that keeps every image whole: a cut through an image's tokens would leave
        pixels without their tokens, so such a row raises ``SequenceTooLongError``."""
        limit = self.max_length
        if limit is None or len(ids) <= limit or self.truncation_strategy in ('raise', 'delete'):
            kept = self._truncate(ids, trained)
            return None if kept is None else (*kept, mask)
        cut = slice(-limit, None) if self.truncation_strategy == 'left' else slice(None, limit)
        if sum(mask[cut]) != sum(mask):
            raise SequenceTooLongError(
                f'an encoded row with images has {len(ids)} tokens, over max_length={limit}, and '
                f'{self.truncation_strategy} truncation would cut through an image; raise max_length, or '
                "set truncation_strategy to 'raise' or 'delete'"
            )
        return ids[cut], trained[cut], mask[cut]


def split_images(messages: list[Any]) -> tuple[list[Message], list[Any]]:
    """The messages with each image part replaced by ``{'type': 'image'}`` (what the chat template
    renders) and a text-only parts list joined into one string (as the templates render it), and the
    images as RGB ``PIL.Image``s in the order the template renders them (message by message)."""
    pictures: list[Any] = []
    out: list[Message] = []
    for m_index, message in enumerate(messages):
        content = message.get('content') if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[Any] = []
        for p_index, part in enumerate(content):
            if is_image_part(part):
                where = f'message {m_index}, part {p_index}'
                pictures.append(load_image(image_value(part, where), where))
                parts.append({'type': 'image'})
            else:
                parts.append(part)
        text_only = all(isinstance(p, Mapping) and p.get('type', 'text') == 'text' for p in parts)
        rendered = ''.join(str(p.get('text', '')) for p in parts) if text_only else parts
        out.append(cast(Message, {**message, 'content': rendered}))  # checked by Template._messages
    return out, pictures


def load_image(value: Any, where: str) -> Any:
    """An RGB ``PIL.Image`` from a local path (or ``file://`` URL), bytes, a data URL, a PIL image,
    or ``{'bytes': ..., 'path': ...}`` (a ``datasets.Image`` value); ``where`` names the part in errors."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert('RGB')
    if isinstance(value, Mapping) and ('bytes' in value or 'path' in value):
        value = value.get('bytes') or value.get('path')
    source: Any
    if isinstance(value, bytes | bytearray):
        source = io.BytesIO(bytes(value))
    elif isinstance(value, str | os.PathLike):
        source = _local_source(str(value), where)
    else:
        raise DataError(
            f'{where}: an image of type {type(value).__name__} is not accepted; accepted: {ACCEPTED_IMAGES}'
        )
    try:
        with Image.open(source) as image:
            return image.convert('RGB')
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f'{where}: the image cannot be decoded ({e})') from e


def _local_source(value: str, where: str) -> Any:
    lowered = value[:16].lower()
    if lowered.startswith(('http://', 'https://')):
        raise DataError(
            f'{where}: remote image {value[:80]!r} refused: images are not fetched while training (offline); '
            f'download it first. Accepted: {ACCEPTED_IMAGES}'
        )
    if lowered.startswith('data:'):
        header, _, payload = value.partition(',')
        if not header.endswith(';base64'):
            raise DataError(f'{where}: a data URL must be base64 (data:image/png;base64,...); got {header!r}')
        try:
            return io.BytesIO(base64.b64decode(payload, validate=True))
        except binascii.Error as e:
            raise DataError(f'{where}: the data URL is not valid base64 ({e})') from e
    path = Path(value[len('file://') :] if lowered.startswith('file://') else value)
    if not path.is_file():
        raise DataError(f'{where}: image file {str(path)!r} does not exist; accepted: {ACCEPTED_IMAGES}')
    return path


def load_image_processor(model_id: str) -> Any:
    """The image processor of a model id (``ms://``, ``hf://`` or a local directory)."""
    from transformers import AutoImageProcessor

    from twinkle.hub import resolve_model

    path = resolve_model(model_id)
    if not os.path.isfile(os.path.join(path, 'preprocessor_config.json')):
        raise ConfigurationError(f'model {model_id!r} ({path}) has no preprocessor_config.json: it takes no images')
    return AutoImageProcessor.from_pretrained(path)  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
