"""Preference losses beside DPO: KTO (unpaired), and the reference-free SimPO, ORPO and CPO.

The paired losses read the batch as DPO does: interleaved ``[chosen_0, rejected_0, chosen_1,
rejected_1, ...]`` sequences (rows when padded, sequences when packed), and return a sum over
pairs with ``num_items`` = pairs. Their ``metrics`` are DPO's (``pairs``, ``reward_accuracy``,
``margin``), so ``GRPOMetric`` reports them unchanged.

KTO reads unpaired examples, each marked desirable or not by the ``kto_labels`` loss input,
with (as TRL does) mismatched ``(prompt_i, completion_{i-1})`` sequences beside them from which
it estimates the reference point ``z0``; ``kto_kl_rows`` builds those rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch
import torch.nn.functional as F

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError, DataError, StateError, one_of
from twinkle.loss.base import LOSSES, Loss, LossOutput
from twinkle.loss.rl import (
    TokenGrid,
    check_loss_kwargs,
    is_finite_number,
    output_grid,
    reference_logps,
    sequence_index,
)

CPOType = Literal['sigmoid', 'hinge']
T = TypeVar('T')


# ---- KTO -----------------------------------------------------------------------------------------
@LOSSES.register
class KTOLoss(Loss):
    """Kahneman-Tversky Optimization (Ethayarajh et al. 2024, arXiv:2402.01306, eq. 7-8).

    Each example is one prompt with one completion, marked desirable or undesirable; no pairs.
    With ``r = log pi(y|x) - log pi_ref(y|x)`` (summed over the completion tokens) and the
    reference point ``z0``, an estimate of ``KL(pi || pi_ref)``, per example::

        desirable:    desirable_weight   * (1 - sigmoid(beta * (r - z0)))
        undesirable:  undesirable_weight * (1 - sigmoid(beta * (z0 - r)))

    summed over examples, ``num_items`` = examples (TRL's mean). ``z0`` gets no gradient.

    Loss inputs:

    - ``kto_labels`` (required): one entry per sequence of the batch, ``True`` desirable,
      ``False`` undesirable, ``None`` a KL sequence: a prompt with another example's completion
      (``kto_kl_rows`` builds them). ``z0 = max(0, mean over KL sequences of (pi - pi_ref))``,
      TRL's estimate (it pairs prompt ``i`` with completion ``i - 1``).
    - ``z0``: a number, the reference point itself (then the batch needs no KL sequences; with
      both, ``z0=`` wins and KL sequences are ignored).
    - ``ref_logps``: as ``DPOLoss`` reads it (else the model's base-model ``outputs['ref_logps']``).

    Example: policy equal to the reference (``r = 0``) and ``z0 = 0`` give ``1/2`` per example
    (times its weight).

    ``metrics``: ``examples``, ``desirable``, ``undesirable`` (counts), ``chosen_reward`` and
    ``rejected_reward`` (sums of ``beta * r`` over the desirable and undesirable examples: the
    reward margin is ``chosen_reward / desirable - rejected_reward / undesirable``), ``kl`` (z0)
    and ``batches`` (1: the mean z0 over calls is ``kl / batches``).
    """

    output_reads = 'logps'

    loss_inputs = ('kto_labels', 'z0', 'ref_logps')
    needs_reference = True

    def __init__(
        self,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        ignore_index: int = IGNORE_INDEX,
    ):
        self.beta = _positive('KTOLoss beta', beta)
        self.desirable_weight = _positive('KTOLoss desirable_weight', desirable_weight)
        self.undesirable_weight = _positive('KTOLoss undesirable_weight', undesirable_weight)
        self.ignore_index = ignore_index

    def __call__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], **kwargs: Any) -> LossOutput:
        check_loss_kwargs('KTOLoss', kwargs, self.loss_inputs)
        labels = _kto_labels(kwargs.get('kto_labels'), _num_sequences(inputs))
        given_z0 = kwargs.get('z0')
        if given_z0 is not None and not is_finite_number(given_z0):
            raise DataError(
                f'KTOLoss z0 must be a finite number (an estimate of KL(policy || reference)); got {given_z0!r}'
            )
        if given_z0 is None and None not in labels:
            raise DataError(
                'KTOLoss needs the reference point z0: pass z0=, or put KL sequences (a prompt with another '
                "example's completion, kto_labels entry None) in the batch: kto_kl_rows() builds them"
            )
        ref = reference_logps(kwargs, outputs)
        if ref is None:
            raise StateError(
                f'KTOLoss(beta={self.beta}) needs reference logprobs: train a LoRA adapter (the reference is the '
                'base model with the adapter off) or pass ref_logps='
            )
        grid = output_grid(inputs, outputs, self.ignore_index)
        device = grid.mask.device
        r_N = grid.sequence_sum(grid.logps) - grid.sequence_sum(grid.align(ref, 'ref_logps', allow_scalar=False))
        desirable = torch.tensor([label is True for label in labels], device=device)
        undesirable = torch.tensor([label is False for label in labels], device=device)
        if given_z0 is not None:
            z0 = torch.tensor(float(given_z0), device=device)
        else:
            kl_rows = torch.tensor([label is None for label in labels], device=device)
            z0 = r_N.detach()[kl_rows].mean().clamp(min=0)
        chosen = self.desirable_weight * (1 - torch.sigmoid(self.beta * (r_N - z0)))
        rejected = self.undesirable_weight * (1 - torch.sigmoid(self.beta * (z0 - r_N)))
        loss = chosen[desirable].sum() + rejected[undesirable].sum()
        reward_N = (self.beta * r_N).detach()
        metrics = {
            'examples': desirable.sum() + undesirable.sum(),
            'desirable': desirable.sum(),
            'undesirable': undesirable.sum(),
            'chosen_reward': reward_N[desirable].sum(),
            'rejected_reward': reward_N[undesirable].sum(),
            'kl': z0.detach(),
            'batches': torch.ones((), dtype=torch.long, device=device),
        }
        return LossOutput(loss=loss, num_items=metrics['examples'], metrics=metrics)


def kto_kl_rows(prompts: Sequence[T], completions: Sequence[T]) -> list[tuple[T, T]]:
    """The KL sequences of a KTO batch: prompt ``i`` with completion ``i - 1`` (the last for the
    first), TRL's mismatched pairs. Their log-ratio under policy and reference estimates
    ``KL(pi || pi_ref)``, KTO's reference point ``z0``. Needs two examples at least.

    >>> kto_kl_rows(['p0', 'p1', 'p2'], ['c0', 'c1', 'c2'])
    [('p0', 'c2'), ('p1', 'c0'), ('p2', 'c1')]
    """
    if len(prompts) != len(completions):
        raise DataError(f'kto_kl_rows got {len(prompts)} prompts and {len(completions)} completions; expected as many')
    if len(prompts) < 2:
        raise DataError(f'kto_kl_rows needs 2 examples or more to mismatch; got {len(prompts)}')
    return [(prompt, completions[i - 1]) for i, prompt in enumerate(prompts)]


def _kto_labels(labels: Any, num_sequences: int) -> list[bool | None]:
    if labels is None:
        raise DataError(
            'KTOLoss needs kto_labels=: one entry per sequence, True (desirable), False (undesirable) '
            'or None (a KL sequence)'
        )
    if isinstance(labels, torch.Tensor):
        labels = labels.tolist()
    if not isinstance(labels, Sequence) or isinstance(labels, str) or len(labels) != num_sequences:
        got = f'{len(labels)} entries' if isinstance(labels, Sequence) else type(labels).__name__
        raise DataError(f'KTOLoss kto_labels must have one entry per sequence ({num_sequences}); got {got}')
    for index, label in enumerate(labels):
        if label not in (True, False, None) or isinstance(label, float):
            raise DataError(
                f'KTOLoss kto_labels[{index}] is {label!r}; accepted: True (desirable), False (undesirable), '
                'None (a KL sequence)'
            )
    out = [None if label is None else bool(label) for label in labels]
    if all(label is None for label in out):
        raise DataError('KTOLoss kto_labels marks every sequence None (KL): the batch has no example to train on')
    return out


# ---- the paired, reference-free losses -------------------------------------------------------------
@LOSSES.register
class SimPOLoss(Loss):
    """Simple Preference Optimization (Meng et al. 2024, arXiv:2405.14734, eq. 6): reference-free,
    the implicit reward is the length-normalised log-probability. Per (chosen, rejected) pair::

        -log sigmoid(beta / |y_w| * log pi(y_w|x) - beta / |y_l| * log pi(y_l|x) - gamma)

    ``|y|`` counts the completion (trained) tokens. Summed over pairs, ``num_items`` = pairs.
    The paper's ranges: beta 2.0-10.0, gamma 0.3-1.6 (TRL's CPO ``loss_type='simpo'`` with
    ``cpo_alpha=0`` is the same loss, written with ``gamma / beta``).

    Example: equal average log-probabilities and ``gamma = 0`` give ``ln 2`` per pair.

    ``metrics``: ``pairs``, ``reward_accuracy`` and ``margin`` (sum of ``beta * (avg_w - avg_l)``).
    """

    output_reads = 'logps'

    def __init__(self, beta: float = 2.0, gamma: float = 0.5, ignore_index: int = IGNORE_INDEX):
        self.beta = _positive('SimPOLoss beta', beta)
        if not is_finite_number(gamma) or gamma < 0:
            raise ConfigurationError(
                f'SimPOLoss gamma (the target reward margin) must be a finite number >= 0; got {gamma!r}'
            )
        self.gamma = float(gamma)
        self.ignore_index = ignore_index

    def __call__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], **kwargs: Any) -> LossOutput:
        check_loss_kwargs('SimPOLoss', kwargs, ())
        grid = _paired_grid('SimPOLoss', inputs, outputs, self.ignore_index)
        avg_N = _average_logps('SimPOLoss', grid)
        margin_P = self.beta * (avg_N[0::2] - avg_N[1::2])
        loss = -F.logsigmoid(margin_P - self.gamma).sum()
        return _paired_output(loss, margin_P, grid)


@LOSSES.register
class ORPOLoss(Loss):
    """Odds Ratio Preference Optimization (Hong et al. 2024, arXiv:2403.07691, eq. 6-7):
    reference-free SFT with a penalty on the rejected answer's odds. With ``P(y|x) =
    exp(mean log pi(y_t))`` (length-averaged) and ``odds(y) = P / (1 - P)``, per pair::

        -mean_t log pi(y_w,t)  +  beta * -log sigmoid(log odds(y_w) - log odds(y_l))

    ``log odds = log P - log(1 - P)``, computed stably. Summed over pairs, ``num_items`` =
    pairs: the SFT term is each chosen answer's own mean (the paper's eq. 2); TRL's trainer
    averages it over the chosen tokens of the whole batch instead, the same when the chosen
    answers have equal lengths. ``beta`` is the paper's ``lambda`` (TRL's name; 0.1 in both).

    Example: equal average log-probabilities ``a`` give ``-a + beta * ln 2`` per pair.

    ``metrics``: ``pairs``, ``reward_accuracy`` and ``margin`` (sum of the log odds ratios).
    """

    output_reads = 'logps'

    def __init__(self, beta: float = 0.1, ignore_index: int = IGNORE_INDEX):
        self.beta = _positive('ORPOLoss beta', beta)
        self.ignore_index = ignore_index

    def __call__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], **kwargs: Any) -> LossOutput:
        check_loss_kwargs('ORPOLoss', kwargs, ())
        grid = _paired_grid('ORPOLoss', inputs, outputs, self.ignore_index)
        avg_N = _average_logps('ORPOLoss', grid)
        log_odds_N = avg_N - log1mexp(avg_N)
        log_odds_ratio_P = log_odds_N[0::2] - log_odds_N[1::2]
        loss = (-avg_N[0::2] - self.beta * F.logsigmoid(log_odds_ratio_P)).sum()
        return _paired_output(loss, log_odds_ratio_P, grid)


@LOSSES.register
class CPOLoss(Loss):
    """Contrastive Preference Optimization (Xu et al. 2024, arXiv:2401.08417, eq. 3-5): DPO
    without the reference, plus the NLL of the chosen answer. With ``h = log pi(y_w|x) -
    log pi(y_l|x)`` (summed over completion tokens), per pair::

        sigmoid:  -log sigmoid(beta * h)  +  alpha * -mean_t log pi(y_w,t)
        hinge:    max(0, 1 - beta * h)    +  alpha * -mean_t log pi(y_w,t)

    Summed over pairs, ``num_items`` = pairs. ``alpha`` is TRL's ``cpo_alpha``; as with
    ``ORPOLoss``, the NLL is each chosen answer's own mean (TRL: over the batch's chosen tokens).

    Example: ``h = 0`` and ``alpha = 0`` give ``ln 2`` per pair with ``'sigmoid'``.

    ``metrics``: ``pairs``, ``reward_accuracy`` and ``margin`` (sum of ``beta * h``).
    """

    output_reads = 'logps'

    def __init__(
        self, beta: float = 0.1, alpha: float = 1.0, loss_type: CPOType = 'sigmoid', ignore_index: int = IGNORE_INDEX
    ):
        self.beta = _positive('CPOLoss beta', beta)
        if not is_finite_number(alpha) or alpha < 0:
            raise ConfigurationError(
                f'CPOLoss alpha (the weight of the NLL term) must be a finite number >= 0; got {alpha!r}'
            )
        if loss_type not in _CPO_LOSSES:
            raise one_of('CPOLoss loss_type', loss_type, _CPO_LOSSES)
        self.alpha = float(alpha)
        self.loss_type = loss_type
        self.ignore_index = ignore_index

    def __call__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], **kwargs: Any) -> LossOutput:
        check_loss_kwargs('CPOLoss', kwargs, ())
        grid = _paired_grid('CPOLoss', inputs, outputs, self.ignore_index)
        sum_N = grid.sequence_sum(grid.logps)
        margin_P = self.beta * (sum_N[0::2] - sum_N[1::2])
        loss = _CPO_LOSSES[self.loss_type](margin_P).sum()
        if self.alpha:
            loss = loss - self.alpha * _average_logps('CPOLoss', grid)[0::2].sum()
        return _paired_output(loss, margin_P, grid)


_CPO_LOSSES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    'sigmoid': lambda margin: -F.logsigmoid(margin),
    'hinge': lambda margin: torch.relu(1 - margin),
}


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable at both ends (Maechler 2012: ``log(-expm1(x))``
    near 0, ``log1p(-exp(x))`` below ``-ln 2``)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


# ---- helpers ------------------------------------------------------------------------------------
def _positive(name: str, value: object) -> float:
    if not is_finite_number(value) or value <= 0:
        raise ConfigurationError(f'{name} must be a finite number > 0; got {value!r}')
    return float(value)


def _paired_grid(name: str, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], ignore_index: int) -> TokenGrid:
    num_sequences = _num_sequences(inputs)
    if num_sequences % 2:
        raise DataError(
            f'{name} needs interleaved (chosen, rejected) pairs; the batch has {num_sequences} sequences, an odd number'
        )
    return output_grid(inputs, outputs, ignore_index)


def _num_sequences(inputs: dict[str, torch.Tensor]) -> int:
    """Sequences in the batch, read from its layout alone (before any log-probability)."""
    index_BS = sequence_index(inputs)
    return int(index_BS.max()) + 1 if index_BS.numel() else 0


def _average_logps(name: str, grid: TokenGrid) -> torch.Tensor:
    """Mean label log-probability of each sequence, ``[N]``; a sequence without a trained token
    has no mean and is refused."""
    counts_N = grid.counts
    if bool((counts_N == 0).any()):
        index = int((counts_N == 0).nonzero()[0])
        raise DataError(
            f'{name}: sequence {index} has no completion (trained) token; its mean log-probability is undefined'
        )
    return grid.sequence_sum(grid.logps) / counts_N


def _paired_output(loss: torch.Tensor, margin_P: torch.Tensor, grid: TokenGrid) -> LossOutput:
    margin_P = margin_P.detach()
    metrics = {
        'pairs': torch.tensor(grid.num_sequences // 2, device=grid.mask.device),
        'reward_accuracy': (margin_P > 0).sum(),
        'margin': margin_P.sum(),
    }
    return LossOutput(loss=loss, num_items=metrics['pairs'], metrics=metrics)
