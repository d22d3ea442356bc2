"""Optimizer state offloading: keep idle tenants' optimizer state off the hot path.

A multi-tenant server holds one optimizer per LoRA adapter. AdamW keeps two moments per trainable
parameter, so the optimizer state of idle tenants, more than their adapters, bounds how many tenants
one accelerator can host. This module moves that state to CPU memory and, past a limit, to disk, and
brings it back on use bit for bit: tensors are copied, never cast or recomputed, so training with
offloading gives the same numbers as training without it.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.optim import Optimizer

from twinkle.errors import CheckpointError, ConfigurationError, StateError, UnknownNameError

Tier = Literal['device', 'cpu', 'disk']
TIERS: tuple[Tier, ...] = ('device', 'cpu', 'disk')
_NAME = re.compile(r'[A-Za-z0-9_-]+')
_CPU = torch.device('cpu')


def _state_tensors(optimizer: Optimizer) -> Iterator[tuple[dict[str, Any], str, torch.Tensor]]:
    """Every movable state tensor with the dict and key holding it. ``step`` is never yielded: torch
    keeps it on CPU unless the optimizer is capturable or fused, and its kernels rely on that."""
    for state in optimizer.state.values():
        for key, value in list(state.items()):
            if key != 'step' and isinstance(value, torch.Tensor):
                yield state, key, value


def _state_nbytes(optimizer: Optimizer) -> int:
    """Bytes of the movable state (``step`` scalars left out), wherever it lives."""
    return sum(tensor.nbytes for _, _, tensor in _state_tensors(optimizer))


def _is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` already lives on ``device``; a device without index matches any index."""
    return tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index)


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``tensor`` on ``device``. CUDA to CPU goes through pinned memory so the copies of one
    optimizer overlap instead of each blocking; the caller synchronizes before the values are read."""
    if tensor.device.type == 'cuda' and device.type == 'cpu':
        return torch.empty_like(tensor, device=_CPU, pin_memory=True).copy_(tensor, non_blocking=True)
    return tensor.to(device, non_blocking=tensor.device.type == 'cpu' and tensor.is_pinned())


def move_optimizer_state(optimizer: Optimizer, device: torch.device | str) -> int:
    """Move every state tensor of ``optimizer`` (``step`` excepted, see ``_state_tensors``) to ``device``.

    Returns the bytes of state now held on ``device``, copied or already there, so a caller can account
    a tier's size without a second walk. Tensors already on ``device`` are left as they are.
    """
    device = torch.device(device)
    total, pending = 0, set()
    for state, key, tensor in list(_state_tensors(optimizer)):
        if not _is_on(tensor, device):
            if tensor.device.type == 'cuda' and device.type == 'cpu':
                pending.add(tensor.device)
            state[key] = _copy_to(tensor, device)
        total += tensor.nbytes
    for source in pending:  # the host copies must be complete before anyone reads (or saves) them
        torch.cuda.synchronize(source)
    return total


def spill_optimizer_state(optimizer: Optimizer, path: Path | str) -> int:
    """Write the state of ``optimizer`` to ``path`` and drop it from memory; returns the bytes written.

    The file is written beside ``path`` and renamed into place, so ``path`` never holds a partial
    file; on failure the state stays in memory. No fsync: a spill file is a cache that means nothing
    once the process holding the optimizer is gone.
    """
    path = Path(path)
    tmp = path.with_suffix('.tmp')
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(optimizer.state_dict()['state'], tmp)
        os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise CheckpointError(f'Could not spill optimizer state to {str(path)!r}: {error}') from error
        raise
    optimizer.state.clear()
    return path.stat().st_size


def _restore_value(key: str, value: Any, param: torch.Tensor, group: dict[str, Any], device: torch.device) -> Any:
    """Place one saved state value the way torch's own ``load_state_dict`` would, minus its dtype cast
    (a cast could change bits): ``step`` on CPU, or beside the parameter when capturable or fused."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == 'step':
        return value.to(param.device) if group.get('capturable') or group.get('fused') else value
    return value.to(device)


def load_spilled_optimizer_state(optimizer: Optimizer, path: Path | str, device: torch.device | str) -> None:
    """Read back what ``spill_optimizer_state`` wrote, put it on ``device`` and delete the file.

    Saved keys are the parameter indices of ``Optimizer.state_dict`` (parameters of all groups in
    order), so ``optimizer.state_dict()`` afterwards equals the one before the spill exactly.
    """
    path, device = Path(path), torch.device(device)
    if optimizer.state:
        raise StateError(f'Optimizer already has state; refusing to overwrite it with {str(path)!r}')
    try:
        saved = torch.load(path, map_location=_CPU, weights_only=True)
    except OSError as error:
        raise CheckpointError(f'Could not read spilled optimizer state {str(path)!r}: {error}') from error
    placed = [(param, group) for group in optimizer.param_groups for param in group['params']]
    bad = [index for index in saved if not isinstance(index, int) or not 0 <= index < len(placed)]
    if bad:
        raise CheckpointError(f'{str(path)!r} holds state for parameters {bad}; the optimizer has {len(placed)}')
    for index, values in saved.items():
        param, group = placed[index]
        optimizer.state[param] = {key: _restore_value(key, v, param, group, device) for key, v in values.items()}
    path.unlink()


