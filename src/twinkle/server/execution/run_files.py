"""Where a run's files are on the server's disk: its checkpoints of each kind, each in a folder of
its own save (``<name>@<checkpoint id>``, the store's row naming it), and its released state (what
it continues from once off the model), on disk or in host memory (``ServerConfig.memory_dir``, the
same files in a RAM-backed folder). What a run continues from is found here, and what no row names
is cleared here at start, as released states left in memory are moved to disk."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from twinkle.model import checkpoint as ckpt
from twinkle.server.config import ServerConfig
from twinkle.server.store import TINKER_FOLDERS, Checkpoint, Run

#: Where a run's state is kept (at its release, and every ``save_state_every_steps`` steps), beside its checkpoints.
RELEASE_STATE = 'released-state'
#: The folder of each kind of checkpoint in a run's directory ('': the run's directory itself).
KIND_FOLDERS = {'training': '', 'sampler': TINKER_FOLDERS['sampler'], 'external': TINKER_FOLDERS['external']}
#: A checkpoint's folder: its name and the id of the row that records it (a name holds no '@').
CHECKPOINT_FOLDER = re.compile(r'(?P<name>[^@]+)@(?P<id>ckpt-[0-9a-f]+)')
#: The prefix of the scratch folder an export saves the adapter in before writing Tinker's layout.
EXPORT_SCRATCH = '.saving-'


def run_dir(config: ServerConfig, run: Run) -> Path:
    """The folder of a run's checkpoints and saved state."""
    return config.checkpoint_dir / run.tenant_id / run.id


def memory_state(config: ServerConfig, run: Run) -> Path | None:
    """Where a released run's state is kept in host memory (None: the server keeps none there)."""
    root = config.memory_dir
    return None if root is None else root / run.tenant_id / run.id / RELEASE_STATE


def to_disk(memory: Path, disk: Path) -> None:
    """Move a released state from host memory to disk, by the same atomic swap as every save (a
    crash leaves the old state or the new one whole), then drop it from memory. A state on disk
    that is newer (saved after its run came back from memory) stays."""
    newest = latest_state([disk, memory], [])
    if newest is not None and newest[0] == memory:
        with ckpt.atomic_directory(disk) as staging:
            shutil.copytree(memory, staging, dirs_exist_ok=True)
    shutil.rmtree(memory, ignore_errors=True)


def memory_to_disk(config: ServerConfig) -> int:
    """At start: move the released states a server left in host memory (it crashed, or was killed)
    to disk, where a run comes back from them; how many. Memory folders of data directories that
    are gone are removed."""
    root = config.memory_dir
    if root is None:
        return 0
    _sweep_orphans(root)
    moved = 0
    for tenant in _folders(root):
        for run in _folders(tenant):
            memory = run / RELEASE_STATE
            ckpt.recover(memory)
            if (memory / ckpt.TRAINER_STATE).is_file():  # else a save the crash cut short: the disk has older
                to_disk(memory, config.checkpoint_dir / tenant.name / run.name / RELEASE_STATE)
                moved += 1
        shutil.rmtree(tenant, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    (root / OWNER).write_text(str(Path(config.data_dir).resolve()))
    return moved


#: The file naming the data directory a memory folder belongs to.
OWNER = 'data_dir'


def _sweep_orphans(root: Path) -> None:
    """Remove the memory folders beside ``root`` whose data directory no longer exists (a test's)."""
    for folder in root.parent.glob('twinkle-*'):
        owner = folder / OWNER
        if folder != root and owner.is_file() and not Path(owner.read_text()).is_dir():
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
        if (path / ckpt.TRAINER_STATE).is_file():
            state = path / ckpt.TRAINER_STATE
            rank = (int(ckpt.read_trainer_state(path)['optim_step']), True, state.stat().st_mtime_ns)
        elif checkpoint is not None and (path / ckpt.ADAPTER_WEIGHTS).is_file():
            weights = path / ckpt.ADAPTER_WEIGHTS
            rank = (ckpt.read_weights_step(path), False, weights.stat().st_mtime_ns)
        else:
            continue
        ranked.append((rank, path, checkpoint))
    if not ranked:
        return None
    _, path, checkpoint = max(ranked, key=lambda place: place[0])
    return path, checkpoint


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
    'discard_unrecorded',
    'latest_state',
    'memory_state',
    'memory_to_disk',
    'run_dir',
    'to_disk',
]
