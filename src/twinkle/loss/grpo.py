"""Policy-gradient losses for RL on sampled completions: GRPO, PPO, Dr. GRPO, GSPO, CISPO.

All of them read the same loss inputs, given per sequence in the order of the batch rows
(packed or padded, see ``twinkle.loss.rl``):

- ``advantages`` (required): one number per sequence, or per sequence a list with one number
  per completion (trained) token;
- ``old_logps``: per sequence, the sampler's log-probability of each completion token (or a
  ``[batch, seq]`` tensor). ``None`` means on-policy: the current log-probabilities, detached,
  so every ratio is 1 and the gradient is REINFORCE's ``-A * grad log p``;
- ``ref_logps``: the reference model's log-probabilities, for the KL penalty (``beta > 0``).
  Leave it out to get the base model's from the model (the adapter switched off);
- ``proximal_logps`` (with ``rollout_correction`` only): the trainer's own log-probabilities
  under its "old" policy, the weights before this step's updates (PPO's later epochs: compute
  them with ``forward_only`` at the start of the step). Without them the old policy is the
  current one, detached (the first epoch).

Rollout correction (``rollout_correction=RolloutCorrection(...)``, see ``twinkle.loss.rl``): the
sampler is not the trainer (another kernel, precision or weight version), so its tokens are
off-policy. With it, the clipped ratio is taken against the trainer's old policy,
``r = exp(logp - logp_old)``, and each token's term is multiplied by the detached importance
weight ``w = exp(logp_old - old_logp)`` between that policy and the sampler, truncated (TIS) or
masked (MIS): the decoupled objective of Yao et al. 2025 and verl's ``rollout_is``. Without it,
``r = exp(logp - old_logp)`` is taken against the sampler directly.

The loss is a sum with a count (see ``twinkle.loss.base``); ``loss_type`` picks what the count
is, which is how these papers mainly differ:

====================  ==================================  ==========================
``loss_type``         loss / num_items                    from
====================  ==================================  ==========================
``'grpo'``            sum of per-sequence token means /   DeepSeekMath (GRPO)
                      sequences
``'token_mean'``      sum over tokens / tokens            DAPO, PPO
``'drgrpo'``          sum over tokens / (sequences *      Dr. GRPO
                      ``max_completion_length``)
====================  ==================================  ==========================

Sequences without a trained token are not counted.

Metrics, whenever the sampler's ``old_logps`` are given (sums; ``GRPOMetric`` turns them into
means over ``sampled_tokens``): ``kl_sample_train_v1`` (sum of ``old_logp - logp``) and
``kl_sample_train_v2`` (sum of ``(old_logp - logp)^2 / 2``), tinker-cookbook's first and second
order estimates of KL(sampler || trainer) (``tinker_cookbook.rl.metrics.compute_kl_sample_train``);
the importance weights ``w`` before truncating or masking: ``is_weight`` and ``is_weight_sq``
(sums) and ``is_weight_min``, ``is_weight_max`` (extremes), at the correction's level (token
level without a correction); and, with a correction, ``is_truncated`` or ``is_masked``: the
tokens whose weight was capped, or that were dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, cast

import torch

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError, DataError, StateError, one_of
from twinkle.loss.base import LOSSES, Loss, LossOutput
from twinkle.loss.rl import (
    LOG_RATIO_LIMIT,
    RolloutCorrection,
    RolloutWeights,
    check_loss_kwargs,
    is_finite_number,
    output_entropy,
    output_grid,
    reference_logps,
    sequence_sum,
)

LossType = Literal['grpo', 'token_mean', 'drgrpo']


@dataclass
class PolicyBatch:
    """One micro-batch laid out on the ``[B, S]`` grid (0 outside ``mask``)."""

    logps: torch.Tensor  # current policy, with grad
    old_logps: torch.Tensor  # the ratio's anchor, no grad: the sampler, or the trainer's old policy (correction)
    advantages: torch.Tensor
    ref_logps: torch.Tensor | None
    mask: torch.Tensor  # bool, trained positions (less the masked ones, with a masking correction)
    seq_index: torch.Tensor  # long, sequence of each position
    counts: torch.Tensor  # [N] trained positions per sequence
    #: The sampler's metrics (kl_sample_train_*, is_weight*), when its logps were given.
    sampler_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    #: The factor of each token's term (the rollout correction's weight), or None.
    weights: torch.Tensor | None = None


@LOSSES.register
class GRPOLoss(Loss):
    """Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300,
    eq. 3), with DAPO's decoupled ``epsilon_high`` ("clip-higher", Yu et al. 2025,
    arXiv:2503.14476). Per completion token ``t`` of sequence ``i``::

        r      = exp(logp - old_logp)                                 (log-ratio clamped to +-20)
        term   = -min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL
        KL     = exp(ref - logp) - (ref - logp) - 1                   (k3 estimator, eq. 4)

    aggregated by ``loss_type`` (module docstring; ``None`` takes the class's ``default_loss_type``).
    ``beta > 0`` needs reference log-probs.

    Example (``loss_type='token_mean'``, on-policy so ``r = 1``): two sequences with 3 and 1
    completion tokens and advantages ``[1, -1]`` give ``loss = -(3 * 1 + 1 * -1) = -2`` over
    ``num_items = 4``, i.e. -0.5; with ``'grpo'`` each sequence's token mean is ``-A``, so
    ``loss = -(1 - 1) = 0`` over 2 sequences.

    ``rollout_correction`` (a ``RolloutCorrection`` or a dict of its fields; ``None``: none)
    multiplies the term above by the truncated or masked importance weight between the
    trainer's old policy and the sampler, and then takes ``r`` against that old policy (module
    docstring). The KL term is not reweighted.

    ``metrics``: ``tokens``, ``sequences``, ``clipped`` (tokens whose clip is active:
    ``r < 1 - epsilon`` with ``A < 0`` or ``r > 1 + epsilon_high`` with ``A > 0``), ``ratio``
    (sum of ``r``), ``entropy`` (sum of the policy's entropy), ``kl`` (sum of KL, when a
    reference is at hand), and the sampler's figures (module docstring). ``GRPOMetric`` turns
    them into per-token means.
    """

    output_reads = 'logps+entropy'

    loss_inputs = ('advantages', 'old_logps', 'ref_logps', 'proximal_logps')
    #: The ``loss_type`` when none is given: the aggregation of the paper a class is named for.
    default_loss_type: ClassVar[LossType] = 'grpo'

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        loss_type: LossType | None = None,
        max_completion_length: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        rollout_correction: RolloutCorrection | Mapping[str, Any] | None = None,
    ):
        loss_type = self.default_loss_type if loss_type is None else loss_type
        self.epsilon = _positive(f'{type(self).__name__} epsilon', epsilon)
        self.epsilon_high = _positive(f'{type(self).__name__} epsilon_high', epsilon_high, default=self.epsilon)
        self.beta = _non_negative(f'{type(self).__name__} beta', beta)
        if loss_type not in _AGGREGATIONS:
            raise one_of(f'{type(self).__name__} loss_type', loss_type, _AGGREGATIONS)
        if loss_type == 'drgrpo' and not _is_positive_int(max_completion_length):
            raise ConfigurationError(
                f"{type(self).__name__} loss_type='drgrpo' divides by max_completion_length, which must be "
                f'a positive integer (the sampler max_tokens); got {max_completion_length!r}'
            )
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.ignore_index = ignore_index
        self.rollout_correction = RolloutCorrection.of(rollout_correction)

    @property
    def needs_reference(self) -> bool:  # type: ignore[override]
        return self.beta > 0

    def __call__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], **kwargs: Any) -> LossOutput:
        batch = self.prepare(inputs, outputs, kwargs)
        term_BS, ratio_BS, clipped_BS = self.policy_term(batch)
        if batch.weights is not None:
            term_BS = term_BS * batch.weights
        metrics = {
            'tokens': batch.mask.sum(),
            'sequences': (batch.counts > 0).sum(),
            'clipped': (clipped_BS & batch.mask).sum(),
            'ratio': (ratio_BS.detach() * batch.mask).sum(),
            'entropy': output_entropy(outputs, batch.mask).sum(),
            **batch.sampler_metrics,
        }
        if batch.ref_logps is not None:
            kl_BS = _k3(batch.ref_logps, batch.logps) * batch.mask
            metrics['kl'] = kl_BS.detach().sum()
            if self.beta > 0:
                term_BS = term_BS + self.beta * kl_BS
        loss, num_items = _AGGREGATIONS[self.loss_type](term_BS * batch.mask, batch, self.max_completion_length)
        return LossOutput(loss=loss, num_items=num_items, metrics=metrics)

    def prepare(self, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], kwargs: dict[str, Any]) -> PolicyBatch:
        """Check the loss inputs and lay them onto the ``[B, S]`` grid."""
        name = type(self).__name__
        check_loss_kwargs(name, kwargs, self.loss_inputs)
        if kwargs.get('advantages') is None:
            raise DataError(f'{name} needs advantages=: one number per sequence (or per completion token)')
        grid = output_grid(inputs, outputs, self.ignore_index)
        advantages_BS = grid.align(kwargs['advantages'], 'advantages')
        sampler = kwargs.get('old_logps')
        sampler_BS = None if sampler is None else grid.align(sampler, 'old_logps', allow_scalar=False)
        proximal = kwargs.get('proximal_logps')
        if proximal is not None and self.rollout_correction is None:
            raise ConfigurationError(
                f"{name} got proximal_logps= but has no rollout_correction: the trainer's old log-probs are "
                'read only to correct for the sampler; set rollout_correction=RolloutCorrection(...)'
            )
        current_BS = grid.logps.detach()
        old_BS = current_BS if proximal is None else grid.align(proximal, 'proximal_logps', allow_scalar=False)
        ref = reference_logps(kwargs, outputs)
        if ref is None and self.needs_reference:
            raise StateError(
                f'{name}(beta={self.beta}) needs reference logprobs: train a LoRA adapter (the reference is '
                'the base model with the adapter off) or pass ref_logps='
            )
        ref_BS = None if ref is None else grid.align(ref, 'ref_logps', allow_scalar=False)
        batch = PolicyBatch(grid.logps, old_BS, advantages_BS, ref_BS, grid.mask, grid.seq_index, grid.counts)
        if sampler_BS is None:
            return batch
        if self.rollout_correction is None:  # the ratio's anchor is the sampler; w is only reported
            batch.old_logps = sampler_BS
            raw_BS = (current_BS - sampler_BS).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp() * grid.mask
            batch.sampler_metrics = sampler_metrics(current_BS, sampler_BS, raw_BS, grid.mask)
            return batch
        correction = self.rollout_correction
        weights = correction.weights(old_BS - sampler_BS, grid.mask, grid.seq_index, grid.counts)
        batch.sampler_metrics = sampler_metrics(current_BS, sampler_BS, weights.raw, grid.mask)
        batch.sampler_metrics['is_truncated' if correction.mode == 'truncate' else 'is_masked'] = weights.cut.sum()
        return _corrected(batch, weights)

    def policy_term(self, batch: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token loss (before the KL term), the importance ratio, and where the clip bites."""
        log_ratio_BS = (batch.logps - batch.old_logps).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        return clipped_surrogate(log_ratio_BS.exp(), batch.advantages, self.epsilon, self.epsilon_high)