def _check_limit(what: str, value: int | None) -> int | None:
    """A tier limit is a positive count or None (no limit); 0 would offload the optimizer being used."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigurationError(f'Invalid {what} {value!r}. Accepted values are: None or an integer >= 1')
    return value


@dataclass
class _Entry:
    optimizer: Optimizer
    tier: Tier


class OptimizerOffloader:
    """Least-recently-used placement of named optimizers over device, CPU memory and disk.

    The ``max_on_device`` most recently touched optimizers keep their state on ``device``, the
    ``max_in_memory`` most recent keep it in memory at all, older ones are spilled to
    ``spill_dir/<name>.pt``. On a CPU ``device`` the device tier is memory, so only ``max_in_memory``
    counts. ``None`` means no limit. Internal bookkeeping is locked; keeping an optimizer from being
    stepped while another tenant's ``touch`` offloads it is the caller's job.
    """

    def __init__(
        self,
        device: torch.device | str,
        spill_dir: Path | str,
        max_on_device: int | None = None,
        max_in_memory: int | None = None,
    ):
        self.device = torch.device(device)
        self.spill_dir = Path(spill_dir)
        self.max_on_device = _check_limit('max_on_device', max_on_device)
        self.max_in_memory = _check_limit('max_in_memory', max_in_memory)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.RLock()

    @property
    def hot_capacity(self) -> int | None:
        """How many optimizers can have their state on ``device`` at once (None: no limit)."""
        limits = [self.max_in_memory]
        if self.device.type != 'cpu':
            limits.append(self.max_on_device)
        counts = [limit for limit in limits if limit is not None]
        return min(counts) if counts else None

    def _path(self, name: str) -> Path:
        """The spill file of ``name``; the name is checked so it cannot escape ``spill_dir``."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigurationError(f'Invalid optimizer name {name!r}. Accepted names match ^[A-Za-z0-9_-]+$')
        return self.spill_dir / f'{name}.pt'

    def touch(self, name: str, optimizer: Optimizer) -> None:
        """Call before using ``optimizer``: bring its state back to ``device``, mark it most recently
        used, then offload the others past the limits. A new name starts on ``device``."""
        path = self._path(name)
        with self._lock:
            entry = self._entries.setdefault(name, _Entry(optimizer, 'device'))
            if entry.optimizer is not optimizer:
                raise StateError(f'Optimizer {name!r} is registered with another optimizer; forget({name!r}) first')
            if entry.tier == 'disk':
                load_spilled_optimizer_state(optimizer, path, self.device)
            else:
                move_optimizer_state(optimizer, self.device)
            entry.tier = 'device'
            self._entries.move_to_end(name)
            self._apply_limits()

    def _target_tier(self, rank: int) -> Tier:
        """Where the optimizer with recency ``rank`` (0 = most recently used) may live at best."""
        if self.max_in_memory is not None and rank >= self.max_in_memory:
            return 'disk'
        if self.device.type != 'cpu' and self.max_on_device is not None and rank >= self.max_on_device:
            return 'cpu'
        return 'device'

    def _apply_limits(self) -> None:
        """Offload every optimizer living in a hotter tier than its rank allows; none is promoted
        here, only ``touch`` brings state back."""
        for rank, (name, entry) in enumerate(reversed(self._entries.items())):
            target = self._target_tier(rank)
            if TIERS.index(target) <= TIERS.index(entry.tier):
                continue
            if target == 'disk':
                spill_optimizer_state(entry.optimizer, self._path(name))
            else:
                move_optimizer_state(entry.optimizer, _CPU)
            entry.tier = target

    def forget(self, name: str) -> None:
        """An adapter was removed: drop its optimizer and delete its spill file (unknown names are fine)."""
        path = self._path(name)
        with self._lock:
            self._entries.pop(name, None)
            path.unlink(missing_ok=True)

    def where(self, name: str) -> Tier:
        """The tier holding the state of ``name``."""
        with self._lock:
            if name not in self._entries:
                raise UnknownNameError('offloaded optimizer', name, self._entries)
            return self._entries[name].tier

    def stats(self) -> dict[str, dict[Tier, int]]:
        """``{'count': {tier: n}, 'bytes': {tier: n}}``; memory bytes leave out ``step`` scalars, disk bytes
        are file sizes. Measured now, since stepping a touched optimizer grows its state."""
        with self._lock:
            count: dict[Tier, int] = dict.fromkeys(TIERS, 0)
            nbytes: dict[Tier, int] = dict.fromkeys(TIERS, 0)
            for name, entry in self._entries.items():
                count[entry.tier] += 1
                on_disk = entry.tier == 'disk'
                nbytes[entry.tier] += self._path(name).stat().st_size if on_disk else _state_nbytes(entry.optimizer)
            return {'count': count, 'bytes': nbytes}
