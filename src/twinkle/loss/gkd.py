"""Knowledge distillation from a teacher's next-token distributions: GKD's generalized JSD over
the full vocabulary, and on-policy distillation's sampled per-token reverse KL.

The teacher's logits come in as the loss input ``teacher_logits`` (``[batch, seq, vocab]``, the
same rows collated the same way as the student's). ``teacher_logits()`` below computes them
from any model with ``forward_only``: another model, a saved adapter loaded beside the student's
(``model.add_adapter_to_model('teacher', adapter_dir)``, then ``adapter_name='teacher'``), or the
student's base with its adapter off (``disable_lora=True``).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F

from twinkle.data_format import IGNORE_INDEX, ModelOutput
from twinkle.errors import ConfigurationError, DataError, one_of
from twinkle.loss.base import LOSSES, Loss, LossOutput
from twinkle.loss.rl import LOG_RATIO_LIMIT, check_loss_kwargs, is_finite_number, token_grid, token_logps

GKDMode = Literal['jsd', 'sampled_reverse_kl']
_MODES = ('jsd', 'sampled_reverse_kl')


class ForwardOnly(Protocol):
    """What ``teacher_logits`` needs of a model (``TransformersModel`` has it)."""

    def forward_only(self, *, inputs: Any, adapter_name: str | None = None, disable_lora: bool = False) -> ModelOutput:
        """An evaluation forward pass without gradients; ``logits`` ``[batch, seq, vocab]``."""
        ...


def teacher_logits(
    teacher: ForwardOnly, inputs: Any, *, adapter_name: str | None = None, disable_lora: bool = False
) -> torch.Tensor:
    """The teacher's logits on ``inputs`` (the rows the student trains on), without gradients, to
    pass as ``teacher_logits=``. ``teacher`` is another model, or the student's own model with
    ``adapter_name=`` a teacher adapter loaded beside the student's, or ``disable_lora=True``
    for its base model. The rows are collated as the student's forward collates them, so the
    shapes line up; ``GKDLoss`` checks that they do."""
    logits = teacher.forward_only(inputs=inputs, adapter_name=adapter_name, disable_lora=disable_lora).logits
    if not isinstance(logits, torch.Tensor):
        raise DataError(f'the teacher returned no logits tensor; got {type(logits).__name__}')
    return logits.detach()


@LOSSES.register
class GKDLoss(Loss):
    """Generalized Knowledge Distillation (Agarwal et al. 2024, arXiv:2306.13649, eq. 1).

    ``mode='jsd'``: at each trained position, with the student's and the teacher's next-token
    distributions ``S = softmax(z_s / T)`` and ``P = softmax(z_t / T)`` over the full
    vocabulary, the generalized Jensen-Shannon divergence with ``M = beta * P + (1 - beta) * S``::

        JSD(beta) = beta * KL(P || M) + (1 - beta) * KL(S || M)

    and, as TRL defines the end points, ``beta = 0`` the forward ``KL(P || S)`` and ``beta = 1``
    the reverse ``KL(S || P)`` (the formula itself tends to 0 there). Summed over trained
    tokens, ``num_items`` = tokens (TRL's ``batchmean``).

    ``mode='sampled_reverse_kl'``: on-policy distillation (Agarwal et al. 2024 sec. 3; Thinking
    Machines' "On-Policy Distillation", 2025): the completions were sampled from the student, and
    each sampled token ``y_t`` carries the single-sample reverse-KL estimate ``k_t = log S(y_t)
    - log P(y_t)``. The loss is REINFORCE with advantage ``-k_t`` per token, written so that
    its value is the estimate ``sum_t k_t`` and its gradient ``sum_t k_t * grad log S(y_t)``
    (the gradient of ``KL(S || P)`` over the student's own samples). Needs ``teacher_logits``
    or ``teacher_logps`` (``[batch, seq]``, the teacher's log-probability of each label).

    Example: student and teacher logits equal give 0 for every ``beta``; a uniform student
    over 2 tokens and a teacher ``(3/4, 1/4)`` give ``KL(P || S) = 3/4 ln(3/2) + 1/4 ln(1/2)``
    per token with ``beta = 0``.

    ``teacher_logits`` is one tensor for the whole ``forward_backward`` call, so it does not
    follow ``micro_batch_size`` chunks: leave that out, or call once per chunk with its slice
    (a mismatch is refused, naming both shapes).

    ``metrics``: ``tokens`` and ``distill_kl`` (the summed divergence, or the summed ``k_t``).
    """

    loss_inputs = ('teacher_logits', 'teacher_logps')

    def __init__(
        self,
        beta: float = 0.5,
        temperature: float = 1.0,
        mode: GKDMode = 'jsd',
        ignore_index: int = IGNORE_INDEX,
    ):
        if not is_finite_number(beta) or not 0 <= beta <= 1:
            raise ConfigurationError(
                f'GKDLoss beta must be in [0, 1] (0: forward KL, 1: reverse KL, between: JSD); got {beta!r}'
            )
        if not is_finite_number(temperature) or temperature <= 0:
            raise ConfigurationError(f'GKDLoss temperature must be a finite number > 0; got {temperature!r}')
        if mode not in _MODES:
            raise one_of('GKDLoss mode', mode, _MODES)
        self.beta, self.temperature, self.mode = float(beta), float(temperature), mode
        self.ignore_index = ignore_index

    def __call__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], **kwargs: Any) -> LossOutput:
        check_loss_kwargs('GKDLoss', kwargs, self.loss_inputs)
        logits_BSV, labels_BS = outputs['logits'], inputs['labels']
        teacher = self._teacher_input(kwargs, logits_BSV)
        mask_BS = labels_BS != self.ignore_index
        if self.mode == 'jsd':
            if teacher.dim() != 3:
                raise DataError("GKDLoss(mode='jsd') needs teacher_logits= ([batch, seq, vocab]); got teacher_logps")
            per_token = generalized_jsd(logits_BSV[mask_BS], teacher[mask_BS], self.beta, self.temperature)
            loss, kl = per_token.sum(), per_token.detach().sum()
        else:
            loss, kl = self._sampled_reverse_kl(inputs, logits_BSV, teacher)
        tokens = mask_BS.sum()
        return LossOutput(loss=loss, num_items=tokens, metrics={'tokens': tokens, 'distill_kl': kl})

    def _teacher_input(self, kwargs: dict[str, Any], logits_BSV: torch.Tensor) -> torch.Tensor:
        """``teacher_logits`` (checked against the student's shape), else ``teacher_logps``."""
        logits, logps = kwargs.get('teacher_logits'), kwargs.get('teacher_logps')
        if logits is None and logps is None:
            accepted = "teacher_logits= or teacher_logps= (mode='sampled_reverse_kl')"
            raise DataError(
                f'GKDLoss needs the teacher: pass {accepted}; twinkle.loss.teacher_logits(model, rows, ...) computes '
                'them from another model, a teacher adapter or the base model'
            )
        if logits is not None and logps is not None:
            raise DataError('GKDLoss: pass teacher_logits= or teacher_logps=, not both')
        value = logits if logits is not None else logps
        if not isinstance(value, torch.Tensor):
            raise DataError(f'GKDLoss teacher input must be a tensor; got {type(value).__name__}')
        expected = tuple(logits_BSV.shape) if logits is not None else tuple(logits_BSV.shape[:-1])
        name = 'teacher_logits' if logits is not None else 'teacher_logps'
        if tuple(value.shape) != expected:
            if logits is not None and value.dim() == 3 and value.shape[:-1] == logits_BSV.shape[:-1]:
                raise DataError(
                    f'GKDLoss teacher_logits have a vocabulary of {value.shape[-1]} tokens, the student '
                    f'{logits_BSV.shape[-1]}: distillation over the full vocabulary needs the same tokenizer '
                    '(and the same padded vocabulary size)'
                )
            raise DataError(f'GKDLoss {name} has shape {tuple(value.shape)}; the student batch needs {expected}')
        return value.detach().to(logits_BSV.device)

    def _sampled_reverse_kl(
        self, inputs: dict[str, torch.Tensor], logits_BSV: torch.Tensor, teacher: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        grid = token_grid(inputs, logits_BSV / self.temperature, self.ignore_index)
        if teacher.dim() == 3:
            teacher_BS = token_logps(teacher / self.temperature, inputs['labels'], self.ignore_index)
        else:
            teacher_BS = torch.where(grid.mask, teacher.float(), 0.0)
            if not bool(torch.isfinite(teacher_BS).all()):
                raise DataError('GKDLoss teacher_logps hold a NaN or infinite value at a trained position')
        k_BS = (grid.logps.detach() - teacher_BS).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        # Value k, gradient k * grad log S: exp(x - sg(x)) is 1 with gradient grad x.
        surrogate_BS = k_BS * torch.exp(grid.logps - grid.logps.detach())
        return torch.where(grid.mask, surrogate_BS, 0.0).sum(), k_BS.sum()


def generalized_jsd(
    student_TV: torch.Tensor, teacher_TV: torch.Tensor, beta: float, temperature: float
) -> torch.Tensor:
    """GKD's divergence per position, ``[T]`` float32, from ``[T, V]`` logits (see ``GKDLoss``).

    >>> s, t = torch.zeros(1, 2), torch.tensor([[3.0, 1.0]]).log()  # S = (1/2, 1/2), P = (3/4, 1/4)
    >>> round(float(generalized_jsd(s, t, 0.0, 1.0)), 6)  # 3/4 ln(3/2) + 1/4 ln(1/2)
    0.130812
    """
    s_TV = F.log_softmax(student_TV.float() / temperature, dim=-1)
    t_TV = F.log_softmax(teacher_TV.float() / temperature, dim=-1)
    if beta == 0:
        return _kl(t_TV, s_TV)
    if beta == 1:
        return _kl(s_TV, t_TV)
    log_beta = torch.tensor(beta, dtype=s_TV.dtype, device=s_TV.device).log()
    log_one_minus = torch.tensor(1 - beta, dtype=s_TV.dtype, device=s_TV.device).log()
    m_TV = torch.logsumexp(torch.stack([s_TV + log_one_minus, t_TV + log_beta]), dim=0)
    return beta * _kl(t_TV, m_TV) + (1 - beta) * _kl(s_TV, m_TV)


def _kl(p_TV: torch.Tensor, q_TV: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` per row from log-probabilities."""
    return (p_TV.exp() * (p_TV - q_TV)).sum(-1)
