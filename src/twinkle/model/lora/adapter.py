"""The pieces every per-row LoRA layer shares: an adapter's spec, its A/B pair, and which rows of
a batch go through which adapter (``RowAssignment``).

``multi_lora.MultiLoraLinear`` applies them to ``nn.Linear`` layers, ``expert_lora.MultiLoraExperts``
to a mixture of experts' fused weight stacks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from twinkle.errors import ConfigurationError, DataError, one_of

_ADAPTER_NAME = re.compile(r'^[A-Za-z0-9_:-]+$')


#: ``LoraSpec.init`` values: how a new adapter's A and B are drawn (peft's ``init_lora_weights``
#: True, 'gaussian' and False). The first two keep B = 0, so a new adapter starts as the base model.
LORA_INITS = ('kaiming', 'gaussian', 'random')


@dataclass(frozen=True)
class LoraSpec:
    """One adapter's shape and where it goes."""

    # Rank of A [r, in] and B [out, r]; > 0.
    r: int
    # The delta is scaled by alpha / r (alpha / sqrt(r) with use_rslora).
    alpha: float
    # Leaf (or dotted suffix) names of the linear layers to adapt, a regular expression the whole
    # layer path must match, or 'all-linear' (every nn.Linear but the output head, as peft does).
    target_modules: tuple[str, ...] | str = 'all-linear'
    # Dropout on the adapter's input, in [0, 1).
    dropout: float = 0.0
    # One of LORA_INITS.
    init: str = 'kaiming'
    # Rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski 2023, "A Rank Stabilization Scaling Factor").
    use_rslora: bool = False
    # Fused expert weights to adapt, as peft's ``target_parameters``: '<module path suffix>.<name>'
    # (e.g. 'mlp.experts.gate_up_proj'). 'all-linear' adapts every expert stack as well.
    target_parameters: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r


