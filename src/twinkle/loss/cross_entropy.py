from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError, DataError, one_of
from twinkle.loss.base import LOSSES, Loss, LossOutput


@LOSSES.register
class CrossEntropyLoss(Loss):
    """Next-token cross-entropy on the pre-shifted ``labels``.

    ``reduction='mean'`` (default) averages over every trained token of the optimizer step,
    across all its micro-batches: long sequences weigh more than short ones, as in plain SFT.
    ``reduction='sum'`` sums over tokens (the Tinker convention). Logits are upcast to float32
    before the softmax.

    Example: logits that put probability 1/2 on the label at each of 3 trained tokens give a
    mean loss of ``ln 2`` and a sum of ``3 ln 2``.
    """

    output_reads = 'logps'

    def __init__(self, reduction: Literal['mean', 'sum'] = 'mean', ignore_index: int = IGNORE_INDEX):
        if reduction not in ('mean', 'sum'):
            raise one_of('CrossEntropyLoss reduction', reduction, ['mean', 'sum'])
        self.reduction = reduction
        self.ignore_index = ignore_index

    def __call__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], **kwargs: Any) -> LossOutput:
        if kwargs:
            raise ConfigurationError(f'CrossEntropyLoss takes no loss arguments; got {sorted(kwargs)}')
        labels = inputs['labels']
        loss = self._summed(outputs, labels)
        if self.reduction == 'mean':
            count = (labels != self.ignore_index).sum()
        else:
            count = torch.ones((), dtype=torch.long, device=labels.device)
        return LossOutput(loss=loss, num_items=count)

    def _summed(self, outputs: dict[str, Any], labels: torch.Tensor) -> torch.Tensor:
        """The summed cross entropy: of the fused output layer's label logprobs (``outputs['logps']``,
        0 at ignored labels), else of the logits."""
        if 'logps' in outputs:
            if outputs['logps'].shape != labels.shape:
                raise DataError(f'logps {tuple(outputs["logps"].shape)} do not match labels {tuple(labels.shape)}')
            logps: torch.Tensor = outputs['logps']
            return -logps.sum()
        logits = outputs['logits']
        if logits.shape[:-1] != labels.shape:
            raise DataError(f'logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}')
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=self.ignore_index,
            reduction='sum',
        )
