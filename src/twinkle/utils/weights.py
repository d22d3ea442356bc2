"""Naming model tensors the same way with or without PEFT wrapping."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_PEFT_PREFIX = 'base_model.model.'


def canonical_name(name: str) -> str:
    """``name`` as the plain model calls it: PEFT's ``base_model.model.`` prefix and the
    ``.base_layer`` of LoRA-wrapped modules removed.

    >>> canonical_name('base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight')
    'model.layers.0.self_attn.q_proj.weight'
    """
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    return name.replace('.base_layer.', '.')


def vocab_size(model: PreTrainedModel) -> int:
    """How many token ids ``model`` embeds (the rows of its input embedding): valid ids are
    ``[0, vocab_size)``."""
    return model.get_input_embeddings().get_parameter('weight').shape[0]
