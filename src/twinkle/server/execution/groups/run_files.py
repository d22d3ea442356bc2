"""Where a run's files are on the server's disk: its checkpoints of each kind, each in a folder of
its own save (``<name>@<checkpoint id>``, the store's row naming it), and its kept states (what it
continues from once off the model), each in a folder of its own (``state@<id>``) on disk or in host
memory (``ServerConfig.memory_dir``, the same files in a RAM-backed folder), the store's ``run_states``
row naming the one that counts. What a run continues from is found here, and what no row names is
cleared here at start, as kept states left in memory are moved to disk."""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import IO

from twinkle.errors import CheckpointError, ConfigurationError
from twinkle.model.checkpoint import files as ckpt
from twinkle.server.config import ServerConfig
from twinkle.server.store import TINKER_FOLDERS, Checkpoint, Run

#: Where a run's state was kept before kept states had folders of their own: read as its kept state
#: while the store names none.
RELEASE_STATE = 'released-state'
#: A kept state's folder (at a release, and every ``save_state_every_steps`` steps): ``state@<id>``.
STATE_FOLDER = re.compile(r'state@[0-9a-f]{12}')
#: The folder of each kind of checkpoint in a run's directory ('': the run's directory itself).
KIND_FOLDERS = {'training': '', 'sampler': TINKER_FOLDERS['sampler'], 'external': TINKER_FOLDERS['external']}
#: A checkpoint's folder: its name and the id of the row that records it (a name holds no '@').
CHECKPOINT_FOLDER = re.compile(r'(?P<name>[^@]+)@(?P<id>ckpt-[0-9a-f]+)')
#: The prefix of the scratch folder an export saves the adapter in before writing Tinker's layout.
EXPORT_SCRATCH = '.saving-'


def run_dir(config: ServerConfig, run: Run) -> Path:
    """The folder of a run's checkpoints and saved state."""
    return config.checkpoint_dir / run.tenant_id / run.id


def new_state_folder() -> str:
    """The name of a new kept state's folder."""
    return f'state@{secrets.token_hex(6)}'


def state_on_disk(config: ServerConfig, run: Run, folder: str) -> Path:
    return run_dir(config, run) / folder


def state_in_memory(config: ServerConfig, run: Run, folder: str) -> Path | None:
    """Where a kept state is in host memory (None: the server keeps none there)."""
    root = config.memory_dir
    return None if root is None else root / run.tenant_id / run.id / folder


def kept_state(config: ServerConfig, run: Run, folder: str | None) -> Path | None:
    """The kept state ``folder`` of the run where it is now, in host memory or on disk (None: the
    store names none, or it is gone); while the store names none, the state of an older server."""
    for place in kept_places(config, run, folder):
        if (place / ckpt.TRAINER_STATE).is_file():
            return place
    return None


def kept_places(config: ServerConfig, run: Run, folder: str | None) -> list[Path]:
    """Everywhere the kept state ``folder`` of the run can be: host memory, then disk (one moving
    between them is in one or the other at every moment, so a reader that looks in both finds it);
    while the store names none, where an older server left its state."""
    if folder is None:
        return [run_dir(config, run) / RELEASE_STATE]
    memory = state_in_memory(config, run, folder)
    return [*([] if memory is None else [memory]), state_on_disk(config, run, folder)]


def to_disk(memory: Path, disk: Path) -> None:
    """Move a kept state from host memory to disk (``copy_to_disk``), then drop it from memory."""
    copy_to_disk(memory, disk)
    drop(memory)


def copy_to_disk(memory: Path, disk: Path) -> None:
    """Copy a kept state from host memory to disk, into a folder that appears whole or not at all (a
    crash leaves it missing, and the state in memory)."""
    if not disk.exists():
        with ckpt.atomic_directory(disk) as staging:
            shutil.copytree(memory, staging, dirs_exist_ok=True)


def drop(state: Path) -> None:
    """Delete a kept state, and its run's and tenant's folders in host memory once empty."""
    shutil.rmtree(state, ignore_errors=True)
    for folder in (state.parent, state.parent.parent):
        try:
            folder.rmdir()
        except OSError:
            break


