"""Writing checkpoints so that a crash never leaves a half-written one.

A checkpoint directory is assembled under a temporary name beside its destination
(``.<name>.tmp-<id>``), every file flushed to disk, then moved into place. A reader sees the old
complete checkpoint or the new complete one, never a mixture.

Overwriting a name swaps two directories. On Linux, ``renameat2(RENAME_EXCHANGE)`` swaps them in
one step, so the name always holds a whole checkpoint. Elsewhere the old one is parked
(``.<name>.old-<id>``) and the new one renamed in: a crash between the two leaves the name
missing, and ``recover`` (run by the next save or load of the name, and by a server at start)
moves the parked one back. Either way a crash leaves the old or the new checkpoint under the
name, and ``recover`` clears what the swap left beside it. One writer per name at a time.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import errno
import functools
import glob
import json
import os
import random
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch.optim import Optimizer

from twinkle.errors import CheckpointError, ConfigurationError, StateError
from twinkle.model.lora import multi as multi_lora
from twinkle.model.train_group import TrainGroup, Window

ADAPTER_WEIGHTS = 'adapter_model.safetensors'
TRAINER_STATE = 'trainer_state.json'
#: The optimizer step the weights were saved at, in every checkpoint (a sampler's weight version).
WEIGHTS_STEP = 'weights_step.json'
OPTIMIZER = 'optimizer.pt'
SCHEDULER = 'scheduler.pt'
RNG_STATE = 'rng_state.pt'
#: The accumulation window a checkpoint saved with its optimizer keeps (``train_group.Window``):
#: gradients waiting for a step, their item count, the boundary's done operations.
ACCUMULATION = 'accumulation.pt'
CHECKPOINT_VERSION = 1


@contextlib.contextmanager
def atomic_directory(destination: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success it replaces ``destination`` atomically."""
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    recover(destination)
    staging = destination.parent / f'.{destination.name}.tmp-{uuid.uuid4().hex[:8]}'
    staging.mkdir()
    try:
        yield staging
        _fsync_tree(staging)
        _replace(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _replace(staging: Path, destination: Path) -> None:
    if not destination.exists():
        os.rename(staging, destination)
    elif _exchange(staging, destination):
        shutil.rmtree(staging, ignore_errors=True)  # it holds the old checkpoint now
    else:
        # Park the old checkpoint, move the new one in, then delete the old one. A crash between
        # the two renames leaves the name missing until ``recover`` moves the parked one back.
        parked = destination.parent / f'.{destination.name}.old-{uuid.uuid4().hex[:8]}'
        os.rename(destination, parked)
        os.rename(staging, destination)
        shutil.rmtree(parked, ignore_errors=True)
    _fsync_dir(destination.parent)


#: ``renameat2`` flag: swap the two paths atomically (Linux 3.15+, most local file systems).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
#: errno of a system, C library or file system that cannot exchange: fall back to parking.
_NO_EXCHANGE = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}


def _exchange(first: Path, second: Path) -> bool:
    """Swap two directories in one step; False where the system cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, f'cannot swap {first} and {second}: {os.strerror(code)}')


@functools.cache
def _renameat2() -> Any:
    """glibc's ``renameat2`` (2.28+); None on other systems and C libraries."""
    if not sys.platform.startswith('linux'):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library('c'), use_errno=True)
    return getattr(libc, 'renameat2', None)


#: What a save leaves beside checkpoint ``name`` when it crashes: ``.name.tmp-<id>``, ``.name.old-<id>``.
_LEFTOVER = re.compile(r'\.(?P<name>.+)\.(?P<kind>tmp|old)-[0-9a-f]{8}')


