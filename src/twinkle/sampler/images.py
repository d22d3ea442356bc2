"""Prompts with images for the samplers: what a prompt's images are, how a batch of left-padded
prompts sends them to a vision-language model's prefill, and where each row's decode steps sit
in Qwen's multimodal RoPE.

Qwen-VL models (Qwen2-VL to Qwen3.5) place each token at three positions (temporal, height,
width): text tokens at ``p, p, p``, an image's tokens on its 2-D grid, and the text after an
image at one past the largest position the image took. A prompt whose images take fewer
positions than tokens thus ends ``delta`` below its length (``delta <= 0``, transformers'
``rope_deltas``), and every token generated after it sits at ``text position + delta``. The
prefill's positions come from ``twinkle.model.runner.mrope_positions``, the function the trainer
uses, so a sampled completion is scored by the trainer at the positions it was sampled at.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from twinkle.data_format import InputFeature
from twinkle.errors import ConfigurationError, DataError
from twinkle.model.runner import mrope_positions

#: The encoded fields that carry a row's images (``VisionTemplate``'s).
IMAGE_FEATURES = ('pixel_values', 'image_grid_thw', 'mm_token_type_ids')


@dataclass
class PromptImages:
    """One prompt's images as its template encoded them."""

    #: Every image's patches in order: [patches, channels * patch volume].
    pixel_values: torch.Tensor
    #: Each image's (temporal, height, width) patches: [images][3].
    image_grid_thw: list[list[int]]
    #: 1 on each image token of the prompt, else 0: one per prompt token.
    mm_token_type_ids: list[int]


def prompt_images(index: int, row: Mapping[str, Any], input_ids: Sequence[int]) -> PromptImages | None:
    """The images of encoded prompt ``index`` (``None`` when it has no ``pixel_values``), checked
    against its tokens: one type id per token, one grid per run of image tokens, one pixel row
    per patch of the grids."""
    if row.get('pixel_values') is None:
        return None
    missing = [name for name in IMAGE_FEATURES if row.get(name) is None]
    if missing:
        raise DataError(f'prompt {index} has pixel_values but no {missing}: encode it with the VisionTemplate')
    kinds = [int(kind) for kind in row['mm_token_type_ids']]
    grids = torch.as_tensor(row['image_grid_thw'], dtype=torch.long).reshape(-1, 3)
    pixels = torch.as_tensor(row['pixel_values'], dtype=torch.float32)
    if len(kinds) != len(input_ids):
        raise DataError(
            f'prompt {index}: mm_token_type_ids has {len(kinds)} values; '
            f'it must be as long as input_ids ({len(input_ids)})'
        )
    runs = sum(1 for j, kind in enumerate(kinds) if kind == 1 and (j == 0 or kinds[j - 1] != 1))
    if runs != len(grids) or pixels.ndim != 2 or len(pixels) != int(grids.prod(-1).sum()):
        raise DataError(
            f'prompt {index} has {runs} runs of image tokens, {len(grids)} image grids {grids.tolist()} and '
            f'pixel_values of shape {tuple(pixels.shape)}: it needs one grid per run and one pixel row per patch'
        )
    return PromptImages(pixels, grids.tolist(), kinds)


def takes_images(model: PreTrainedModel) -> bool:
    """Whether ``model`` has a vision tower (its config a ``vision_config``): its prompts may hold images."""
    return getattr(model.config, 'vision_config', None) is not None


def placeholder_ids(model: PreTrainedModel) -> list[int]:
    """A vision-language model's image and video pad token ids: placeholders for pixels, never
    sampled (a completion holding one would be a row whose pads have no pixels: the trainer's
    forward refuses it). Empty for a text model."""
    if not takes_images(model):
        return []
    config = model.config
    ids = (getattr(config, name, None) for name in ('image_token_id', 'video_token_id'))
    return sorted({int(token) for token in ids if isinstance(token, int)})


def check_takes_images(model: PreTrainedModel, prompts_with_images: Sequence[int]) -> None:
    """Refuse image prompts for a model without a vision tower (before any compute)."""
    if prompts_with_images and not takes_images(model):
        raise ConfigurationError(
            f'prompts {list(prompts_with_images)} hold images but {type(model).__name__} has no vision tower; '
            'sample them from a vision-language model (a config with a vision_config, e.g. tiny-qwen3.5-vl)'
        )


def with_images(feature: InputFeature, images: PromptImages | None) -> InputFeature:
    """A sampled row (prompt + completion) with the prompt's images, so the trainer's forward sees
    what the sampler's did: the completion's tokens are text (type id 0)."""
    if images is None:
        return feature
    completion = len(feature['input_ids']) - len(images.mm_token_type_ids)
    feature['mm_token_type_ids'] = images.mm_token_type_ids + [0] * completion
    feature['pixel_values'] = images.pixel_values
    feature['image_grid_thw'] = images.image_grid_thw
    return feature


@dataclass
class ImagePrefill:
    """What a batch's prefill forward takes besides the tokens, and each row's RoPE shift."""

    #: Keyword arguments of the prefill forward: the images, and the [4, rows, positions] position ids.
    model_inputs: dict[str, torch.Tensor]
    #: Each row's multimodal position minus its text position after its prompt: [rows, 1].
    deltas: torch.Tensor


def image_prefill(
    model: PreTrainedModel,
    images: Sequence[PromptImages | None],
    ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
) -> ImagePrefill | None:
    """The prefill inputs of left-padded rows ``ids`` (``None`` when no row has images): the rows'
    pixels in row order (the model fills image tokens row after row), and the multimodal positions
    ``mrope_positions`` gives each row alone."""
    if all(image is None for image in images):
        return None
    width = ids.shape[1]
    kinds = torch.zeros_like(ids)
    for row, image in enumerate(images):
        if image is not None:
            kinds[row, width - len(image.mm_token_type_ids) :] = torch.tensor(image.mm_token_type_ids)
    present = [image for image in images if image is not None]
    batch = {
        'input_ids': ids,
        'attention_mask': mask,
        'position_ids': positions,
        'mm_token_type_ids': kinds,
        'pixel_values': torch.cat([image.pixel_values for image in present]).to(ids.device),
        'image_grid_thw': torch.tensor([grid for image in present for grid in image.image_grid_thw], device=ids.device),
    }
    position_ids = mrope_positions(model, batch)
    # transformers' rope_deltas: one past the largest multimodal position, minus the prompt's length.
    deltas = position_ids[1:].amax(dim=(0, 2)) + 1 - mask.sum(-1)
    inputs = {key: batch[key] for key in ('pixel_values', 'image_grid_thw', 'mm_token_type_ids')}
    return ImagePrefill({**inputs, 'position_ids': position_ids}, deltas[:, None])


def decode_positions(text_positions: torch.Tensor, deltas: torch.Tensor | None) -> torch.Tensor:
    """The position ids of one decode step: ``text_positions`` [rows, 1] as they are without
    images, else [4, rows, 1]: the text position, then the multimodal ones shifted by each row's delta."""
    if deltas is None:
        return text_positions
    shifted = (text_positions + deltas)[None].expand(3, -1, -1)
    return torch.cat([text_positions[None], shifted])


__all__ = [
    'IMAGE_FEATURES',
    'ImagePrefill',
    'PromptImages',
    'check_takes_images',
    'decode_positions',
    'image_prefill',
    'prompt_images',
    'takes_images',
    'with_images',
]
