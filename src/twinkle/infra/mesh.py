"""Topology: which devices a component gets (``DeviceGroup``) and how its ranks split the work (``DeviceMesh``).

A ``DeviceGroup`` names a set of devices that a component (a model, a sampler) runs on. A
``DeviceMesh`` lays the ranks of one component out on a grid whose dimensions are the kinds of
parallelism, in the order ``fsdp, pp, dp, cp, tp`` (row-major: ``tp`` varies fastest, so tensor
parallel peers are neighbouring ranks, which usually share a node).

``ep`` (expert parallel) and ``ulysses`` (Ulysses sequence parallel) are *folded*: they do not
add dimensions or ranks, they re-use ranks the grid already has.

- ``ulysses_size`` consecutive data ranks share one data shard and split its sequence, so the
  number of distinct data shards is ``dp * fsdp / ulysses``; ``ulysses`` must divide ``dp * fsdp``.
- ``ep_size`` ranks of one pipeline stage hold different experts of the same layer; it must
  divide ``world_size / pp``. The expert layout itself is built by the model layer.

>>> mesh = DeviceMesh.from_sizes(fsdp_size=4, dp_size=2)
>>> mesh
DeviceMesh(world_size=8, fsdp=4, dp=2, device_type='cuda')
>>> mesh.coords(3)
{'fsdp': 1, 'pp': 0, 'dp': 1, 'cp': 0, 'tp': 0}
>>> mesh.ranks_along('fsdp', 3)
[1, 3, 5, 7]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, TypeGuard

import numpy as np

from twinkle.errors import ConfigurationError, StateError, one_of

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

# User spelling (lower-cased) -> the torch device type. 'gpu' is Ray's name for a CUDA device.
DEVICE_TYPES: dict[str, str] = {'cuda': 'cuda', 'gpu': 'cuda', 'cpu': 'cpu', 'npu': 'npu'}
# The grid dimensions, outermost first.
GRID_DIMS: tuple[str, ...] = ('fsdp', 'pp', 'dp', 'cp', 'tp')
# Sizes that re-use the grid's ranks instead of adding a dimension.
FOLDED_DIMS: tuple[str, ...] = ('ep', 'ulysses')
# The grid dimensions that split the data: ranks that differ only along these read different batches.
DATA_DIMS: tuple[str, ...] = ('fsdp', 'dp')


def normalize_device_type(device_type: str) -> str:
    """The torch device type for a user's spelling: ``'GPU'`` and ``'cuda'`` are both ``'cuda'``."""
    key = device_type.lower() if isinstance(device_type, str) else None
    if key not in DEVICE_TYPES:
        raise one_of('device_type', device_type, DEVICE_TYPES)
    return DEVICE_TYPES[key]