def recover(destination: str | os.PathLike[str]) -> None:
    """Finish what a crash left of a save to ``destination``: if the name is missing and its old
    checkpoint is parked, move it back; then delete the save's temporary and parked directories.
    Assumes no other save of this name runs at the same time."""
    destination = Path(destination)
    leftovers = {}
    for path in sorted(destination.parent.glob(f'.{glob.escape(destination.name)}.*-*')):
        match = _LEFTOVER.fullmatch(path.name)
        if match and match['name'] == destination.name:
            leftovers[path] = match['kind']
    parked = [path for path, kind in leftovers.items() if kind == 'old']
    if parked and not destination.exists():
        with contextlib.suppress(FileNotFoundError):  # another rank of the same job moved it back first
            os.rename(parked[0], destination)
            _fsync_dir(destination.parent)
        del leftovers[parked[0]]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)


def recover_all(root: str | os.PathLike[str]) -> int:
    """``recover`` every checkpoint under ``root`` that a crash left mid-save; how many there were."""
    destinations = set()
    for path in Path(root).rglob('.*-*'):
        match = _LEFTOVER.fullmatch(path.name)
        if match and path.is_dir():
            destinations.add(path.parent / match['name'])
    for destination in destinations:
        recover(destination)
    return len(destinations)


def folder_size(root: str | os.PathLike[str]) -> int:
    """Bytes in the files under ``root`` (a saved checkpoint's size)."""
    return sum(f.stat().st_size for f in Path(root).rglob('*') if f.is_file())


def _fsync_tree(root: Path) -> None:
    for path in root.rglob('*'):
        if path.is_file():
            with open(path, 'rb') as handle:
                os.fsync(handle.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def read_weights_step(checkpoint: Path) -> int:
    """The optimizer step a checkpoint's weights were saved at (0 for one saved before it was recorded)."""
    path = checkpoint / WEIGHTS_STEP
    return int(json.loads(path.read_text()).get('optim_step', 0)) if path.is_file() else 0


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / TRAINER_STATE
    if not path.is_file():
        raise CheckpointError(
            f'{checkpoint} has no {TRAINER_STATE}: it was saved without save_optimizer=True, '
            'so there is no training state to resume (load(...) still loads its weights)'
        )
    state: dict[str, Any] = json.loads(path.read_text())  # save_training_state wrote a JSON object
    return state


def rng_state() -> dict[str, Any]:
    state = {'python': random.getstate(), 'numpy': np.random.get_state(), 'torch': torch.get_rng_state()}
    if torch.cuda.is_available():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state['python'])
    np.random.set_state(state['numpy'])
    torch.set_rng_state(state['torch'])
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])


def save_adapter(
    model: torch.nn.Module,
    group: TrainGroup,
    base_model_id: str | None,
    directory: Path,
    weights: dict[str, torch.Tensor] | None = None,
) -> None:
    """The adapter as PEFT files at the top of ``directory`` (whatever its name), so that
    ``PeftModel.from_pretrained(base, directory)`` loads it. ``weights``: the adapter's whole
    tensors by parameter name, when the model's own are shards (FSDP2)."""
    state = multi_lora.peft_state_dict(model, group.name, weights)
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(directory / ADAPTER_WEIGHTS))
    config = copy.copy(group.spec.config)
    config.base_model_name_or_path = base_model_id
    # Expert stacks are named for peft, which 'all-linear' does not reach, and the linear layers by
    # their paths: peft reads a pattern on an MoE model as targets of transformers 4's per-expert
    # layers, fused into the stacks with twice the rank.
    stacks = multi_lora.adapter_expert_stacks(model, group.name)
    if stacks:
        config.target_parameters = stacks
        config.target_modules = multi_lora.adapter_linear_paths(model, group.name) or None
    elif config.target_modules == 'all-linear' and multi_lora.has_vision_tower(model):
        # peft's 'all-linear' takes the vision tower too; twinkle's the language model only.
        config.target_modules = multi_lora.adapter_linear_paths(model, group.name)
    config.inference_mode = True
    config.save_pretrained(str(directory))


def load_adapter(model: torch.nn.Module, adapter_name: str, directory: Path) -> None:
    try:
        multi_lora.load_peft_state_dict(model, adapter_name, _adapter_file(directory))
    except ConfigurationError as e:
        raise CheckpointError(f'{directory} does not fit adapter {adapter_name!r}: {e}') from e