@LOSSES.register
class PPOLoss(GRPOLoss):
    """The PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347, eq. 7, ``L^CLIP``)::

        term = -min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A),   r = exp(logp - old_logp)

    The same objective as ``GRPOLoss``, averaged over tokens by default (``'token_mean'``), and
    meant for per-token advantages (GAE from a value model): ``advantages=[[a_0, a_1, ...], ...]``.
    """

    default_loss_type = 'token_mean'


@LOSSES.register
class DRGRPOLoss(GRPOLoss):
    """Dr. GRPO, "GRPO done right" (Liu et al. 2025, "Understanding R1-Zero-Like Training",
    arXiv:2503.20783): GRPO's objective summed over tokens and divided by a constant,
    ``sequences * max_completion_length``, instead of each sequence's own length, which removes
    GRPO's bias towards long wrong answers. (The paper also drops the std in the advantage: that
    is the advantage function's business.)

    Example: on-policy, one sequence of 3 tokens with ``A = 1`` and ``max_completion_length=8``
    gives ``loss = -3`` over ``num_items = 8``.
    """

    def __init__(
        self,
        max_completion_length: int,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        ignore_index: int = IGNORE_INDEX,
        rollout_correction: RolloutCorrection | Mapping[str, Any] | None = None,
    ):
        super().__init__(epsilon, epsilon_high, beta, 'drgrpo', max_completion_length, ignore_index, rollout_correction)


