"""Where a model's weights come from and where they run: a Hugging Face causal LM loaded from a
hub id or a directory (or built from a config with random weights), its device and its precision.
A vision-language checkpoint (Qwen3.5's ``Qwen3_5ForConditionalGeneration``, Qwen3-VL's) loads as
the class its config names, vision tower included, not as its text-only causal LM.

``TransformersModel`` and ``TorchSampler`` load their models here, so both read a model id, a
model class and a config the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, cast

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from twinkle.errors import ConfigurationError
from twinkle.hub import resolve_model

#: ``mixed_precision``: forwards under bfloat16 autocast, or in the weights' own dtype.
Precision = Literal['no', 'bf16']


def load_causal_lm(
    owner: str,
    model_id: str | None,
    model_cls: type[PreTrainedModel] | None,
    config: PretrainedConfig | None,
    **kwargs: Any,
) -> PreTrainedModel:
    """The model ``model_id`` names (``ms://``, ``hf://`` or a directory) loaded with
    ``model_cls`` (by default ``auto_model_class`` of its config), else one built from ``config``
    with random weights; ``kwargs`` go to ``from_pretrained`` (or the config constructor): ``dtype``,
    ``attn_implementation``... ``owner`` names the component in the error when both are missing."""
    if model_id is not None:
        path = resolve_model(model_id)
        return (model_cls or auto_model_class(AutoConfig.from_pretrained(path))).from_pretrained(path, **kwargs)
    if config is None:
        raise ConfigurationError(f'{owner} needs a model_id or a config')
    # transformers leaves both unannotated; each returns the model the config describes. A model
    # class has no public from_config: _from_config is what the Auto class calls.
    from_config = auto_model_class(config).from_config if model_cls is None else model_cls._from_config
    return cast(Callable[..., PreTrainedModel], from_config)(config, **kwargs)


def auto_model_class(config: PretrainedConfig) -> Any:
    """``AutoModelForImageTextToText`` for a vision-language config (one whose ``architectures``
    names that mapping's class for its model type, e.g. ``Qwen3_5ForConditionalGeneration``, or
    with none named, one with a ``vision_config``), else ``AutoModelForCausalLM``. transformers maps
    ``qwen3_5`` to its text-only ``Qwen3_5ForCausalLM`` too, which would drop the vision tower."""
    vlm_class = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type)
    named = getattr(config, 'architectures', None) or []
    if vlm_class is not None and (vlm_class in named or (not named and hasattr(config, 'vision_config'))):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each layer in the backward instead of keeping its activations (torch's
    non-reentrant checkpointing), with the embeddings' output requiring grad, as transformers
    asks when the base weights are frozen (adapters)."""
    # transformers leaves both unannotated; both return nothing.
    enable = cast(Callable[..., None], model.gradient_checkpointing_enable)
    enable(gradient_checkpointing_kwargs={'use_reentrant': False})
    cast(Callable[[], None], model.enable_input_require_grads)()


def compile_blocks(model: PreTrainedModel) -> int:
    """Compile each of the model's repeated blocks (``_no_split_modules``: the decoder layers, and
    a vision tower's blocks) in place with ``torch.compile`` (regional compilation: one block's
    code serves every block of its class, so the first step compiles one layer, not the whole
    model), with dynamic shapes, so that a new row length does not compile again. Parameter names,
    adapters and checkpoints are unchanged. Returns how many blocks were compiled."""
    config = getattr(model, 'config', None)
    layer_types = getattr(config.get_text_config(), 'layer_types', None) if config is not None else None
    if 'linear_attention' in (layer_types or []):
        # sft_speed on tiny-qwen3.5: InductorError "cannot determine truth value of Relational" in the
        # gated delta rule's padding to its chunk size, under dynamic shapes (torch 2.13).
        raise ConfigurationError(
            f'{type(model).__name__} has linear-attention layers, which torch.compile fails to compile with '
            'dynamic shapes here; load it with compile_layers=False'
        )
    names = set(getattr(model, '_no_split_modules', None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise ConfigurationError(
            f'{type(model).__name__} names no repeated blocks (_no_split_modules); load it with compile_layers=False'
        )
    for block in blocks:
        block.compile(dynamic=True)
    return len(blocks)


def resolve_device(device: str | torch.device | None, mesh_device: torch.device | None = None) -> torch.device:
    """The given device, else the mesh's for this rank (``mesh_device``), else CUDA when there is one."""
    if device is None:
        return mesh_device or torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    device = torch.device(device)
    if mesh_device is not None and device.type != mesh_device.type:
        raise ConfigurationError(
            f'device={str(device)!r} does not match the mesh device_type={mesh_device.type!r}; '
            f'leave device out to use {str(mesh_device)!r}'
        )
    return device


def default_precision(device: torch.device) -> Precision:
    """bf16 autocast on a GPU that supports it; the weights' own dtype elsewhere (a CPU)."""
    return 'bf16' if device.type == 'cuda' and torch.cuda.is_bf16_supported() else 'no'


__all__ = [
    'Precision',
    'auto_model_class',
    'compile_blocks',
    'default_precision',
    'enable_gradient_checkpointing',
    'load_causal_lm',
    'resolve_device',
]