#: The file naming the data directory a memory folder belongs to, locked while its server runs.
OWNER = 'data_dir'


#: The memory folders this process holds, by folder: a server of this process that was not
#: stopped left its lock, which the next one of its data directory takes over.
_HELD: dict[Path, IO[str]] = {}


def claim_memory(config: ServerConfig) -> int:
    """At start: lock this data directory's memory folder while the server runs
    (``release_memory``), move the kept states a server left there (it crashed, or was
    killed) to disk, where its runs come back from, and remove the memory folders of data
    directories that are gone and whose server is not running. How many states were found;
    ``ConfigurationError`` if another process's server of this data directory holds the folder."""
    root = config.memory_dir
    if root is None:
        return 0
    _own_folder(root)
    lock = _HELD.get(root) or _locked(root / OWNER)
    if lock is None:
        raise ConfigurationError(
            f'another server of data_dir {config.data_dir!r} is running (it holds {root}): one server owns a data_dir'
        )
    _HELD[root] = lock
    lock.truncate(0)
    lock.write(str(Path(config.data_dir).resolve()))
    lock.flush()
    _sweep_orphans(root)
    found = 0
    for tenant in _folders(root):
        for run in _folders(tenant):
            for state in _folders(run):
                found += _claim(state, config.checkpoint_dir / tenant.name / run.name / state.name)
        shutil.rmtree(tenant, ignore_errors=True)
    return found


def _own_folder(root: Path) -> None:
    """Make the memory folder this user's alone (0700), as ``data_dir`` is: every tenant's latest
    weights and optimizer state are in it, under a name anyone can work out, in a place anyone may write
    (``/dev/shm``). A folder there before us that another user owns, or a link, is refused: its owner
    could read the states, or plant one."""
    root.mkdir(mode=0o700, exist_ok=True)
    found = root.lstat()
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
        raise ConfigurationError(
            f'the memory folder {root} is not a folder of this user (uid {os.getuid()}): remove it, or set '
            'memory_state_dir to a folder of its own (memory_state_bytes: 0 keeps no state in memory)'
        )
    if stat.S_IMODE(found.st_mode) != 0o700:
        root.chmod(0o700)


def _claim(memory: Path, disk: Path) -> int:
    """Move a kept state a dead server left in host memory to ``disk``; 1 if there was one (0: a save the
    crash cut short, or no state: the disk has older)."""
    if memory.name == RELEASE_STATE:  # an older server's: it replaces the disk's only if newer
        ckpt.recover(memory)
        newest = latest_state([disk, memory], [])
        if newest is not None and newest[0] == memory:
            with ckpt.atomic_directory(disk) as staging:
                shutil.copytree(memory, staging, dirs_exist_ok=True)
            return 1
        return 0
    if STATE_FOLDER.fullmatch(memory.name) and (memory / ckpt.TRAINER_STATE).is_file():
        to_disk(memory, disk)
        return 1
    return 0


def discard_unkept(root: Path, kept: dict[str, str]) -> int:
    """At start: delete the kept-state folders under ``root`` (``state@<id>`` in a run's directory) that
    are not the one the store names for their run (``kept``: run id -> folder): states a crash cut short
    before their commit, or replaced just before one. How many there were."""
    gone = 0
    for run_dir in (path for tenant in _folders(root) for path in _folders(tenant)):
        for folder in _folders(run_dir):
            if STATE_FOLDER.fullmatch(folder.name) and kept.get(run_dir.name) != folder.name:
                shutil.rmtree(folder, ignore_errors=True)
                gone += 1
    return gone


def release_memory(config: ServerConfig) -> None:
    """At stop: unlock this data directory's memory folder (what is still in it, the next start puts on disk)."""
    root = config.memory_dir
    lock = None if root is None else _HELD.pop(root, None)
    if lock is not None:
        lock.close()
    if root is not None and not _folders(root) and (root / OWNER).is_file():
        shutil.rmtree(root, ignore_errors=True)  # nothing left in memory: no folder left behind


