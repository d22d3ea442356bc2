"""Per-row LoRA: one frozen base model, many named adapters, each row of a batch through its own.

peft applies one active adapter to the whole batch. Here every targeted ``nn.Linear`` becomes a
``MultiLoraLinear`` that keeps any number of adapters (own rank, alpha and target layers) and
adds, for each adapter present in the batch, its delta to that adapter's rows only::

    y = base(x);  y[rows_a] += dropout(x[rows_a]) @ A_a^T @ B_a^T * alpha_a / r_a   (Hu et al. 2021, eq. 3)

The rows of an adapter are gathered, multiplied and scatter-added back, so an adapter's
gradient comes only from its own rows and a row's numbers do not depend on its neighbours.
Which row uses which adapter is set for the whole model by the ``row_adapters`` context.

Example::

    inject(model, {'alice': LoraSpec(r=8, alpha=16), 'bob': LoraSpec(r=4, alpha=8, target_modules=('q_proj',))})
    optimizers = {name: torch.optim.AdamW(adapter_parameters(model, name)) for name in ('alice', 'bob')}
    with row_adapters(model, ['alice', 'bob', None]):  # row 2 sees the base model only
        loss = model(input_ids).logits.sum()
        loss.backward()  # inside the context when gradient checkpointing recomputes layers
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from twinkle.errors import ConfigurationError, DataError, StateError, UnknownNameError, one_of

_ADAPTER_NAME = re.compile(r'^[A-Za-z0-9_-]+$')


def _init_kaiming(lora_A: torch.Tensor, lora_B: torch.Tensor, generator: torch.Generator | None) -> None:
    # peft's default (init_lora_weights=True): A like nn.Linear's own init, B zero, so delta = 0.
    nn.init.kaiming_uniform_(lora_A, a=math.sqrt(5), generator=generator)
    nn.init.zeros_(lora_B)


def _init_gaussian(lora_A: torch.Tensor, lora_B: torch.Tensor, generator: torch.Generator | None) -> None:
    # peft's init_lora_weights='gaussian': A ~ N(0, 1/r), B zero.
    nn.init.normal_(lora_A, std=1 / lora_A.shape[0], generator=generator)
    nn.init.zeros_(lora_B)


LORA_INITS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Generator | None], None]] = {
    'kaiming': _init_kaiming,
    'gaussian': _init_gaussian,
}


@dataclass(frozen=True)
class LoraSpec:
    """One adapter's shape and where it goes."""

    # Rank of A [r, in] and B [out, r]; > 0.
    r: int
    # The delta is scaled by alpha / r.
    alpha: float
    # Leaf (or dotted suffix) names of the linear layers to adapt, or 'all-linear' (every
    # nn.Linear but the output head, as peft does).
    target_modules: tuple[str, ...] | str = 'all-linear'
    # Dropout on the adapter's input, in [0, 1).
    dropout: float = 0.0
    # A name in LORA_INITS; both keep B = 0, so a new adapter starts as the base model.
    init: str = 'kaiming'


class LoraAdapter(nn.Module):
    """One adapter of one layer: ``lora_A`` [r, in], ``lora_B`` [out, r], scaling alpha / r."""

    def __init__(self, base: nn.Linear, spec: LoraSpec, generator: torch.Generator | None = None):
        super().__init__()
        _check_spec(spec)
        # Like peft's autocast_adapter_dtype: half-precision bases get float32 adapters.
        dtype = torch.float32 if base.weight.dtype in (torch.float16, torch.bfloat16) else base.weight.dtype
        kwargs = {'dtype': dtype, 'device': base.weight.device}
        self.lora_A = nn.Parameter(torch.empty(spec.r, base.in_features, **kwargs))
        self.lora_B = nn.Parameter(torch.empty(base.out_features, spec.r, **kwargs))
        LORA_INITS[spec.init](self.lora_A.data, self.lora_B.data, generator)
        self.scaling = spec.alpha / spec.r
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()

    def forward(self, x_N_I: torch.Tensor) -> torch.Tensor:
        x_N_I = self.dropout(x_N_I.to(self.lora_A.dtype))
        return (x_N_I @ self.lora_A.T) @ self.lora_B.T * self.scaling


