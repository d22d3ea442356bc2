"""Direct Preference Optimization on interleaved (chosen, rejected) pairs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError, DataError, StateError, one_of
from twinkle.loss.base import LOSSES, Loss, LossOutput
from twinkle.loss.rl import TokenGrid, check_loss_kwargs, is_finite_number, output_grid, reference_logps

DPOType = Literal['sigmoid', 'ipo', 'hinge']


def _sigmoid(h_P: torch.Tensor, beta: float, smoothing: float) -> torch.Tensor:
    # DPO eq. 7; with label smoothing, conservative DPO (the label is flipped with probability eps).
    return -(1 - smoothing) * F.logsigmoid(beta * h_P) - smoothing * F.logsigmoid(-beta * h_P)


def _ipo(h_P: torch.Tensor, beta: float, smoothing: float) -> torch.Tensor:
    # IPO (Azar et al. 2023, arXiv:2310.12036, eq. 17): regress the margin onto 1 / (2 beta).
    return (h_P - 1 / (2 * beta)) ** 2


def _hinge(h_P: torch.Tensor, beta: float, smoothing: float) -> torch.Tensor:
    # SLiC-HF (Zhao et al. 2023, arXiv:2305.10425): hinge on the scaled margin.
    return torch.relu(1 - beta * h_P)


_DPO_LOSSES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    'sigmoid': _sigmoid,
    'ipo': _ipo,
    'hinge': _hinge,
}


@LOSSES.register
class DPOLoss(Loss):
    """Direct Preference Optimization (Rafailov et al. 2023, arXiv:2305.18290, eq. 7).

    The sequences of a batch come in pairs, ``[chosen_0, rejected_0, chosen_1, rejected_1, ...]``
    (rows when padded, sequences when packed). With ``pc, pr`` the summed log-probabilities of
    the completion tokens of the chosen and rejected sequences under the policy, and ``rc, rr``
    under the reference, the margin is ``h = (pc - rc) - (pr - rr)`` and per pair::

        sigmoid:  -(1 - ls) * log sigmoid(beta * h) - ls * log sigmoid(-beta * h)
        ipo:      (h - 1 / (2 * beta)) ** 2
        hinge:    max(0, 1 - beta * h)

    summed over pairs, ``num_items`` = pairs. ``reference_free=True`` sets ``rc = rr = 0``.

    Reference log-probabilities, first found wins: ``ref_chosen_logps=`` and
    ``ref_rejected_logps=`` (one sum per pair each); ``ref_logps=`` (per sequence, a sum or a
    list of per-token values, or a ``[batch, seq]`` tensor); otherwise the model's
    ``outputs['ref_logps']`` (the base model with the adapter off).

    Example: policy and reference equal (``h = 0``) give ``ln 2`` per pair with ``'sigmoid'``.

    ``metrics``: ``pairs``, ``reward_accuracy`` (pairs with ``h > 0``), ``margin`` (sum of the
    implicit reward margins ``beta * h``).
    """

    output_reads = 'logps'

    loss_inputs = ('ref_logps', 'ref_chosen_logps', 'ref_rejected_logps')

    def __init__(
        self,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        loss_type: DPOType = 'sigmoid',
        reference_free: bool = False,
        ignore_index: int = IGNORE_INDEX,
    ):
        if not is_finite_number(beta) or beta <= 0:
            raise ConfigurationError(f'DPOLoss beta must be a finite number > 0; got {beta!r}')
        if loss_type not in _DPO_LOSSES:
            raise one_of('DPOLoss loss_type', loss_type, _DPO_LOSSES)
        if not is_finite_number(label_smoothing) or not 0 <= label_smoothing < 0.5:
            raise ConfigurationError(f'DPOLoss label_smoothing must be in [0, 0.5); got {label_smoothing!r}')
        if label_smoothing and loss_type != 'sigmoid':
            raise ConfigurationError(f"DPOLoss label_smoothing applies to loss_type='sigmoid' only; got {loss_type!r}")
        self.beta = float(beta)
        self.label_smoothing = float(label_smoothing)
        self.loss_type = loss_type
        self.reference_free = reference_free
        self.ignore_index = ignore_index

    @property
    def needs_reference(self) -> bool:  # type: ignore[override]
        return not self.reference_free

    def __call__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], **kwargs: Any) -> LossOutput:
        check_loss_kwargs('DPOLoss', kwargs, self.loss_inputs)
        grid = output_grid(inputs, outputs, self.ignore_index)
        num_sequences = grid.num_sequences
        if num_sequences % 2:
            raise DataError(
                f'DPOLoss needs interleaved (chosen, rejected) pairs; the batch has {num_sequences} sequences, '
                'an odd number'
            )
        logps_N = grid.sequence_sum(grid.logps)
        policy_P = logps_N[0::2] - logps_N[1::2]
        h_P = policy_P - self._reference_margin(outputs, kwargs, grid)
        loss = _DPO_LOSSES[self.loss_type](h_P, self.beta, self.label_smoothing).sum()
        margin_P = (self.beta * h_P).detach()
        metrics = {
            'pairs': torch.tensor(num_sequences // 2, device=grid.mask.device),
            'reward_accuracy': (margin_P > 0).sum(),
            'margin': margin_P.sum(),
        }
        return LossOutput(loss=loss, num_items=metrics['pairs'], metrics=metrics)

    def _reference_margin(self, outputs: dict[str, Any], kwargs: dict[str, Any], grid: TokenGrid) -> torch.Tensor:
        """``rc - rr`` per pair, ``[n / 2]`` for ``n`` sequences (0 when reference-free)."""
        device, n = grid.mask.device, grid.num_sequences
        if self.reference_free:
            return torch.zeros(n // 2, device=device)
        chosen, rejected = kwargs.get('ref_chosen_logps'), kwargs.get('ref_rejected_logps')
        if (chosen is None) != (rejected is None):
            raise DataError('DPOLoss: pass ref_chosen_logps= and ref_rejected_logps= together, or neither')
        if chosen is not None:
            chosen_P = _sums(chosen, n // 2, 'ref_chosen_logps', device)
            return chosen_P - _sums(rejected, n // 2, 'ref_rejected_logps', device)
        ref = reference_logps(kwargs, outputs)
        if ref is None:
            raise StateError(
                f'DPOLoss(beta={self.beta}) needs reference logprobs: train a LoRA adapter (the reference is the '
                'base model with the adapter off), pass ref_logps=, or set reference_free=True'
            )
        if isinstance(ref, Sequence) and all(isinstance(v, (int, float)) for v in ref):
            ref_N = _sums(ref, n, 'ref_logps', device)  # one sum per sequence
        else:
            ref_N = grid.sequence_sum(grid.align(ref, 'ref_logps', allow_scalar=False))
        return ref_N[0::2] - ref_N[1::2]


def _sums(values: Any, expected: int, name: str, device: torch.device) -> torch.Tensor:
    """A list (or 1-D tensor) of ``expected`` finite sums."""
    floats = values.detach().cpu().reshape(-1).tolist() if isinstance(values, torch.Tensor) else list(values)
    if len(floats) != expected:
        raise DataError(f'{name} has {len(floats)} entries; expected {expected}')
    for index, value in enumerate(floats):
        if not is_finite_number(value):
            raise DataError(f'{name}[{index}] is {value!r}; loss inputs must be finite numbers')
    return torch.tensor(floats, dtype=torch.float32, device=device)