class LoraAdapter(nn.Module):
    """One adapter of one layer: ``lora_A`` [r, in] then ``lora_B`` [out, r], scaled.

    Without a ``generator`` the weights are drawn from the global RNG in the order and manner
    peft draws them, so ``torch.manual_seed(s)`` gives the adapter peft gives for that seed."""

    def __init__(self, base: nn.Linear, spec: LoraSpec, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self._build(base.in_features, base.out_features, base.weight, spec, generator, experts=1)

    def _build(
        self,
        in_features: int,
        out_features: int,
        base_weight: torch.Tensor,
        spec: LoraSpec,
        generator: torch.Generator | None,
        experts: int,
    ) -> None:
        """A [r * experts, in] and B [out, r * experts], drawn as peft draws them (``experts`` > 1:
        one rank-r pair per expert, laid out as peft's ``ParamWrapper`` lays them out)."""
        check_spec(spec)
        # Like peft's autocast_adapter_dtype: half-precision bases get float32 adapters.
        dtype = torch.float32 if base_weight.dtype in (torch.float16, torch.bfloat16) else base_weight.dtype
        build = {'device': 'meta'} if generator is not None else {}
        self.lora_A = nn.Linear(in_features, spec.r * experts, bias=False, **build)
        self.lora_B = nn.Linear(spec.r * experts, out_features, bias=False, **build)
        if generator is not None:
            self.to_empty(device='cpu')
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
            nn.init.kaiming_uniform_(self.lora_B.weight, a=math.sqrt(5), generator=generator)
        initialise(self.lora_A.weight.data, self.lora_B.weight.data, spec, generator)
        self.to(device=base_weight.device, dtype=dtype)
        self.scaling = spec.scaling
        # A probability, not an nn.Dropout module: one module fewer per layer and adapter (the
        # same draws, through the same function).
        self.dropout = spec.dropout

    def forward(self, x_N_I: torch.Tensor) -> torch.Tensor:
        x_N_I = nn.functional.dropout(x_N_I.to(self.lora_A.weight.dtype), self.active_dropout)
        delta_N_O: torch.Tensor = self.lora_B(self.lora_A(x_N_I)) * self.scaling
        return delta_N_O

    @property
    def active_dropout(self) -> float:
        """The dropout probability this forward applies: none in eval mode."""
        return self.dropout if self.training else 0.0

    def delta_weight(self) -> torch.Tensor:
        """B @ A * scaling [out, in]: what merging the adapter adds to the base weight."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling


def initialise(lora_A: torch.Tensor, lora_B: torch.Tensor, spec: LoraSpec, generator: torch.Generator | None) -> None:
    """peft's ``reset_lora_parameters``: A re-drawn, B zero; 'random' keeps nn.Linear's draws."""
    if spec.init == 'kaiming':  # A like nn.Linear's own init (Hu et al. 2021, section 4.1)
        nn.init.kaiming_uniform_(lora_A, a=math.sqrt(5), generator=generator)
    elif spec.init == 'gaussian':
        nn.init.normal_(lora_A, std=1 / spec.r, generator=generator)
    if spec.init != 'random':
        nn.init.zeros_(lora_B)


def check_spec(spec: LoraSpec) -> None:
    if isinstance(spec.r, bool) or not isinstance(spec.r, int) or spec.r <= 0:
        raise ConfigurationError(f'Invalid LoRA rank r={spec.r!r}: it must be an integer > 0')
    if not math.isfinite(spec.alpha) or spec.alpha <= 0:
        raise ConfigurationError(f'Invalid LoRA alpha={spec.alpha!r}: it must be a finite number > 0')
    if not 0 <= spec.dropout < 1:
        raise ConfigurationError(f'Invalid LoRA dropout={spec.dropout!r}: it must be in [0, 1)')
    if spec.init not in LORA_INITS:
        raise one_of('LoRA init', spec.init, LORA_INITS)


@dataclass
class RowAssignment:
    """Which rows of the batch use which adapter; shared by every layer of one forward."""

    # One entry per row: an adapter name, or None for the base model only. None here (not a
    # tuple): one name for every row whatever the batch size, the single key of ``rows``.
    names: tuple[str | None, ...] | None
    # Adapter name -> indices of its rows (CPU, int64); None: all rows.
    rows: dict[str, torch.Tensor | None]
    # When each name's rows are contiguous (a mixed pass lays tenants out so): (name, start,
    # end) runs covering the batch in order, which a layer slices instead of gathering.
    runs: list[tuple[str | None, int, int]] | None = None
    _by_device: dict[torch.device, dict[str, torch.Tensor | None]] = field(default_factory=dict)
    # Token-level assignments by token count, for layers that see the batch flattened (below).
    _flat: dict[int, RowAssignment] = field(default_factory=dict)

    @classmethod
    def from_names(cls, names: Sequence[str | None] | str | None) -> RowAssignment:
        if names is None or isinstance(names, str):
            return cls(None, {} if names is None else {names: None})
        rows: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            if name is not None:
                rows.setdefault(name, []).append(i)
        if len(rows) == 1 and len(next(iter(rows.values()))) == len(names):  # one adapter for the whole batch
            return cls(tuple(names), dict.fromkeys(rows))
        indices: dict[str, torch.Tensor | None] = {n: torch.tensor(idx, dtype=torch.long) for n, idx in rows.items()}
        return cls(tuple(names), indices, contiguous_runs(names))

    def over(self, count: int) -> RowAssignment:
        """This assignment for a layer input of ``count`` leading rows: the batch's rows, or its
        tokens when a block flattens [B, T, ...] to [B * T, ...] (an MoE block's experts and
        shared expert do), each token through its row's adapter."""
        if self.names is None or count == len(self.names):
            return self
        if count % len(self.names):
            raise DataError(f'row_adapters assigned {len(self.names)} rows but the batch has {count} rows')
        if count not in self._flat:
            per_row = count // len(self.names)
            self._flat[count] = RowAssignment.from_names([name for name in self.names for _ in range(per_row)])
        return self._flat[count]

    def place(self, devices: Iterable[torch.device]) -> RowAssignment:
        """Copy the row indices to ``devices`` now, before the forward: a compiled layer that
        found the copy missing in one layer and present in the next would compile twice (dynamo
        guards on the cache's contents)."""
        for device in devices:
            self.rows_on(device)
        return self

    def rows_on(self, device: torch.device) -> dict[str, torch.Tensor | None]:
        """The row indices on ``device``, copied there once per forward (``place``)."""
        if device not in self._by_device:
            self._by_device[device] = {n: None if i is None else i.to(device) for n, i in self.rows.items()}
        return self._by_device[device]


def contiguous_runs(names: Sequence[str | None]) -> list[tuple[str | None, int, int]] | None:
    """``names`` as (name, start, end) runs, or None when some name's rows are not all in one run."""
    runs: list[tuple[str | None, int, int]] = []
    for i, name in enumerate(names):
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1], i + 1)
        else:
            runs.append((name, i, i + 1))
    named = [name for name, _, _ in runs if name is not None]
    return runs if len(named) == len(set(named)) else None


def check_name(name: str) -> None:
    if not isinstance(name, str) or not _ADAPTER_NAME.match(name):
        raise ConfigurationError(
            f'Invalid adapter name {name!r}: it must be non-empty letters, digits, "_", "-" or ":"'
        )