def _check_spec(spec: LoraSpec) -> None:
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

    # One entry per row: an adapter name, or None for the base model only.
    names: tuple[str | None, ...]
    # Adapter name -> indices of its rows (CPU, int64).
    rows: dict[str, torch.Tensor]
    _by_device: dict[torch.device, dict[str, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def from_names(cls, names: Sequence[str | None]) -> RowAssignment:
        rows: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            if name is not None:
                rows.setdefault(name, []).append(i)
        return cls(tuple(names), {name: torch.tensor(idx, dtype=torch.long) for name, idx in rows.items()})

    def rows_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The row indices on ``device``, copied there once per forward."""
        if device not in self._by_device:
            self._by_device[device] = {name: idx.to(device) for name, idx in self.rows.items()}
        return self._by_device[device]


class MultiLoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus named LoRA adapters, applied per row by ``row_adapters``."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise ConfigurationError(f'MultiLoraLinear wraps an nn.Linear, got {type(base).__name__}')
        self.base = base.requires_grad_(False)
        self.adapters = nn.ModuleDict()
        self.assignment: RowAssignment | None = None

    def add_adapter(
        self,
        name: str,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        init: str = 'kaiming',
        generator: torch.Generator | None = None,
    ) -> LoraAdapter:
        _check_name(name)
        if name in self.adapters:
            raise ConfigurationError(f'Adapter {name!r} already exists in this layer; remove it first')
        adapter = LoraAdapter(self.base, LoraSpec(r, alpha, dropout=dropout, init=init), generator)
        self.adapters[name] = adapter
        return adapter

    def remove_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise UnknownNameError('adapter', name, self.adapters.keys())
        del self.adapters[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, ..., in] -> [B, ..., out]; row b goes through ``assignment.names[b]``."""
        if self.assignment is None:
            raise StateError('MultiLoraLinear ran outside row_adapters(model, names): wrap the forward in it')
        if len(self.assignment.names) != x.shape[0]:
            raise DataError(
                f'row_adapters assigned {len(self.assignment.names)} rows but the batch has {x.shape[0]} rows'
            )
        out = self.base(x)
        for name, idx in self.assignment.rows_on(x.device).items():
            if name not in self.adapters:  # this adapter does not target this layer: base only
                continue
            adapter = self.adapters[name]
            if idx.numel() == x.shape[0]:  # the whole batch: no gather needed
                out = out + adapter(x).to(out.dtype)
            else:
                out = out.index_add(0, idx, adapter(x.index_select(0, idx)).to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f'adapters={list(self.adapters.keys())}'


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _ADAPTER_NAME.match(name):
        raise ConfigurationError(f'Invalid adapter name {name!r}: use letters, digits, "_" and "-" only')


def multi_lora_layers(model: nn.Module) -> dict[str, MultiLoraLinear]:
    """Every ``MultiLoraLinear`` of ``model`` by its dotted path."""
    return {path: module for path, module in model.named_modules() if isinstance(module, MultiLoraLinear)}


def adapter_names(model: nn.Module) -> list[str]:
    """The adapters held by any layer of ``model``, sorted."""
    return sorted({name for layer in multi_lora_layers(model).values() for name in layer.adapters})


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear | MultiLoraLinear]:
    """Candidate layers by path: plain linears and already wrapped ones (not their inner base)."""
    wrapped = multi_lora_layers(model)
    inner = {f'{path}.base' if path else 'base' for path in wrapped}
    plain = {
        path: module
        for path, module in model.named_modules()
        if isinstance(module, nn.Linear) and path not in inner and path
    }
    return {**plain, **wrapped}


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, 'get_output_embeddings', None)
    head = get() if callable(get) else None
    return head.base if isinstance(head, MultiLoraLinear) else head


def resolve_targets(model: nn.Module, target_modules: tuple[str, ...] | str) -> list[str]:
    """Paths of the linear layers ``target_modules`` names (see ``LoraSpec``), sorted."""
    layers = _linear_layers(model)
    if target_modules == 'all-linear':
        head = _output_head(model)
        paths = [p for p, m in layers.items() if m is not head and getattr(m, 'base', None) is not head]
        if not paths:
            raise ConfigurationError('target_modules="all-linear" found no linear layer besides the output head')
        return sorted(paths)
    if isinstance(target_modules, str) or not target_modules:
        raise ConfigurationError(
            f'Invalid target_modules {target_modules!r}: give a non-empty tuple of layer names or "all-linear"'
        )
    paths = set()
    for target in target_modules:
        found = [p for p in layers if p == target or p.endswith(f'.{target}')]
        if not found:
            leaves = sorted({p.rsplit('.', 1)[-1] for p in layers})
            raise ConfigurationError(
                f'target_modules entry {target!r} matches no linear layer; leaf names are {leaves}'
            )
        paths.update(found)
    return sorted(paths)


def _wrap(model: nn.Module, path: str) -> MultiLoraLinear:
    module = model.get_submodule(path)
    if isinstance(module, MultiLoraLinear):
        return module
    parent_path, _, leaf = path.rpartition('.')
    wrapped = MultiLoraLinear(module)
    setattr(model.get_submodule(parent_path), leaf, wrapped)
    return wrapped


def freeze_base(model: nn.Module) -> None:
    """Every parameter that is not an adapter's stops requiring gradients."""
    adapter_params = {id(p) for layer in multi_lora_layers(model).values() for p in layer.adapters.parameters()}
    for param in model.parameters():
        if id(param) not in adapter_params:
            param.requires_grad_(False)


def add_adapter(model: nn.Module, name: str, spec: LoraSpec, generator: torch.Generator | None = None) -> list[str]:
    """Add adapter ``name`` to the layers ``spec.target_modules`` names, wrapping them as needed,
    and freeze the base model. Returns the adapted layer paths. Nothing changes on error."""
    _check_name(name)
    _check_spec(spec)
    if name in adapter_names(model):
        raise ConfigurationError(f'Adapter {name!r} already exists; remove_adapter(model, {name!r}) first')
    paths = resolve_targets(model, spec.target_modules)
    for path in paths:
        _wrap(model, path).add_adapter(name, spec.r, spec.alpha, spec.dropout, spec.init, generator)
    freeze_base(model)
    return paths


def inject(
    model: nn.Module, specs: Mapping[str, LoraSpec], generator: torch.Generator | None = None
) -> dict[str, list[str]]:
    """``add_adapter`` for each named spec; returns each adapter's layer paths."""
    return {name: add_adapter(model, name, spec, generator) for name, spec in specs.items()}


def remove_adapter(model: nn.Module, name: str) -> None:
    """Drop adapter ``name`` from every layer; layers left with no adapter become plain linears again."""
    layers = multi_lora_layers(model)
    holders = {path: layer for path, layer in layers.items() if name in layer.adapters}
    if not holders:
        raise UnknownNameError('adapter', name, adapter_names(model))
    for path, layer in holders.items():
        layer.remove_adapter(name)
        if not layer.adapters:
            parent_path, _, leaf = path.rpartition('.')
            setattr(model.get_submodule(parent_path), leaf, layer.base)


def adapter_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    """The parameters of adapter ``name`` (A then B, layer by layer), e.g. for its own optimizer."""
    return list(adapter_named_parameters(model, name).values())


def adapter_named_parameters(model: nn.Module, name: str) -> dict[str, nn.Parameter]:
    """Adapter ``name``'s parameters keyed '<layer path>.lora_A' / '.lora_B'."""
    params = {
        f'{path}.{pname}': param
        for path, layer in multi_lora_layers(model).items()
        if name in layer.adapters
        for pname, param in layer.adapters[name].named_parameters()
    }
    if not params:
        raise UnknownNameError('adapter', name, adapter_names(model))
    return params


@contextmanager
def row_adapters(model: nn.Module, names: Sequence[str | None]) -> Iterator[RowAssignment]:
    """Within the block, row ``i`` of every batch through ``model`` uses adapter ``names[i]``
    (``None``: the base model only). Nested blocks restore the outer assignment on exit."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise DataError(f'row_adapters takes a list with one adapter name (or None) per row, got {names!r}')
    known = set(adapter_names(model))
    for name in names:
        if name is not None and name not in known:
            raise UnknownNameError('adapter', name, known)
    assignment = RowAssignment.from_names(names)
    layers = list(multi_lora_layers(model).values())
    previous = [layer.assignment for layer in layers]
    for layer in layers:
        layer.assignment = assignment
    try:
        yield assignment
    finally:
        for layer, before in zip(layers, previous, strict=True):
            layer.assignment = before
