"""Tensor helpers the RL losses share: label log-probabilities, which sequence each position
belongs to, and per-sequence loss inputs laid out onto the ``[batch, seq]`` grid.

A batch comes either padded (one sequence per row) or packed (``padding_free``: the sequences
of a batch concatenated into one row, ``position_ids`` restarting at 0 at each sequence). The
helpers here number the sequences the same way in both layouts, in the order the rows were
given, so a loss written with them gives the same value for either layout.

Shapes: ``B`` batch rows, ``S`` positions, ``V`` vocabulary, ``N`` sequences.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, Literal, TypeGuard

import torch

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError, DataError, one_of

#: Log-ratios are clamped to this range before ``exp``: a ratio of e^20 is already meaningless
#: and an overflow to ``inf`` would turn the loss into NaN.
LOG_RATIO_LIMIT = 20.0
#: Positions per chunk when computing the entropy, to bound the float32 copy of the logits.
_ENTROPY_CHUNK = 1024


def token_logps(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``log softmax(logits)[label]`` at each position, float32 ``[B, S]``, 0 where ignored.

    ``gather - logsumexp`` keeps one float32 copy of the logits for the backward pass, where
    ``log_softmax`` would keep a second one of the same size.

    >>> token_logps(torch.zeros(1, 2, 4), torch.tensor([[3, -100]])).tolist()  # ln(1/4), ignored
    [[-1.3862943649291992, 0.0]]
    """
    if logits_BSV.shape[:-1] != labels_BS.shape:
        raise DataError(f'logits {tuple(logits_BSV.shape)} do not match labels {tuple(labels_BS.shape)}')
    mask_BS = labels_BS != ignore_index
    logits_BSV = logits_BSV.float()
    picked_BS = logits_BSV.gather(-1, labels_BS.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(mask_BS, picked_BS - logits_BSV.logsumexp(-1), 0.0)


@torch.no_grad()
def token_entropy(logits_BSV: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum_v p log p`` of the next-token distribution at the masked positions,
    ``[B, S]`` float32, 0 elsewhere. No gradient; computed in float32 a chunk of positions at a
    time, so only a chunk of the logits is ever copied.

    >>> token_entropy(torch.zeros(1, 2, 4), torch.tensor([[True, False]])).tolist()  # ln 4, masked
    [[1.3862943649291992, 0.0]]
    """
    flat_PV = logits_BSV.detach().reshape(-1, logits_BSV.shape[-1])
    out_P = torch.zeros(flat_PV.shape[0], dtype=torch.float32, device=flat_PV.device)
    for rows in torch.split(mask_BS.reshape(-1).nonzero().squeeze(1), _ENTROPY_CHUNK):
        z = flat_PV[rows].float()
        # H = logsumexp(z) - sum_v softmax(z)_v z_v
        out_P[rows] = z.logsumexp(-1) - (z.softmax(-1) * z).sum(-1)
    return out_P.reshape(mask_BS.shape)


def sequence_index(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The sequence each position belongs to, ``[B, S]`` long, numbered 0.. across the batch.

    A sequence starts wherever ``position_ids`` is 0 (and ``attention_mask``, when given, is 1,
    so that padding never starts one); each row holds at least one sequence. A padded batch
    therefore numbers its rows, a packed row numbers its sequences. Without ``position_ids``
    every row is one sequence. Left padding sits before the first start and joins that
    sequence (it is never trained on).

    >>> sequence_index({'labels': torch.zeros(1, 5), 'position_ids': torch.tensor([[0, 1, 2, 0, 1]])}).tolist()
    [[0, 0, 0, 1, 1]]
    """
    labels = inputs['labels']
    rows, width = labels.shape
    positions = inputs.get('position_ids')
    if positions is None:
        return torch.arange(rows, device=labels.device).unsqueeze(1).expand(rows, width)
    if positions.shape != labels.shape:
        raise DataError(f'position_ids {tuple(positions.shape)} do not match labels {tuple(labels.shape)}')
    starts_BS = positions == 0
    if inputs.get('attention_mask') is not None:
        starts_BS = starts_BS & inputs['attention_mask'].bool()
    within_BS = (starts_BS.long().cumsum(1) - 1).clamp(min=0)
    per_row_B = starts_BS.sum(1).clamp(min=1)
    offset_B = per_row_B.cumsum(0) - per_row_B
    return within_BS + offset_B.unsqueeze(1)


def sequence_sum(values_BS: torch.Tensor, seq_index_BS: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Sum ``values`` over the positions of each sequence, ``[N]`` (differentiable)."""
    out_N = values_BS.new_zeros(num_sequences)
    return out_N.index_add(0, seq_index_BS.reshape(-1), values_BS.reshape(-1))


def align_per_token(
    values: Any,
    mask_BS: torch.Tensor,
    seq_index_BS: torch.Tensor,
    name: str,
    *,
    allow_scalar: bool = True,
) -> torch.Tensor:
    """Lay a per-sequence loss input onto the ``[B, S]`` grid, float32 on the mask's device.

    ``values`` is one of:

    - a tensor of shape ``[B, S]``: detached, moved, cast and zeroed outside ``mask``;
    - a 1-D tensor or a list with one number per sequence: broadcast over that sequence's
      trained (masked) positions (refused when ``allow_scalar`` is False: log-probabilities
      are per token);
    - a list with, per sequence, a list (or 1-D tensor) of one value per trained position,
      scattered onto those positions in order.

    Positions outside ``mask`` are 0. A wrong number of sequences or of values, or a NaN or
    infinite value, raises ``DataError`` naming ``name`` and the index.

    >>> mask, seq = torch.tensor([[True, True, False, True]]), torch.tensor([[0, 0, 0, 1]])
    >>> align_per_token([[0.5, 0.25], 2.0], mask, seq, 'advantages').tolist()
    [[0.5, 0.25, 0.0, 2.0]]
    """
    device = mask_BS.device
    if isinstance(values, torch.Tensor) and values.dim() == 2:
        if values.shape != mask_BS.shape:
            raise DataError(f'{name} has shape {tuple(values.shape)}; the batch is {tuple(mask_BS.shape)}')
        # where(), not a product: a NaN at an untrained position must not leak in.
        out_BS = torch.where(mask_BS, values.detach().to(device=device, dtype=torch.float32), 0.0)
        _check_finite_grid(out_BS, name)
        return out_BS
    counts = sequence_counts(mask_BS, seq_index_BS).tolist()
    entries = _as_entries(values, name)
    if len(entries) != len(counts):
        raise DataError(f'{name} has {len(entries)} entries for {len(counts)} sequences in the batch')
    flat: list[float] = []
    for index, (entry, count) in enumerate(zip(entries, counts, strict=True)):
        flat.extend(_expand(entry, count, index, name, allow_scalar))
    out_BS = torch.zeros(mask_BS.shape, dtype=torch.float32, device=device)
    # Trained positions in row-major order are grouped by sequence, in sequence order.
    return out_BS.masked_scatter(mask_BS, torch.tensor(flat, dtype=torch.float32, device=device))


def sequence_counts(mask_BS: torch.Tensor, seq_index_BS: torch.Tensor) -> torch.Tensor:
    """Trained (masked) positions per sequence, ``[N]`` long; ``N`` is the number of sequences
    (reading it costs one device sync)."""
    num_sequences = int(seq_index_BS.max()) + 1 if seq_index_BS.numel() else 0
    counts_N = torch.zeros(num_sequences, dtype=torch.long, device=mask_BS.device)
    return counts_N.index_add_(0, seq_index_BS.reshape(-1), mask_BS.reshape(-1).long())


@dataclass(frozen=True)
class TokenGrid:
    """A batch's labels on the ``[B, S]`` grid: where each loss here starts.

    >>> inputs = {'labels': torch.tensor([[-100, 3, 1, 2]]), 'position_ids': torch.tensor([[0, 1, 0, 1]])}
    >>> grid = token_grid(inputs, torch.zeros(1, 4, 4))  # uniform over 4 tokens: ln(1/4) per label
    >>> grid.counts.tolist(), grid.sequence_sum(grid.logps).tolist()
    ([1, 2], [-1.3862943649291992, -2.7725887298583984])
    """

    #: The policy's log-probability of each label, float32 with grad; 0 where not trained.
    logps: torch.Tensor
    #: Trained (labelled) positions, bool.
    mask: torch.Tensor
    #: The sequence of each position, long (``sequence_index``).
    seq_index: torch.Tensor

    @cached_property
    def counts(self) -> torch.Tensor:
        """Trained positions per sequence, ``[N]`` (``sequence_counts``: one device sync)."""
        return sequence_counts(self.mask, self.seq_index)

    @property
    def num_sequences(self) -> int:
        return int(self.counts.shape[0])

    def align(self, values: Any, name: str, *, allow_scalar: bool = True) -> torch.Tensor:
        """A per-sequence loss input laid onto this grid (``align_per_token``)."""
        return align_per_token(values, self.mask, self.seq_index, name, allow_scalar=allow_scalar)

    def sequence_sum(self, values_BS: torch.Tensor) -> torch.Tensor:
        """``values`` summed over each sequence's positions, ``[N]`` (differentiable)."""
        return sequence_sum(values_BS, self.seq_index, self.num_sequences)


def token_grid(
    inputs: Mapping[str, torch.Tensor], logits_BSV: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> TokenGrid:
    """The labels of ``inputs`` (padded or packed) on the grid, with their log-probabilities."""
    labels_BS = inputs['labels']
    mask_BS = labels_BS != ignore_index
    return TokenGrid(token_logps(logits_BSV, labels_BS, ignore_index), mask_BS, sequence_index(inputs))


def output_grid(
    inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, Any], ignore_index: int = IGNORE_INDEX
) -> TokenGrid:
    """``token_grid`` of a forward's ``outputs``: the label logprobs the fused output layer
    computed (``outputs['logps']``, see ``Loss.output_reads``), else those of its ``logits``."""
    if 'logps' not in outputs:
        return token_grid(inputs, outputs['logits'], ignore_index)
    labels_BS = inputs['labels']
    logps_BS = outputs['logps']
    if logps_BS.shape != labels_BS.shape:
        raise DataError(f'logps {tuple(logps_BS.shape)} do not match labels {tuple(labels_BS.shape)}')
    return TokenGrid(logps_BS, labels_BS != ignore_index, sequence_index(inputs))


def output_entropy(outputs: Mapping[str, Any], mask_BS: torch.Tensor) -> torch.Tensor:
    """``token_entropy`` of a forward's ``outputs``: the fused output layer's (detached), else the logits'."""
    if 'entropy' in outputs:
        return torch.where(mask_BS, outputs['entropy'].detach(), 0.0)
    return token_entropy(outputs['logits'], mask_BS)


def reference_logps(kwargs: Mapping[str, Any], outputs: Mapping[str, Any]) -> Any:
    """The reference model's log-probabilities: ``ref_logps=`` when given, else the model's
    ``outputs['ref_logps']`` (the base model with the adapter off), else ``None``."""
    given = kwargs.get('ref_logps')
    return given if given is not None else outputs.get('ref_logps')


def check_loss_kwargs(loss_name: str, kwargs: dict[str, Any], accepted: Sequence[str]) -> None:
    """Refuse loss inputs a loss does not read, naming the ones it does."""
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigurationError(
            f'{loss_name} got unknown loss inputs {unknown}. Accepted inputs are: {sorted(accepted)}'
        )


def is_finite_number(value: object) -> TypeGuard[int | float]:
    """A real ``int`` or ``float`` (not a bool), neither NaN nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---- rollout correction -------------------------------------------------------------------------
RolloutLevel = Literal['token', 'sequence', 'geometric']
RolloutMode = Literal['truncate', 'mask']
_LEVELS = ('token', 'sequence', 'geometric')
_MODES = ('truncate', 'mask')


@dataclass(frozen=True)
class RolloutCorrection:
    """Importance sampling between the sampler (the behaviour policy) and the trainer: the
    "rollout correction" of Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training" (fengyao.notion.site/off-policy-rl), and verl's ``rollout_is`` /
    ``rollout_rs``. A sampler (vLLM, other kernels, other precision, an older weight version)
    does not give the trainer's probabilities, so its tokens are off-policy; the weight ::

        w = pi_old(y) / pi_sampler(y) = exp(logp_old - logp_sampler)

    reweights each token's term. ``logp_old`` is the trainer's "old" policy: ``proximal_logps``
    when the caller gives them (the policy before this step's updates, PPO epochs after the
    first), else the current log-probs detached (the first, on-policy epoch). Per ``level``:

    - ``'token'``: one weight per token, ``w_t = exp(logp_old_t - logp_sampler_t)``;
    - ``'sequence'``: the product of the sequence's token weights (the exact sequence IS weight,
      ``exp(sum_t ...)``), given to each of its tokens;
    - ``'geometric'``: their geometric mean, ``exp(mean_t ...)``: length-independent, so one
      threshold suits short and long sequences (verl's ``rollout_rs='geometric'``).

    and per ``mode``:

    - ``'truncate'`` (TIS): ``min(w, threshold)``, detached, multiplies the token's loss term;
    - ``'mask'`` (MIS): ``w`` multiplies the term where ``threshold_low <= w <= threshold``; a token
      (at ``'sequence'``/``'geometric'`` level: the whole sequence) outside leaves the batch: it
      adds nothing to the loss nor to ``num_items``. ``threshold_low`` defaults to ``1 / threshold``.

    Log-ratios are clamped to +-``LOG_RATIO_LIMIT`` before ``exp``. A weight of 1 (sampler and
    trainer agree) is always in range, so with equal log-probs the loss is the uncorrected one.

    >>> RolloutCorrection(level='token', mode='mask', threshold=2.0).bounds()
    (0.5, 2.0)
    """

    level: RolloutLevel = 'token'
    mode: RolloutMode = 'truncate'
    #: The largest weight kept (mask) or the cap (truncate); >= 1.
    threshold: float = 2.0
    #: The smallest weight kept, mask mode only; in [0, 1], default ``1 / threshold``.
    threshold_low: float | None = None

    def __post_init__(self) -> None:
        if self.level not in _LEVELS:
            raise one_of('RolloutCorrection level', self.level, _LEVELS)
        if self.mode not in _MODES:
            raise one_of('RolloutCorrection mode', self.mode, _MODES)
        if not is_finite_number(self.threshold) or self.threshold < 1:
            raise ConfigurationError(
                f'RolloutCorrection threshold must be a finite number >= 1 (a weight of 1, on-policy, must be '
                f'kept); got {self.threshold!r}'
            )
        if self.threshold_low is None:
            return
        if self.mode == 'truncate':
            raise ConfigurationError(
                f"RolloutCorrection threshold_low={self.threshold_low!r} bounds mode='mask' only; "
                "mode='truncate' caps the weight at threshold"
            )
        if not is_finite_number(self.threshold_low) or not 0 <= self.threshold_low <= 1:
            raise ConfigurationError(
                f'RolloutCorrection threshold_low must be a number in [0, 1] (a weight of 1 must be kept); '
                f'got {self.threshold_low!r}'
            )

    @classmethod
    def of(cls, value: RolloutCorrection | Mapping[str, Any] | None) -> RolloutCorrection | None:
        """A ``RolloutCorrection`` from itself, its fields as a mapping (a loss set over the wire),
        or ``None`` (no correction)."""
        if value is None or isinstance(value, RolloutCorrection):
            return value
        if not isinstance(value, Mapping):
            raise ConfigurationError(
                f'rollout_correction must be a RolloutCorrection, a dict of its fields or None; '
                f'got {type(value).__name__}'
            )
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ConfigurationError(f'RolloutCorrection got unknown fields {unknown}; its fields are {names}')
        return cls(**value)

    def bounds(self) -> tuple[float, float]:
        """The range of weights a token keeps: ``(0, threshold)`` when truncating (nothing is
        dropped), ``(threshold_low, threshold)`` when masking."""
        if self.mode == 'truncate':
            return 0.0, float(self.threshold)
        low = 1.0 / self.threshold if self.threshold_low is None else self.threshold_low
        return float(low), float(self.threshold)

    def weights(
        self, log_ratio_BS: torch.Tensor, mask_BS: torch.Tensor, seq_index_BS: torch.Tensor, counts_N: torch.Tensor
    ) -> RolloutWeights:
        """The weights of ``log_ratio = logp_old - logp_sampler`` on the trained positions
        ``mask`` (``seq_index`` and ``counts`` as ``TokenGrid``'s)."""
        log_ratio_BS = log_ratio_BS.detach() * mask_BS
        if self.level != 'token':
            seq_N = sequence_sum(log_ratio_BS, seq_index_BS, counts_N.shape[0])
            if self.level == 'geometric':
                seq_N = seq_N / counts_N.clamp(min=1)
            log_ratio_BS = seq_N[seq_index_BS] * mask_BS
        raw_BS = log_ratio_BS.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp() * mask_BS
        low, high = self.bounds()
        if self.mode == 'truncate':
            return RolloutWeights(raw_BS, raw_BS.clamp(max=high), mask_BS, (raw_BS > high) & mask_BS)
        keep_BS = (raw_BS >= low) & (raw_BS <= high) & mask_BS
        return RolloutWeights(raw_BS, torch.where(keep_BS, raw_BS, 0.0), keep_BS, mask_BS & ~keep_BS)


@dataclass(frozen=True)
class RolloutWeights:
    """What ``RolloutCorrection.weights`` gives, on the ``[B, S]`` grid, all detached."""

    #: ``exp(logp_old - logp_sampler)`` at the correction's level, before truncating or masking
    #: (0 outside the trained positions).
    raw: torch.Tensor
    #: The factor each token's loss term takes (0 where masked).
    applied: torch.Tensor
    #: The trained positions that stay in the batch (all of them when truncating).
    keep: torch.Tensor
    #: Trained positions whose weight was truncated (truncate) or that were dropped (mask).
    cut: torch.Tensor


# ---- helpers ------------------------------------------------------------------------------------
def _as_entries(values: Any, name: str) -> list[Any]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise DataError(
                f'{name} must be a [batch, seq] tensor, a 1-D tensor or a list; got shape {tuple(values.shape)}'
            )
        return values.detach().cpu().tolist()
    if isinstance(values, Sequence) and not isinstance(values, str):
        return list(values)
    raise DataError(f'{name} must be a list with one entry per sequence or a tensor; got {type(values).__name__}')


def _expand(entry: Any, count: int, index: int, name: str, allow_scalar: bool) -> list[float]:
    """One sequence's entry as ``count`` floats."""
    if isinstance(entry, torch.Tensor):
        entry = entry.item() if entry.dim() == 0 else entry.detach().cpu().tolist()
    if isinstance(entry, (int, float)) and not isinstance(entry, bool):
        if not allow_scalar:
            raise DataError(
                f'{name}[{index}] is a single number; {name} needs one value per completion token ({count})'
            )
        _check_finite(float(entry), f'{name}[{index}]')
        return [float(entry)] * count
    if not isinstance(entry, Sequence) or isinstance(entry, str):
        raise DataError(f'{name}[{index}] must be a number or a list of numbers; got {type(entry).__name__}')
    if len(entry) != count:
        raise DataError(
            f'{name}[{index}] has {len(entry)} values but sequence {index} has {count} completion '
            f'(trained) tokens: expected {count}'
        )
    floats = [float(v) for v in entry]
    for position, value in enumerate(floats):
        _check_finite(value, f'{name}[{index}][{position}]')
    return floats


def _check_finite(value: float, where: str) -> None:
    if not math.isfinite(value):
        raise DataError(f'{where} is {value}; loss inputs must be finite numbers')


def _check_finite_grid(values_BS: torch.Tensor, name: str) -> None:
    bad = ~torch.isfinite(values_BS)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise DataError(f'{name}[{row}, {col}] is {float(values_BS[row, col])}; loss inputs must be finite numbers')
