"""The Tinker API's built-in losses, as the training service computes them.

A Tinker datum has ``model_input`` tokens of length ``N``; every loss input has shape ``(N,)``
and position ``i`` predicts ``target_tokens[i]``. Losses are **sums** over tokens (and over the
datums of a request), never means: ``TinkerLoss`` reports ``num_items = 0``, so the model does
not divide the accumulated gradient at the optimizer step (it divides by the count clamped at 1).

Source: https://tinker-docs.thinkingmachines.ai/tinker/losses (one page per loss, linked in
each function below). The ``ppo`` and ``cispo`` defaults are the Tinker Cookbook tutorial's
``tutorials/202_loss_functions.py`` (https://tinker-docs.thinkingmachines.ai/tutorials/core-concepts/loss-functions);
the docs state none for ``dro`` and ``gspo``: ``beta = 0.05`` is the docs' own example value and the
``gspo`` thresholds are the GSPO paper's clip ranges (section 5.1).

=======================  ===============================  ===========================================
``loss_fn``              loss inputs besides              ``loss_fn_config`` (default)
                         ``target_tokens``
=======================  ===============================  ===========================================
``cross_entropy``        ``weights``                      none
``importance_sampling``  ``logprobs``, ``advantages``     none
``ppo``                  ``logprobs``, ``advantages``     ``clip_low_threshold`` (0.8),
                                                          ``clip_high_threshold`` (1.2)
``cispo``                ``logprobs``, ``advantages``     ``clip_low_threshold`` (0.0),
                                                          ``clip_high_threshold`` (4.0)
``dro``                  ``logprobs``, ``advantages``     ``beta`` (0.05)
``gspo``                 ``logprobs``, ``advantages``,    ``clip_low_threshold`` (1 - 3e-4),
                         optional ``sequence_ratio_mask`` ``clip_high_threshold`` (1 + 4e-4)
``stable_reinforce``     ``advantages``,                  ``ratio_cap`` (2.0), ``kl_coeff`` (0.0)
                         ``recorded_logprobs``,
                         ``recorded_mask`` (the server's)
=======================  ===============================  ===========================================

``logprobs`` are the sampler's log-probabilities (``lp_old`` below), ``lp`` the learner's.
``ppo``, ``cispo`` and ``gspo`` also take the thresholds as optional per-token inputs (the SDK
types them as loss inputs, ``tinker/types/datum.py``); a per-token value overrides the config.
``stable_reinforce`` reads the sampler's log-probabilities as the server recorded them when it
sampled (``RECORDED_LOGPROBS``, and ``RECORDED_MASK``: 1 at the positions a sampled sequence
produced), never the client's ``logprobs``, which it accepts and ignores; the Tinker server fills
both from each datum's provenance spans. ``custom`` names a server-side loss handle: it is refused.

Log-ratios ``lp - lp_old`` are clamped to +-``LOG_RATIO_LIMIT`` (20) before ``exp``, so that a
placeholder sampler log-prob cannot overflow the ratio into ``inf * 0 = NaN``; the clamp only
matters for ratios beyond e^20.

Shapes: ``T`` positions of all datums, flattened; ``B`` rows, ``S`` positions per row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError, DataError, UnknownNameError
from twinkle.loss.base import LOSSES, Loss, LossOutput
from twinkle.loss.rl import LOG_RATIO_LIMIT, check_loss_kwargs, is_finite_number, output_grid


class LossTerms(NamedTuple):
    """What a Tinker loss computes."""

    #: The loss sum, a 0-d tensor with grad.
    loss: torch.Tensor
    #: Detached 0-d tensors keyed ``name:sum``.
    metrics: dict[str, torch.Tensor]


#: ``(logprobs_T, inputs_T, config, sequence_ids_T) -> LossTerms``
LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float], torch.Tensor], LossTerms]

_CLIP_KEYS = ('clip_low_threshold', 'clip_high_threshold')
#: ``stable_reinforce``'s inputs that the server fills from the sequences it recorded at sampling:
#: the sampler's log-probability at each position, and 1 where a sampled sequence produced the token.
RECORDED_LOGPROBS, RECORDED_MASK = 'recorded_logprobs', 'recorded_mask'


# ---- the losses ---------------------------------------------------------------------------------
def cross_entropy(
    logprobs_T: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float], seq_T: torch.Tensor
) -> LossTerms:
    """``loss = -(lp * weights).sum()``; weights may be any real numbers, negative ones too.

    https://tinker-docs.thinkingmachines.ai/tinker/losses (cross_entropy)
    """
    return _terms(-(logprobs_T * inputs['weights']).sum())


def importance_sampling(
    logprobs_T: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float], seq_T: torch.Tensor
) -> LossTerms:
    """REINFORCE with an importance weight for the sampler/learner mismatch:
    ``loss = -(exp(lp - lp_old) * A).sum()``.

    https://tinker-docs.thinkingmachines.ai/tinker/losses (importance_sampling)
    """
    ratio_T = _log_ratio(logprobs_T, inputs['logprobs']).exp()
    return _terms(-(ratio_T * inputs['advantages']).sum())


def ppo(
    logprobs_T: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float], seq_T: torch.Tensor
) -> LossTerms:
    """PPO's clipped surrogate, token by token (Schulman et al. 2017, arXiv:1707.06347, eq. 7)::

        r    = exp(lp - lp_old)
        loss = -min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A).sum()

    https://tinker-docs.thinkingmachines.ai/tinker/losses/ppo
    """
    ratio_T = _log_ratio(logprobs_T, inputs['logprobs']).exp()
    return _clipped_surrogate(ratio_T, inputs['advantages'], *_thresholds(inputs, config, ratio_T))


def cispo(
    logprobs_T: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float], seq_T: torch.Tensor
) -> LossTerms:
    """CISPO: the clipped ratio is a detached weight on ``lp``, so no token loses its gradient
    (MiniMax-M1, arXiv:2506.13585, eq. 4; ScaleRL, arXiv:2510.13786)::

        loss = -(sg(clip(r, clip_low_threshold, clip_high_threshold)) * lp * A).sum()

    https://tinker-docs.thinkingmachines.ai/tinker/losses/cispo
    """
    ratio_T = _log_ratio(logprobs_T, inputs['logprobs']).detach().exp()
    low_T, high_T = _thresholds(inputs, config, ratio_T)
    weight_T = ratio_T.clamp(low_T, high_T)
    truncated = ((weight_T != ratio_T) & (inputs['advantages'] != 0)).sum()
    return _terms(-(weight_T * logprobs_T * inputs['advantages']).sum(), clipped=truncated)


def dro(
    logprobs_T: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float], seq_T: torch.Tensor
) -> LossTerms:
    """Direct Reward Optimization's quadratic penalty (Richemond et al. 2024, arXiv:2405.19107;
    Kimi k1.5, arXiv:2501.12599)::

        loss = -(lp * A - 0.5 * beta * (lp - lp_old) ** 2).sum()

    The penalty applies at every position, ``A = 0`` ones too (as on Tinker).
    https://tinker-docs.thinkingmachines.ai/tinker/losses/dro
    """
    penalty_T = 0.5 * config['beta'] * (logprobs_T - inputs['logprobs']) ** 2
    return _terms(-(logprobs_T * inputs['advantages'] - penalty_T).sum())


def gspo(
    logprobs_T: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float], seq_T: torch.Tensor
) -> LossTerms:
    """GSPO-token (Zheng et al. 2025, arXiv:2507.18071, eq. 13): one ratio per datum, the
    geometric mean of its token ratios over the positions ``M`` that ``sequence_ratio_mask``
    marks (non-zero; all positions when the mask is not given)::

        s    = exp(mean_{t in M} (sg(lp_t) - lp_old_t))          (1 when M is empty)
        s_t  = sg(s) * exp(lp_t - sg(lp_t))                        (value s, gradient of lp_t)
        loss = -min(s_t * A_t, clip(s_t, clip_low_threshold, clip_high_threshold) * A_t).sum()

    https://tinker-docs.thinkingmachines.ai/tinker/losses/gspo
    """
    mask = inputs.get('sequence_ratio_mask')
    in_ratio_T = torch.ones_like(logprobs_T, dtype=torch.bool) if mask is None else mask != 0
    token_log_ratio_T = logprobs_T.detach() - inputs['logprobs']
    seq_log_ratio_T = _sequence_mean(token_log_ratio_T, in_ratio_T, seq_T).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio_T = (seq_log_ratio_T + logprobs_T - logprobs_T.detach()).exp()
    return _clipped_surrogate(ratio_T, inputs['advantages'], *_thresholds(inputs, config, ratio_T))


def stable_reinforce(
    logprobs_T: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float], seq_T: torch.Tensor
) -> LossTerms:
    """REINFORCE that stays stable off-policy, with the sampler's log-probabilities ``q`` as the
    server recorded them when it sampled (never the client's ``logprobs``)::

        r    = min(sg(exp(lp - q)), ratio_cap)                 (truncated importance weight)
        k3   = exp(q - lp) - (q - lp) - 1                       (the k3 estimator of KL(q || p))
        loss = -(m * r * A * lp).sum() + kl_coeff * (m * k3).sum()

    ``m`` (``RECORDED_MASK``) is 1 at the positions a sampled sequence produced, the trained
    tokens; prompt positions add nothing. Thinking Machines describe ``stable_reinforce`` as a
    REINFORCE variant that stays stable off-policy using what was recorded at sampling, without
    a formula (https://tinker-docs.thinkingmachines.ai/tinker/losses): this truncated-importance
    form with a k3 penalty is this project's reading of those docs, not Tinker's published loss.
    """
    mask_T = inputs[RECORDED_MASK] != 0
    sampler_T = torch.where(mask_T, inputs[RECORDED_LOGPROBS], logprobs_T.detach())
    ratio_T = _log_ratio(logprobs_T.detach(), sampler_T).exp()
    weight_T = ratio_T.clamp(max=config['ratio_cap'])
    gap_T = (sampler_T - logprobs_T).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    k3_T = gap_T.exp() - gap_T - 1
    policy = torch.where(mask_T, weight_T * inputs['advantages'] * logprobs_T, 0.0).sum()
    penalty = torch.where(mask_T, k3_T, 0.0).sum()
    truncated = (mask_T & (ratio_T > config['ratio_cap'])).sum()
    return _terms(-policy + config['kl_coeff'] * penalty, truncated=truncated, kl_k3=penalty)


@dataclass(frozen=True)
class TinkerLossSpec:
    """What one Tinker loss computes and reads."""

    compute: LossFn
    #: Loss inputs it needs besides ``target_tokens`` (which the labels carry).
    required: tuple[str, ...]
    #: Loss inputs it reads when given.
    optional: tuple[str, ...] = ()
    #: Its ``loss_fn_config`` keys with their defaults.
    defaults: Mapping[str, float] = field(default_factory=dict)

    @property
    def accepted_inputs(self) -> tuple[str, ...]:
        return ('target_tokens', *self.required, *self.optional)


_RL = ('logprobs', 'advantages')
TINKER_LOSSES: dict[str, TinkerLossSpec] = {
    'cross_entropy': TinkerLossSpec(cross_entropy, ('weights',)),
    'importance_sampling': TinkerLossSpec(importance_sampling, _RL),
    'ppo': TinkerLossSpec(ppo, _RL, _CLIP_KEYS, {'clip_low_threshold': 0.8, 'clip_high_threshold': 1.2}),
    'cispo': TinkerLossSpec(cispo, _RL, _CLIP_KEYS, {'clip_low_threshold': 0.0, 'clip_high_threshold': 4.0}),
    'dro': TinkerLossSpec(dro, _RL, (), {'beta': 0.05}),
    # The GSPO paper's clip ranges (3e-4, 4e-4; section 5.1), as absolute thresholds.
    'gspo': TinkerLossSpec(
        gspo,
        _RL,
        ('sequence_ratio_mask', *_CLIP_KEYS),
        {'clip_low_threshold': 1 - 3e-4, 'clip_high_threshold': 1 + 4e-4},
    ),
    # Defaults: this project's (the docs give none); kl_coeff 0 is plain truncated REINFORCE.
    'stable_reinforce': TinkerLossSpec(
        stable_reinforce,
        ('advantages', RECORDED_LOGPROBS, RECORDED_MASK),
        ('logprobs',),
        {'ratio_cap': 2.0, 'kl_coeff': 0.0},
    ),
}

#: Tinker loss names this service knows but cannot compute, with the reason.
UNSUPPORTED_LOSSES: dict[str, str] = {
    'custom': 'server-side custom losses (ServiceClient.create_custom_loss) are not available here; '
    'use forward_backward_custom, which runs the loss on the client',
}


# ---- validation ---------------------------------------------------------------------------------
def tinker_loss_spec(loss_fn: str) -> TinkerLossSpec:
    """The spec of a Tinker loss name; an unknown name raises ``UnknownNameError``, an
    unsupported one ``ConfigurationError``, both listing the supported names."""
    if isinstance(loss_fn, str) and loss_fn in UNSUPPORTED_LOSSES:
        raise ConfigurationError(
            f'Tinker loss {loss_fn!r} is not supported: {UNSUPPORTED_LOSSES[loss_fn]}. '
            f'Supported losses are: {sorted(TINKER_LOSSES)}'
        )
    if not isinstance(loss_fn, str) or loss_fn not in TINKER_LOSSES:
        raise UnknownNameError('Tinker loss', loss_fn, TINKER_LOSSES)
    return TINKER_LOSSES[loss_fn]


def resolve_config(loss_fn: str, config: Mapping[str, float] | None) -> dict[str, float]:
    """The defaults of ``loss_fn`` overridden by ``config``, every key checked."""
    spec = tinker_loss_spec(loss_fn)
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise ConfigurationError(f'{loss_fn} loss_fn_config must be a mapping; got {type(config).__name__}')
    unknown = sorted(set(config) - set(spec.defaults), key=str)
    if unknown:
        accepted = f'Accepted keys are: {sorted(spec.defaults)}' if spec.defaults else 'It takes no keys'
        raise ConfigurationError(f'{loss_fn} got unknown loss_fn_config keys {unknown}. {accepted}')
    for key, value in config.items():
        if not is_finite_number(value):
            raise ConfigurationError(f'{loss_fn} loss_fn_config[{key!r}] must be a finite number; got {value!r}')
    resolved = {**spec.defaults, **{key: float(value) for key, value in config.items()}}
    _check_ranges(loss_fn, resolved)
    return resolved


def check_inputs(loss_fn: str, names: Any) -> None:
    """Refuse a loss input ``loss_fn`` does not read (``ConfigurationError``) and a missing one
    it needs (``DataError``), naming the accepted inputs."""
    spec = tinker_loss_spec(loss_fn)
    present = set(names)
    check_loss_kwargs(loss_fn, dict.fromkeys(present), spec.accepted_inputs)
    missing = [name for name in spec.required if name not in present]
    if missing:
        raise DataError(
            f'{loss_fn} needs the loss inputs {missing} (one value per position of each datum); '
            f'it takes {list(spec.accepted_inputs)}'
        )


def _check_ranges(loss_fn: str, config: Mapping[str, float]) -> None:
    for key in ('beta', 'kl_coeff'):
        if key in config and config[key] < 0:
            raise ConfigurationError(f'{loss_fn} loss_fn_config {key} must be >= 0; got {config[key]}')
    if 'ratio_cap' in config and config['ratio_cap'] <= 0:
        raise ConfigurationError(f'{loss_fn} loss_fn_config ratio_cap must be > 0; got {config["ratio_cap"]}')
    if 'clip_low_threshold' in config:
        low, high = config['clip_low_threshold'], config['clip_high_threshold']
        if not 0 <= low <= high:
            raise ConfigurationError(
                f'{loss_fn} needs 0 <= clip_low_threshold <= clip_high_threshold; got clip_low_threshold={low}, '
                f'clip_high_threshold={high} (thresholds bound the ratio itself, e.g. 0.8 and 1.2)'
            )


def _check_flat(loss_fn: str, logprobs_T: torch.Tensor, inputs: Mapping[str, torch.Tensor], seq_T: Any) -> None:
    if logprobs_T.dim() != 1:
        raise DataError(f'{loss_fn} logprobs must be 1-D (positions); got shape {tuple(logprobs_T.shape)}')
    named = {**inputs, **({} if seq_T is None else {'sequence_ids': seq_T})}
    for name, value in named.items():
        if not isinstance(value, torch.Tensor) or value.shape != logprobs_T.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            expected = tuple(logprobs_T.shape)
            raise DataError(f'{loss_fn} input {name!r} must be a tensor of shape {expected}; got {shape}')
        bad = ~torch.isfinite(value.float())
        if bool(bad.any()):
            index = int(bad.nonzero()[0, 0])
            raise DataError(f'{loss_fn} input {name}[{index}] is {value[index].item()}; inputs must be finite')


# ---- entry points -------------------------------------------------------------------------------
def tinker_loss_terms(
    loss_fn: str,
    logprobs_T: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float] | None = None,
    sequence_ids_T: torch.Tensor | None = None,
) -> LossTerms:
    """The loss sum and its metrics over flat per-position tensors.

    ``logprobs_T`` is the learner's log-probability of each target token (with grad); each
    input is a tensor of the same shape (``target_tokens``, if given, is not read: the
    log-probabilities already belong to it). ``sequence_ids_T`` says which datum each position
    belongs to (any integers; only ``gspo`` reads it); without it all positions are one datum.

    Metrics: ``loss:sum``; ``ppo`` and ``gspo`` add ``clipped:sum`` (positions whose gradient
    the clip removed), ``cispo`` adds ``clipped:sum`` (positions with ``A != 0`` whose weight
    was truncated), ``stable_reinforce`` adds ``truncated:sum`` (trained positions whose ratio
    was over ``ratio_cap``) and ``kl_k3:sum`` (its penalty before ``kl_coeff``).

    >>> lp, weights = torch.tensor([-1.0, -2.0]), torch.tensor([1.0, 0.5])
    >>> tinker_loss_terms('cross_entropy', lp, {'weights': weights}).loss.item()  # -(-1 * 1 + -2 * 0.5)
    2.0
    >>> rl = {'logprobs': lp, 'advantages': torch.tensor([1.0, 2.0])}
    >>> tinker_loss_terms('importance_sampling', lp, rl).loss.item()  # ratio 1: -(1 + 2)
    -3.0
    """
    spec = tinker_loss_spec(loss_fn)
    resolved = resolve_config(loss_fn, config)
    check_inputs(loss_fn, inputs)
    _check_flat(loss_fn, logprobs_T, inputs, sequence_ids_T)
    floats = {name: value.to(logprobs_T.dtype) for name, value in inputs.items() if name != 'target_tokens'}
    if sequence_ids_T is None:
        sequence_ids_T = torch.zeros(logprobs_T.shape, dtype=torch.long, device=logprobs_T.device)
    return spec.compute(logprobs_T, floats, resolved, sequence_ids_T.long())


@LOSSES.register
class TinkerLoss(Loss):
    """A Tinker built-in loss (module docstring) on a padded or packed batch.

    The caller sets ``labels`` to each datum's ``target_tokens`` at every position, so every
    labelled position is one of the datum's ``N`` positions and ``-100`` marks only padding. Loss
    inputs come one entry per datum, in row order: each a list or 1-D tensor of ``N`` values,
    as ``model.forward_backward(inputs=rows, advantages=[...], logprobs=[...])`` passes them.
    ``target_tokens``, when passed, must equal the labels.

    The loss is a plain sum and ``num_items`` is 0: gradients of successive ``forward_backward``
    calls add up undivided until the optimizer step, as on Tinker.

    After each call, ``last_logps`` holds the label logprobs ``[B, S]`` (detached, 0 at padding)
    and ``last_metrics`` the metrics, for a server to return per datum.

    Example: ``TinkerLoss('ppo', {'clip_low_threshold': 0.9, 'clip_high_threshold': 1.1})``.
    """

    output_reads = 'logps'

    def __init__(self, loss_fn: str, config: Mapping[str, float] | None = None, ignore_index: int = IGNORE_INDEX):
        self.spec = tinker_loss_spec(loss_fn)
        self.loss_fn = loss_fn
        self.config = resolve_config(loss_fn, config)
        self.ignore_index = ignore_index
        self.last_logps: torch.Tensor | None = None
        self.last_metrics: dict[str, torch.Tensor] = {}
        # The share of the loss this process trains on: 1, or 0 on the ranks of a model group
        # that run a request whole beside rank 0 (its metrics and logprobs stay whole).
        self.share = 1.0

    def __call__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], **loss_inputs: Any) -> LossOutput:
        given = {name: value for name, value in loss_inputs.items() if value is not None}
        check_inputs(self.loss_fn, given)
        grid = output_grid(inputs, outputs, self.ignore_index)
        flat = {name: grid.align(value, name, allow_scalar=False)[grid.mask] for name, value in given.items()}
        seq_T = grid.seq_index[grid.mask]
        if 'target_tokens' in flat:
            _check_targets(flat.pop('target_tokens'), inputs['labels'][grid.mask], seq_T)
        loss, metrics = tinker_loss_terms(self.loss_fn, grid.logps[grid.mask], flat, self.config, seq_T)
        self.last_logps, self.last_metrics = grid.logps.detach(), metrics
        loss = loss if self.share == 1.0 else loss * self.share
        return LossOutput(loss=loss, num_items=torch.zeros((), device=loss.device), metrics=metrics)


# ---- helpers ------------------------------------------------------------------------------------
def _terms(loss: torch.Tensor, **sums: torch.Tensor) -> LossTerms:
    metrics = {'loss:sum': loss.detach()}
    metrics.update({f'{name}:sum': value.detach().float() for name, value in sums.items()})
    return LossTerms(loss, metrics)


def _log_ratio(logprobs_T: torch.Tensor, old_T: torch.Tensor) -> torch.Tensor:
    return (logprobs_T - old_T).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _thresholds(
    inputs: Mapping[str, torch.Tensor], config: Mapping[str, float], like_T: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position clip thresholds: the per-token inputs where given, else the config."""
    low_T, high_T = (
        inputs[key].to(like_T.dtype) if key in inputs else torch.full_like(like_T.detach(), config[key])
        for key in _CLIP_KEYS
    )
    bad = (low_T < 0) | (low_T > high_T)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise DataError(
            f'clip thresholds at position {index} are clip_low_threshold={low_T[index].item()}, '
            f'clip_high_threshold={high_T[index].item()}; 0 <= low <= high is required'
        )
    return low_T, high_T


def _clipped_surrogate(
    ratio_T: torch.Tensor, advantages_T: torch.Tensor, low_T: torch.Tensor, high_T: torch.Tensor
) -> LossTerms:
    """``-min(r A, clip(r, low, high) A).sum()``, and how many positions the clip took."""
    unclipped_T = ratio_T * advantages_T
    clipped_T = ratio_T.clamp(low_T, high_T) * advantages_T
    taken = (clipped_T < unclipped_T).sum()  # the clipped branch is the minimum: no gradient there
    return _terms(-torch.minimum(unclipped_T, clipped_T).sum(), clipped=taken)


def _sequence_mean(values_T: torch.Tensor, include_T: torch.Tensor, seq_T: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the included positions of each sequence, broadcast back to every
    position of that sequence (0 for a sequence with none included)."""
    _, group_T = torch.unique(seq_T, return_inverse=True)
    groups = int(group_T.max()) + 1 if group_T.numel() else 0
    sums_G = values_T.new_zeros(groups).index_add(0, group_T, torch.where(include_T, values_T, 0.0))
    counts_G = values_T.new_zeros(groups).index_add(0, group_T, include_T.to(values_T.dtype))
    return (sums_G / counts_G.clamp(min=1))[group_T]


def _check_targets(targets_T: torch.Tensor, labels_T: torch.Tensor, seq_T: torch.Tensor) -> None:
    """``target_tokens`` (laid out as float32, exact for ids below 2^24) must equal the labels."""
    bad = targets_T != labels_T.to(targets_T.dtype)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        sequence = int(seq_T[index])
        position = int((seq_T[:index] == sequence).sum())
        raise DataError(
            f'target_tokens[{sequence}][{position}] is {int(targets_T[index])} but the batch labels '
            f'have {int(labels_T[index])} there: labels must be the target tokens'
        )
