"""The critic's loss of PPO: values regressed onto returns, with PPO's value clipping."""

from __future__ import annotations

from typing import Any

import torch

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError, DataError, StateError
from twinkle.loss.base import LOSSES, Loss, LossOutput
from twinkle.loss.rl import align_per_token, check_loss_kwargs, is_finite_number, sequence_index


@LOSSES.register
class ValueLoss(Loss):
    """Clipped value loss of PPO (Schulman et al. 2017, arXiv:1707.06347, as in its reference
    implementation, OpenAI baselines' ``ppo2``). Per trained (labelled) token::

        term = max((V - R)^2, (clip(V, V_old - value_clip, V_old + value_clip) - R)^2) / 2

    summed over tokens and counted per token (``num_items`` = trained tokens, so the step divides
    by the tokens of all its micro-batches). The clip keeps one update from moving a value far
    from the one the returns were computed with, as the policy's ratio clip does.

    Loss inputs, per sequence in batch order (or ``[batch, seq]`` tensors, see ``twinkle.loss.rl``):

    - ``returns`` (required): the regression targets, per completion token (GAE's returns,
      ``twinkle.advantage.per_token``) or one number per sequence;
    - ``old_values``: the values the returns were computed with, per completion token. Left out,
      or ``value_clip=None``: the plain squared error ``(V - R)^2 / 2``.

    It reads ``outputs['values']``, so the adapter needs a value head (``set_loss`` refuses one
    without). Example: ``V = 0.5``, ``V_old = 0``, ``R = 1``, ``value_clip=0.2``: the clipped
    value is 0.2, so ``term = max(0.25, 0.64) / 2 = 0.32``.

    ``metrics``: ``tokens``, ``value_error`` (sum of ``(V - R)^2``), ``value_clipped`` (tokens
    whose clipped branch is the larger one).
    """

    output_reads = 'logps'

    needs_values = True
    loss_inputs = ('returns', 'old_values')

    def __init__(self, value_clip: float | None = 0.2, ignore_index: int = IGNORE_INDEX):
        if value_clip is not None and (not is_finite_number(value_clip) or value_clip < 0):
            raise ConfigurationError(
                f'ValueLoss value_clip must be a finite number >= 0, or None (no clip); got {value_clip!r}'
            )
        self.value_clip = None if value_clip is None else float(value_clip)
        self.ignore_index = ignore_index

    def __call__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], **kwargs: Any) -> LossOutput:
        check_loss_kwargs('ValueLoss', kwargs, self.loss_inputs)
        values_BS = outputs.get('values')
        if values_BS is None:
            raise StateError(
                "ValueLoss needs the critic's values (outputs['values']): train an adapter added with value_head=True"
            )
        if kwargs.get('returns') is None:
            raise DataError('ValueLoss needs returns=: per sequence, one target per completion token (or one number)')
        mask_BS = inputs['labels'] != self.ignore_index
        seq_index_BS = sequence_index(inputs)
        returns_BS = align_per_token(kwargs['returns'], mask_BS, seq_index_BS, 'returns')
        error_BS = (values_BS - returns_BS).square()
        term_BS, clipped_BS = error_BS, torch.zeros_like(mask_BS)
        old = kwargs.get('old_values')
        if old is not None and self.value_clip is not None:
            old_BS = align_per_token(old, mask_BS, seq_index_BS, 'old_values', allow_scalar=False)
            kept_BS = old_BS + (values_BS - old_BS).clamp(-self.value_clip, self.value_clip)
            clipped_error_BS = (kept_BS - returns_BS).square()
            term_BS = torch.maximum(error_BS, clipped_error_BS)
            clipped_BS = clipped_error_BS > error_BS
        term_BS = torch.where(mask_BS, term_BS, 0.0)
        metrics = {
            'tokens': mask_BS.sum(),
            'value_error': torch.where(mask_BS, error_BS, 0.0).detach().sum(),
            'value_clipped': (clipped_BS & mask_BS).sum(),
        }
        return LossOutput(loss=0.5 * term_BS.sum(), num_items=mask_BS.sum(), metrics=metrics)


__all__ = ['ValueLoss']