@LOSSES.register
class GSPOLoss(GRPOLoss):
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071): one importance
    ratio per sequence, the geometric mean of its token ratios,
    ``s_i = exp(mean_t (logp - old_logp))``, clipped at the sequence level; hence the small
    default ``epsilon=3e-4``, ``epsilon_high=4e-4`` (the paper's values).

    Implemented in the paper's GSPO-token form, ``s_it = sg(s_i) * exp(logp_t - sg(logp_t))``:
    equal to ``s_i`` in value, and with the sequence mean of ``loss_type='grpo'`` its gradient is
    GSPO's, ``s_i * A_i * mean_t grad logp_t``. Per-token advantages are allowed (GSPO-token).

    Example: token log-ratios ``(+0.1, -0.1)`` have a mean of 0, so ``s = 1`` and nothing is
    clipped, though each token's own ratio is far outside ``1 +- 4e-4``.
    """

    def __init__(
        self,
        epsilon: float = 3e-4,
        epsilon_high: float | None = 4e-4,
        beta: float = 0.0,
        ignore_index: int = IGNORE_INDEX,
        rollout_correction: RolloutCorrection | Mapping[str, Any] | None = None,
    ):
        super().__init__(epsilon, epsilon_high, beta, 'grpo', None, ignore_index, rollout_correction)

    def policy_term(self, batch: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_sequences = batch.counts.shape[0]
        token_log_ratio_BS = (batch.logps - batch.old_logps).detach() * batch.mask
        seq_log_ratio_N = sequence_sum(token_log_ratio_BS, batch.seq_index, num_sequences) / batch.counts.clamp(min=1)
        log_ratio_BS = seq_log_ratio_N[batch.seq_index] + batch.logps - batch.logps.detach()
        ratio_BS = log_ratio_BS.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
        return clipped_surrogate(ratio_BS, batch.advantages, self.epsilon, self.epsilon_high)


@LOSSES.register
class CISPOLoss(GRPOLoss):
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585, eq. 4)::

        term = -sg(clip(r, 1 - epsilon, 1 + epsilon_high)) * A * logp,   r = exp(logp - old_logp)

    The importance weight is clipped and detached instead of the update: every token keeps a
    gradient, ``-clip(r) * A * grad logp``, even when ``r`` is far outside the clip range (PPO
    and GRPO drop those tokens, often the rare "fork" tokens of a reasoning chain).

    Defaults: no lower bound (``epsilon=None``, as in the paper, which tunes only the upper
    one) and ``epsilon_high=3.0``, a weight capped at 4 (Tinker's default, after ScaleRL's
    ``epsilon_max = 4``, Khatri et al. 2025, arXiv:2510.13786); token-mean aggregation.
    ``clipped`` counts the tokens whose weight was truncated, whatever the advantage's sign.
    """

    default_loss_type = 'token_mean'

    def __init__(
        self,
        epsilon: float | None = None,
        epsilon_high: float = 3.0,
        beta: float = 0.0,
        loss_type: LossType | None = None,
        max_completion_length: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        rollout_correction: RolloutCorrection | Mapping[str, Any] | None = None,
    ):
        epsilon_high = _positive('CISPOLoss epsilon_high', epsilon_high)
        # None: no lower bound on the weight. epsilon = 1 puts the bound at 0, which a ratio (an
        # exp) never goes below, so the weight is not clipped from below.
        lower = 1.0 if epsilon is None else epsilon
        super().__init__(lower, epsilon_high, beta, loss_type, max_completion_length, ignore_index, rollout_correction)

    def policy_term(self, batch: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        log_ratio_BS = (batch.logps - batch.old_logps).detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        ratio_BS = log_ratio_BS.exp()
        weight_BS = ratio_BS.clamp(min=1 - self.epsilon, max=1 + self.epsilon_high)
        return -weight_BS * batch.advantages * batch.logps, ratio_BS, weight_BS != ratio_BS


def clipped_surrogate(
    ratio_BS: torch.Tensor, advantages_BS: torch.Tensor, epsilon: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)``, the ratio, and where the clipped
    branch is the minimum and differs (its gradient is then 0)."""
    unclipped_BS = ratio_BS * advantages_BS
    clipped_BS = ratio_BS.clamp(1 - epsilon, 1 + epsilon_high) * advantages_BS
    active_BS = ((ratio_BS < 1 - epsilon) & (advantages_BS < 0)) | ((ratio_BS > 1 + epsilon_high) & (advantages_BS > 0))
    return -torch.minimum(unclipped_BS, clipped_BS), ratio_BS, active_BS


# ---- aggregation (loss_type) --------------------------------------------------------------------
#: ``(masked per-token loss, batch, max_completion_length) -> (loss sum, num_items)``
Aggregation = Callable[[torch.Tensor, PolicyBatch, int | None], tuple[torch.Tensor, torch.Tensor]]


def _sequence_mean(term_BS: torch.Tensor, batch: PolicyBatch, max_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    sums_N = sequence_sum(term_BS, batch.seq_index, batch.counts.shape[0])
    return (sums_N / batch.counts.clamp(min=1)).sum(), (batch.counts > 0).sum()


def _token_mean(term_BS: torch.Tensor, batch: PolicyBatch, max_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    return term_BS.sum(), batch.mask.sum()


def _fixed_length(term_BS: torch.Tensor, batch: PolicyBatch, max_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    return term_BS.sum(), (batch.counts > 0).sum() * cast(int, max_len)  # an int: checked in __init__


_AGGREGATIONS: dict[str, Aggregation] = {'grpo': _sequence_mean, 'token_mean': _token_mean, 'drgrpo': _fixed_length}


# ---- rollout correction -------------------------------------------------------------------------
def sampler_metrics(
    logps_BS: torch.Tensor, sampler_BS: torch.Tensor, weights_BS: torch.Tensor, mask_BS: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The sampler-vs-trainer figures of the module docstring, as sums and extremes over the
    trained positions ``mask``: ``logps`` the trainer's (detached), ``sampler`` the sampler's,
    ``weights`` the importance weights before truncating or masking."""
    diff_BS = (sampler_BS - logps_BS.detach()) * mask_BS
    inf = torch.tensor(float('inf'), device=weights_BS.device)
    return {
        'sampled_tokens': mask_BS.sum(),
        'kl_sample_train_v1': diff_BS.sum(),
        'kl_sample_train_v2': 0.5 * diff_BS.square().sum(),
        'is_weight': weights_BS.sum(),
        'is_weight_sq': weights_BS.square().sum(),
        'is_weight_min': torch.where(mask_BS, weights_BS, inf).amin(),
        'is_weight_max': torch.where(mask_BS, weights_BS, -inf).amax(),
    }


def _corrected(batch: PolicyBatch, weights: RolloutWeights) -> PolicyBatch:
    """``batch`` with the correction's weights, and without the positions it masked."""
    batch.weights = weights.applied
    batch.mask = weights.keep
    batch.counts = torch.zeros_like(batch.counts).index_add_(
        0, batch.seq_index.reshape(-1), batch.mask.reshape(-1).long()
    )
    return batch


# ---- helpers ------------------------------------------------------------------------------------
def _k3(ref_BS: torch.Tensor, logps_BS: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || reference): unbiased and always >= 0."""
    diff_BS = (ref_BS - logps_BS).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return diff_BS.exp() - diff_BS - 1


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive(name: str, value: float | None, default: float | None = None) -> float:
    if value is None and default is not None:
        return default
    if not is_finite_number(value) or not value > 0:
        raise ConfigurationError(f'{name} must be a finite number > 0; got {value!r}')
    return float(value)


def _non_negative(name: str, value: float) -> float:
    if not is_finite_number(value) or value < 0:
        raise ConfigurationError(f'{name} must be a finite number >= 0; got {value!r}')
    return float(value)
