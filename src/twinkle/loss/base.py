"""The loss interface.

A loss returns the **sum** of its per-item terms and the number of items it averaged over.
The model adds the sums of every micro-batch of an optimizer step and divides the gradient by
the total count once, before clipping and stepping. That makes gradient accumulation exact:
k micro-batches then a step give the gradient of one batch k times as large, even when the
micro-batches hold different numbers of tokens (the normalisation torchtune and the Hugging
Face trainer converged on; dividing each micro-batch by its own count is only approximately
right).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle.registry import Registry


@dataclass
class LossOutput:
    #: Sum of the loss terms of this micro-batch (a scalar tensor that requires grad).
    loss: torch.Tensor
    #: The count the sum is divided by at the optimizer step (tokens, sequences, or 1).
    num_items: torch.Tensor
    #: Detached statistics for metrics (``GRPOMetric`` reads these): sums and counts as 0-d
    #: tensors, so that metrics stay exact across micro-batches and never sync the device.
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class Loss:
    """Base class. ``inputs`` is the collated batch (``input_ids``, ``labels``, ... as tensors),
    ``outputs`` holds ``logits`` ``[batch, seq, vocab]``; extra keyword arguments are the
    per-call loss inputs a caller passed to ``forward_backward``.

    A loss that sets ``needs_reference`` gets ``outputs['ref_logps']`` from the model: the
    log-probability ``[batch, seq]`` of each label token under the base model with the adapter
    switched off (0 where the label is ignored), unless the caller passed ``ref_logps=``."""

    needs_reference: bool = False
    #: A loss that sets ``needs_values`` reads ``outputs['values']`` ``[batch, seq]``: it trains a
    #: critic, an adapter with a value head (``add_adapter_to_model(..., value_head=True)``).
    needs_values: bool = False

    def __call__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], **kwargs: Any) -> LossOutput:
        raise NotImplementedError


LOSSES: Registry[Loss] = Registry('loss')
