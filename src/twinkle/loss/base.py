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
from typing import Any, ClassVar, Literal

import torch

from twinkle.data_format import IGNORE_INDEX
from twinkle.registry import Registry

#: What a loss reads of the model's output layer: the whole ``logits`` ``[batch, seq, vocab]``, or
#: only each label token's log-probability (``logps`` ``[batch, seq]``), with the entropy of each
#: position's distribution too for ``'logps+entropy'``.
OutputReads = Literal['logits', 'logps', 'logps+entropy']


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
    #: What the loss reads of the output layer (``OutputReads``). A loss that reads no more than
    #: the labels' ``logps`` lets a model built with ``fused_output=True`` compute them in chunks of
    #: tokens, without the ``[batch, seq, vocab]`` logits (``twinkle.model.output.fused``): then
    #: ``outputs`` holds ``logps`` (with gradient, 0 at ignored labels), ``hits`` (the label is the
    #: argmax) and, for ``'logps+entropy'``, ``entropy``, and no ``logits``. It is inherited: a
    #: subclass of such a loss that reads the logits sets ``output_reads = 'logits'`` again.
    output_reads: ClassVar[OutputReads] = 'logits'

    @property
    def reads(self) -> OutputReads:
        """``output_reads``, or the whole logits for a loss that ignores another label id than
        ``IGNORE_INDEX`` (the fused output layer drops that one only)."""
        if getattr(self, 'ignore_index', IGNORE_INDEX) != IGNORE_INDEX:
            return 'logits'
        return self.output_reads

    def __call__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], **kwargs: Any) -> LossOutput:
        raise NotImplementedError


LOSSES: Registry[Loss] = Registry('loss')
