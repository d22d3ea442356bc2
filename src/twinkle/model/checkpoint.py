"""Writing checkpoints so that a crash never leaves a half-written one.

A checkpoint directory is assembled under a temporary name beside its destination, every file
flushed to disk, then renamed into place in one step. A reader sees the old complete checkpoint
or the new complete one, never a mixture.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from twinkle.errors import CheckpointError

TRAINER_STATE = 'trainer_state.json'
OPTIMIZER = 'optimizer.pt'
SCHEDULER = 'scheduler.pt'
RNG_STATE = 'rng_state.pt'
CHECKPOINT_VERSION = 1


@contextmanager
def atomic_directory(destination: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success it replaces ``destination`` atomically."""
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
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
    else:
        # Swap: park the old checkpoint, move the new one in, then delete the old one.
        parked = destination.parent / f'.{destination.name}.old-{uuid.uuid4().hex[:8]}'
        os.rename(destination, parked)
        os.rename(staging, destination)
        shutil.rmtree(parked, ignore_errors=True)
    _fsync_dir(destination.parent)


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


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / TRAINER_STATE
    if not path.is_file():
        raise CheckpointError(
            f'{checkpoint} has no {TRAINER_STATE}: it was saved without save_optimizer=True, '
            'so there is no training state to resume (load(...) still loads its weights)'
        )
    return json.loads(path.read_text())


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
