"""What ``vLLMSampler`` does for a vision-language model's prompts: each image as the 8-bit
picture its ``pixel_values`` were made from and one pad token (vLLM's processor makes the pixels
and the pads again), the engine's per-prompt image limit, adapters on the vision tower refused, and
why vLLM's CPU build cannot load Qwen3-VL or Qwen3.5 (torchvision)."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from twinkle.errors import ConfigurationError, DataError, MissingExtraError
from twinkle.sampler.base import Prompt
from twinkle.sampler.images import PromptImages

#: Images one prompt may hold when ``engine_args`` set no ``limit_mm_per_prompt`` (vLLM sizes its
#: encoder cache for this many).
DEFAULT_IMAGES_PER_PROMPT = 8
#: Weights of a vision tower (Qwen-VL's ``model.visual``, and the names other VLMs give theirs).
_TOWER = re.compile(r'(^|\.)(visual|vision_tower|vision_model)\.')
#: How far a prompt's ``pixel_values`` may be from those of the 8-bit picture rebuilt from them.
PIXEL_TOL = 1e-4
#: Why vLLM's CPU build cannot load Qwen3-VL and Qwen3.5 code here, added to the import error.
TORCHVISION_NOTE = (
    "vLLM's Qwen3-VL code, which its Qwen3.5 code imports, imports transformers' image processors, which need "
    "torchvision, and PyPI's torchvision wheels are built for CUDA torch: beside vLLM's CPU build they fail with "
    "'operator torchvision::nms does not exist' (`make setup-vllm` installs torchvision's Python code beside the "
    "CPU torch); or sample this model with TorchSampler (images included), or with vLLM's CUDA build"
)


def image_limit(args: Mapping[str, Any]) -> int:
    """The images one prompt may hold under ``limit_mm_per_prompt`` (a count, or vLLM's
    ``{'count': n, ...}``); 0 when it names none.

    >>> image_limit({'limit_mm_per_prompt': {'image': {'count': 3, 'width': 64}}})
    3
    """
    limit = dict(args.get('limit_mm_per_prompt') or {}).get('image', 0)
    return int(limit['count'] if isinstance(limit, Mapping) else limit)


def check_model_code(architectures: Iterable[str], error: Exception | None) -> None:
    """Import vLLM's code for each architecture, which vLLM does in a subprocess or a worker that
    reports only that the architecture 'failed to be inspected', and raise ``MissingExtraError``
    with the import error of the first that fails, from ``error`` (what vLLM raised, if it was
    started); none fails: return."""
    from vllm import ModelRegistry

    for architecture in architectures:
        module = getattr(ModelRegistry.models.get(architecture), 'module_name', None)
        if module is None:
            continue
        try:
            importlib.import_module(module)
        except (ImportError, OSError, RuntimeError) as failure:
            note = f'; {TORCHVISION_NOTE}' if 'torchvision' in str(failure) else ''
            raise MissingExtraError(
                f'vLLM cannot load its code for {architecture} ({module}): {type(failure).__name__}: {failure}{note}'
            ) from error


def torchvision_error() -> str | None:
    """Why ``torchvision`` does not load here (``None``: it loads)."""
    try:
        importlib.import_module('torchvision')
    except (ImportError, OSError, RuntimeError) as error:
        return f'{type(error).__name__}: {error}'
    return None


def refuse_tower(adapter_name: str, keys: Iterable[str]) -> None:
    """Refuse an adapter with weights on the vision tower: vLLM's LoRA adapts the language model's
    layers, and would serve such an adapter with its tower part left out."""
    tower = sorted(key for key in keys if _TOWER.search(key))
    if tower:
        raise ConfigurationError(
            f'adapter {adapter_name!r} adapts the vision tower ({len(tower)} weights, e.g. {tower[0]!r}); vLLM '
            "serves LoRA on the language model's layers only: sample it with TorchSampler, sync merged weights "
            "(merge_and_sync=True), or train the language model's layers only (target_modules='all-linear')"
        )


def check_image_counts(prompts: Iterable[Prompt], limit: int, takes_images: bool) -> None:
    """Refuse prompts with images for a model without a vision tower, and prompts with more images
    than the engine's ``limit_mm_per_prompt`` (vLLM sized its encoder cache for that many)."""
    counted = [(index, len(p.images.image_grid_thw)) for index, p in enumerate(prompts) if p.images is not None]
    if counted and not takes_images:
        raise ConfigurationError(
            f'prompts {[index for index, _ in counted]} hold images but the sampler model has no vision tower; '
            'sample them from a vision-language model (a config with a vision_config, e.g. tiny-qwen3-vl)'
        )
    for index, count in counted:
        if count > limit:
            raise DataError(
                f'prompt {index} has {count} images, over the engine limit of {limit} per prompt; build the '
                f"sampler with engine_args={{'limit_mm_per_prompt': {{'image': {count}}}}} or more"
            )