def read_adapter(
    model: torch.nn.Module, adapter_name: str, directory: Path, names: list[str]
) -> dict[str, torch.Tensor]:
    """The adapter's weights in ``directory`` keyed by the model's parameter names (``names``):
    what ``load_adapter`` copies in, for a model whose parameters are shards (FSDP2)."""
    weights = _adapter_file(directory)
    keys = multi_lora.peft_keys(model, adapter_name)
    by_key = {keys[name]: name for name in names}
    _check_missing(directory, adapter_name, [name for key, name in by_key.items() if key not in weights])
    return {name: weights[key] for key, name in by_key.items()}


def _adapter_file(directory: Path) -> dict[str, torch.Tensor]:
    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f'{directory} has no {ADAPTER_WEIGHTS}: it is not an adapter checkpoint')
    return load_file(str(weights))


def _check_missing(directory: Path, adapter_name: str, missing: list[str]) -> None:
    if missing:
        raise CheckpointError(
            f'{directory} does not fit adapter {adapter_name!r}: {len(missing)} weights missing, e.g. {missing[0]}'
        )


def save_training_state(
    group: TrainGroup,
    directory: Path,
    consumed: int | None,
    optimizer_state: dict[str, Any] | None = None,
    window: Window | None = None,
) -> None:
    """Optimizer, scheduler, RNG, counters and accumulation window: what ``resume_from_checkpoint``
    restores. ``optimizer_state``: the optimizer's state dict with whole tensors, when its own
    holds shards; ``window``: the group's (``ModelParallel.gather_window``)."""
    if group.optimizer is not None:
        torch.save(optimizer_state or group.optimizer.state_dict(), directory / OPTIMIZER)
    if group.scheduler is not None:
        torch.save(group.scheduler.state_dict(), directory / SCHEDULER)
    torch.save(rng_state(), directory / RNG_STATE)
    if window is not None:
        torch.save(
            {
                'grads': window.grads, 'items': window.items, 'normalized': window.normalized,
                'grad_norm': window.grad_norm, 'done': window.done, 'figures': window.figures,
            },
            directory / ACCUMULATION,
        )  # fmt: skip
    state = {
        'checkpoint_version': CHECKPOINT_VERSION,
        'cur_step': group.window.micro_step,
        'optim_step': group.window.optim_step,
        'gradient_accumulation_steps': group.window.gradient_accumulation_steps,
        'consumed_train_samples': group.window.consumed_train_samples if consumed is None else consumed,
    }
    write_json(directory / TRAINER_STATE, state)


def read_window(checkpoint: Path) -> Window | None:
    """The accumulation window a checkpoint keeps; None for one saved before windows were kept."""
    path = checkpoint / ACCUMULATION
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=True)
    try:
        return Window(
            grads={int(i): grad for i, grad in saved['grads'].items()},
            items=torch.as_tensor(saved['items']),
            normalized=bool(saved['normalized']),
            grad_norm=None if saved['grad_norm'] is None else float(saved['grad_norm']),
            done=[str(operation) for operation in saved['done']],
            figures=dict(saved['figures']),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f'{path} is not an accumulation window this twinkle wrote: {error!r}') from None


def load_optimizer_state(
    group: TrainGroup, directory: Path, fit: Callable[[Optimizer, dict[str, Any]], dict[str, Any]] | None = None
) -> None:
    """``fit(optimizer, state)`` adapts the saved whole-tensor state to sharded parameters (FSDP2)."""
    if (directory / OPTIMIZER).is_file():
        if group.optimizer is None:
            raise StateError(f'set_optimizer(...) for adapter {group.name!r} before loading its optimizer state')
        state = torch.load(directory / OPTIMIZER, weights_only=True)
        group.optimizer.load_state_dict(state if fit is None else fit(group.optimizer, state))
    if (directory / SCHEDULER).is_file() and group.scheduler is not None:
        group.scheduler.load_state_dict(torch.load(directory / SCHEDULER, weights_only=False))