def _locked(path: Path) -> IO[str] | None:
    """``path`` opened and locked (``flock``, released when the file closes or its process dies);
    None if another open file holds the lock."""
    handle = path.open('a+', encoding='utf-8')
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _sweep_orphans(root: Path) -> None:
    """Remove the memory folders beside ``root`` of data directories that no longer exist (a
    test's), unless their server still runs (holds the lock)."""
    for folder in root.parent.glob('twinkle-*'):
        owner = folder / OWNER
        if folder == root or not owner.is_file() or Path(owner.read_text(encoding='utf-8')).is_dir():
            continue
        lock = _locked(owner)
        if lock is not None:
            with lock:
                shutil.rmtree(folder, ignore_errors=True)


def latest_state(kept: list[Path], checkpoints: list[Checkpoint]) -> tuple[Path, Checkpoint | None] | None:
    """The saved state of a run that stands at its latest optimizer step: a state the server kept
    (``kept``: in memory at a release, on disk at a release and every ``save_state_every_steps``
    steps) or one of its training ``checkpoints`` (saved with ``save_optimizer=True``, or of
    weights alone: then the optimizer starts afresh); on a tie one with the optimizer, then the
    newest. With the checkpoint it is (None: the server's own). None if the run has none."""
    places = [*((path, None) for path in kept), *((Path(c.path), c) for c in checkpoints)]
    ranked: list[tuple[tuple[int, bool, int], Path, Checkpoint | None]] = []
    for path, checkpoint in places:
        rank = _rank(path, checkpoint)
        if rank is not None:
            ranked.append((rank, path, checkpoint))
    if not ranked:
        return None
    _, path, checkpoint = max(ranked, key=lambda place: place[0])
    return path, checkpoint


def _rank(path: Path, checkpoint: Checkpoint | None) -> tuple[int, bool, int] | None:
    """How new a saved state is (``latest_state``); None if ``path`` holds none, or no longer does
    (a state that moved from memory to disk while it was read: the disk has it)."""
    try:
        if (path / ckpt.TRAINER_STATE).is_file():
            state = path / ckpt.TRAINER_STATE
            return int(ckpt.read_trainer_state(path)['optim_step']), True, state.stat().st_mtime_ns
        if checkpoint is not None and (path / ckpt.ADAPTER_WEIGHTS).is_file():
            weights = path / ckpt.ADAPTER_WEIGHTS
            return ckpt.read_weights_step(path), False, weights.stat().st_mtime_ns
    except (FileNotFoundError, CheckpointError):
        pass
    return None


def discard_unrecorded(root: Path, recorded: set[str]) -> int:
    """At start: delete the checkpoint folders under ``root`` (``<name>@<id>`` in a run's
    directory, or its sampler or exported weights) that no row names: saves a crash cut short
    before their commit, and folders replaced just before one; and exports' scratch folders.
    How many there were."""
    gone = 0
    for run_dir in (path for tenant in _folders(root) for path in _folders(tenant)):
        for kind_dir in {run_dir / folder for folder in KIND_FOLDERS.values()}:
            for folder in _folders(kind_dir):
                unrecorded = CHECKPOINT_FOLDER.fullmatch(folder.name) and str(folder) not in recorded
                if unrecorded or folder.name.startswith(EXPORT_SCRATCH):
                    shutil.rmtree(folder, ignore_errors=True)
                    gone += 1
    return gone


def _folders(path: Path) -> list[Path]:
    return [child for child in path.iterdir() if child.is_dir()] if path.is_dir() else []


__all__ = [
    'CHECKPOINT_FOLDER',
    'EXPORT_SCRATCH',
    'KIND_FOLDERS',
    'OWNER',
    'RELEASE_STATE',
    'STATE_FOLDER',
    'claim_memory',
    'discard_unkept',
    'discard_unrecorded',
    'drop',
    'kept_state',
    'latest_state',
    'new_state_folder',
    'release_memory',
    'run_dir',
    'state_in_memory',
    'state_on_disk',
    'to_disk',
]