def collapse_images(index: int, input_ids: list[int], images: PromptImages, merge_size: int) -> list[int]:
    """``input_ids`` with each image's run of tokens as its first token alone (what vLLM's
    processor expands), checking each run against the count its grid gives: ``t * h * w // merge_size**2``."""
    out: list[int] = []
    runs: list[int] = []
    previous = 0
    for token, kind in zip(input_ids, images.mm_token_type_ids, strict=True):
        if kind != 1:
            out.append(token)
        elif previous != 1:
            out.append(token)
            runs.append(1)
        else:
            runs[-1] += 1
        previous = kind
    expected = [t * h * w // merge_size**2 for t, h, w in images.image_grid_thw]
    if runs != expected:
        raise DataError(
            f'prompt {index} has runs of {runs} image tokens for image grids {images.image_grid_thw}, which take '
            f'{expected} tokens (t * h * w // {merge_size}**2)'
        )
    return out


def pictures(index: int, images: PromptImages, processor: Any) -> list[Any]:
    """Each image of a prompt as the RGB ``PIL.Image`` its ``pixel_values`` were made from, undoing the
    image processor's normalisation and Qwen-VL's patch order. The picture is 8-bit: the pixels it
    gives again must be the prompt's (within ``PIXEL_TOL``), else the prompt is refused, since vLLM
    would see other pixels than the trainer."""
    from PIL import Image

    patch, frames, merge = int(processor.patch_size), int(processor.temporal_patch_size), int(processor.merge_size)
    scale = float(processor.rescale_factor) if processor.do_rescale else 1.0
    normal = processor.do_normalize
    mean = torch.tensor(processor.image_mean if normal else [0.0] * 3, dtype=torch.float64).view(3, 1, 1)
    std = torch.tensor(processor.image_std if normal else [1.0] * 3, dtype=torch.float64).view(3, 1, 1)
    out, first = [], 0
    for number, (t, h, w) in enumerate(images.image_grid_thw):
        rows = images.pixel_values[first : first + t * h * w].double()
        first += t * h * w
        if t != 1:
            raise DataError(
                f'prompt {index}, image {number} has grid {[t, h, w]}: a picture has t = 1 (t > 1 is a video)'
            )
        # rows: (h/m, w/m, m, m) patches of (channels, frames, patch, patch) values.
        grid = rows.reshape(h // merge, w // merge, merge, merge, 3, frames, patch, patch)
        planes = grid.permute(4, 5, 0, 2, 6, 1, 3, 7).reshape(3, frames, h * patch, w * patch)
        values = ((planes[:, 0] * std + mean) / scale).round().clamp(0, 255)
        gap = float((((values * scale - mean) / std)[:, None] - planes).abs().max())
        if gap > PIXEL_TOL:
            raise DataError(
                f'prompt {index}, image {number}: its pixel_values are not those of an 8-bit picture (off by '
                f"{gap:.3g}): vLLM makes the pixels from pictures, so it takes images the model's image processor made"
            )
        out.append(Image.fromarray(values.permute(1, 2, 0).to(torch.uint8).numpy()))
    return out