def _is_int(value: object) -> TypeGuard[int | np.integer]:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(init=False)
class DeviceGroup:
    """A named set of devices that one component runs on.

    >>> DeviceGroup(name='model', ranks=4, device_type='GPU')
    DeviceGroup(name='model', ranks=[0, 1, 2, 3], device_type='cuda', gpus_per_worker=1)
    """

    # The name components refer to (``remote_group='model'``).
    name: str
    # Device indices; the constructor also takes a count ``n``, meaning ``[0, ..., n - 1]``.
    ranks: list[int]
    # 'cuda' (or Ray's 'GPU'), 'cpu', 'npu', in any case; stored normalised.
    # The user's spelling stays in ``requested_device_type``.
    device_type: str = 'cuda'
    # Devices each worker process holds (e.g. 2 for a sampler that runs tensor parallel inside one worker).
    gpus_per_worker: int = 1
    # The device type as the user wrote it.
    requested_device_type: str = field(init=False, repr=False, compare=False)

    def __init__(
        self, name: str, ranks: int | Sequence[int], device_type: str = 'cuda', gpus_per_worker: int = 1
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigurationError(f'DeviceGroup name must be a non-empty string, got {name!r}')
        self.name = name
        self.ranks = _as_rank_list(name, ranks)
        self.requested_device_type = device_type
        self.device_type = normalize_device_type(device_type)
        self.gpus_per_worker = gpus_per_worker
        if not _is_int(self.gpus_per_worker) or self.gpus_per_worker < 1:
            raise ConfigurationError(
                f'DeviceGroup {self.name!r}: gpus_per_worker must be a positive integer, got {self.gpus_per_worker!r}'
            )
        if len(self.ranks) % self.gpus_per_worker:
            raise ConfigurationError(
                f'DeviceGroup {self.name!r}: {len(self.ranks)} ranks cannot be split into workers of '
                f'gpus_per_worker={self.gpus_per_worker}; use a divisor of {len(self.ranks)}'
            )

    @property
    def num_devices(self) -> int:
        """How many devices the group holds."""
        return len(self.ranks)

    @property
    def world_size(self) -> int:
        """How many worker processes the group runs: ``len(ranks) // gpus_per_worker``."""
        return len(self.ranks) // self.gpus_per_worker


def _as_rank_list(name: str, ranks: int | Sequence[int]) -> list[int]:
    """``4`` -> ``[0, 1, 2, 3]``; a list is checked for non-negative, unique integers."""
    if _is_int(ranks):
        if ranks < 1:
            raise ConfigurationError(f'DeviceGroup {name!r}: ranks={ranks!r} must be a positive count or a list')
        return list(range(int(ranks)))
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not ranks:
        raise ConfigurationError(
            f'DeviceGroup {name!r}: ranks must be a positive int or a non-empty list of ints, got {ranks!r}'
        )
    bad = [r for r in ranks if not _is_int(r) or r < 0]
    if bad:
        raise ConfigurationError(f'DeviceGroup {name!r}: ranks must be non-negative integers, got {bad!r}')
    duplicates = sorted({int(r) for r in ranks if list(ranks).count(r) > 1})
    if duplicates:
        raise ConfigurationError(f'DeviceGroup {name!r}: ranks must be unique, {duplicates} appear more than once')
    return [int(r) for r in ranks]


@dataclass(frozen=True, repr=False)
class DeviceMesh:
    """The parallel layout of one component's ranks; build it with ``from_sizes``.

    Rank ``r`` sits at ``np.unravel_index(r, shape)`` on the ``fsdp, pp, dp, cp, tp`` grid.
    Two meshes are equal when their sizes and device type are.
    """

    fsdp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    cp_size: int = 1
    tp_size: int = 1
    # Folded into the grid (see the module docstring): they add no ranks.
    ep_size: int = 1
    ulysses_size: int = 1
    device_type: str = 'cuda'

    def __post_init__(self) -> None:
        for dim, size in self.sizes.items():
            if not _is_int(size) or size < 1:
                raise ConfigurationError(f'{dim}_size must be a positive integer, got {size!r}')
        object.__setattr__(self, 'device_type', normalize_device_type(self.device_type))
        data_size = self.fsdp_size * self.dp_size
        if data_size % self.ulysses_size:
            raise ConfigurationError(
                f'ulysses_size={self.ulysses_size} must divide the data-parallel ranks '
                f'fsdp_size * dp_size = {self.fsdp_size} * {self.dp_size} = {data_size}'
            )
        stage_size = self.world_size // self.pp_size
        if stage_size % self.ep_size:
            raise ConfigurationError(
                f'ep_size={self.ep_size} must divide the ranks of one pipeline stage '
                f'world_size / pp_size = {self.world_size} / {self.pp_size} = {stage_size}'
            )

    @classmethod
    def from_sizes(
        cls,
        *,
        world_size: int | None = None,
        dp_size: int | None = 1,
        fsdp_size: int | None = 1,
        tp_size: int | None = 1,
        pp_size: int | None = 1,
        cp_size: int | None = 1,
        ep_size: int | None = 1,
        ulysses_size: int | None = 1,
        device_type: str = 'cuda',
    ) -> DeviceMesh:
        """A mesh from its sizes (``None`` means 1); ``world_size``, when given, must be their product.

        >>> DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2).world_size
        8
        """
        given = {'fsdp': fsdp_size, 'pp': pp_size, 'dp': dp_size, 'cp': cp_size, 'tp': tp_size}
        sizes = {dim: 1 if size is None else size for dim, size in given.items()}
        mesh = cls(
            **{f'{dim}_size': size for dim, size in sizes.items()},
            ep_size=1 if ep_size is None else ep_size,
            ulysses_size=1 if ulysses_size is None else ulysses_size,
            device_type=device_type,
        )
        if world_size is not None and world_size != mesh.world_size:
            product = ' * '.join(f'{dim}_size={size}' for dim, size in sizes.items())
            raise ConfigurationError(
                f'world_size={world_size!r} does not match the product of the sizes: {product} = {mesh.world_size} '
                '(ep_size and ulysses_size are folded into these and do not multiply)'
            )
        return mesh

    @property
    def sizes(self) -> dict[str, int]:
        """Every size by dimension name: the grid dimensions in order, then the folded ones."""
        return {dim: getattr(self, f'{dim}_size') for dim in GRID_DIMS + FOLDED_DIMS}

    @property
    def shape(self) -> tuple[int, ...]:
        """The grid's shape, in ``GRID_DIMS`` order."""
        return tuple(getattr(self, f'{dim}_size') for dim in GRID_DIMS)

    @property
    def dim_names(self) -> tuple[str, ...]:
        return GRID_DIMS

    @property
    def world_size(self) -> int:
        return int(np.prod(self.shape))

    @cached_property
    def mesh(self) -> np.ndarray:
        """The rank grid (read-only): ``mesh[fsdp, pp, dp, cp, tp]`` is a global rank."""
        grid = np.arange(self.world_size).reshape(self.shape)
        grid.setflags(write=False)
        return grid

    @property
    def dp_world_size(self) -> int:
        """How many distinct data shards there are: ``dp * fsdp / ulysses``."""
        return self.dp_size * self.fsdp_size // self.ulysses_size

    def coords(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits on the grid, by dimension name."""
        self._check_rank(rank)
        return {dim: int(i) for dim, i in zip(GRID_DIMS, np.unravel_index(rank, self.shape), strict=True)}

    def data_rank(self, rank: int) -> int:
        """Which data shard (``0 .. dp_world_size - 1``) global ``rank`` reads.

        The ``(fsdp, dp)`` coordinates are numbered row-major (``dp`` fastest), then every
        ``ulysses_size`` consecutive numbers share a shard. Ranks that differ only along
        ``pp``, ``cp`` or ``tp`` read the same shard.
        """
        coords = self.coords(rank)
        return (coords['fsdp'] * self.dp_size + coords['dp']) // self.ulysses_size

    def ranks_along(self, dim: str, rank: int) -> list[int]:
        """The ranks that differ from ``rank`` only along ``dim`` (its process group for ``dim``), ``rank`` included.

        ``dim`` is a grid dimension or ``'ulysses'`` (the ranks sharing ``rank``'s data shard and
        its ``pp``/``cp``/``tp`` coordinates).
        """
        if dim == 'ulysses':
            return self._ulysses_ranks(rank)
        if dim not in GRID_DIMS:
            raise one_of('mesh dimension', dim, (*GRID_DIMS, 'ulysses'))
        coords = self.coords(rank)
        index = tuple(slice(None) if d == dim else coords[d] for d in GRID_DIMS)
        return [int(r) for r in self.mesh[index]]

    def _ulysses_ranks(self, rank: int) -> list[int]:
        coords, first = self.coords(rank), self.data_rank(rank) * self.ulysses_size
        ranks = []
        for data_index in range(first, first + self.ulysses_size):
            fsdp, dp = divmod(data_index, self.dp_size)
            ranks.append(int(self.mesh[fsdp, coords['pp'], dp, coords['cp'], coords['tp']]))
        return ranks

    def _check_rank(self, rank: int) -> None:
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise ConfigurationError(
                f'rank {rank!r} is not in this mesh of world size {self.world_size}; '
                f'accepted ranks are 0 .. {self.world_size - 1}'
            )

    def to_torch(self, device_type: str | None = None) -> TorchDeviceMesh:
        """This layout as a ``torch.distributed`` device mesh over the dimensions of size > 1.

        A mesh with no such dimension (one rank) becomes a 1-D mesh named ``'dp'``. Needs an
        initialised default process group whose world size is this mesh's.
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

        if not dist.is_available() or not dist.is_initialized():
            raise StateError(
                'DeviceMesh.to_torch needs an initialised process group; call '
                'torch.distributed.init_process_group (or run under torchrun) first'
            )
        if dist.get_world_size() != self.world_size:
            raise ConfigurationError(
                f'{self!r} has world size {self.world_size} but the process group has {dist.get_world_size()} ranks'
            )
        kept = [dim for dim in GRID_DIMS if getattr(self, f'{dim}_size') > 1] or ['dp']
        grid = torch.arange(self.world_size).reshape([getattr(self, f'{dim}_size') for dim in kept])
        torch_type = self.device_type if device_type is None else normalize_device_type(device_type)
        return TorchDeviceMesh(torch_type, grid, mesh_dim_names=tuple(kept))

    def __repr__(self) -> str:
        shown = ''.join(f', {dim}={size}' for dim, size in self.sizes.items() if size > 1)
        return f'DeviceMesh(world_size={self.world_size}{shown}, device_type={self.device_type!r})'


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == '':
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(f'environment variable {name}={value!r} must be an integer') from None
