"""The process's runtime: which mode it runs in, its device groups and mesh, its seed.

``twinkle.initialize`` (in ``twinkle.launch``, above this layer) builds a ``Runtime`` and makes
it current; components built later consult it through ``get_runtime()``. This module holds that
state and what starts it in this process: seeding, and the local (torchrun) start. What launches
a server or a Ray cluster lives in ``twinkle.launch``; this module imports nothing above infra.

>>> runtime = start_local(Runtime('local', seed=7))
>>> runtime.mode, get_runtime() is runtime
('local', True)
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Literal, Protocol

from twinkle.errors import ConfigurationError, one_of
from twinkle.infra.mesh import DeviceGroup, DeviceMesh
from twinkle.utils.logger import get_logger

logger = get_logger()
Mode = Literal['local', 'ray', 'http']
MODES = ('local', 'ray', 'http')


class RunningServer(Protocol):
    """A server serving on a thread of this process (``twinkle.server.cli.BackgroundServer``)."""

    @property
    def url(self) -> str: ...

    def stop(self) -> None: ...


class ReservedDevices(Protocol):
    """Devices a runtime reserved for its groups (``twinkle.infra.ray.cluster.RayCluster``),
    given back when the runtime is released. Declared here, not imported: the Ray side imports
    this module, and this module imports nothing of Ray."""

    def release(self) -> None: ...


@dataclass
class Runtime:
    mode: Mode = 'local'
    seed: int | None = None
    groups: list[DeviceGroup] = field(default_factory=list)
    global_device_mesh: DeviceMesh | None = None
    nproc_per_node: int | None = None
    lazy_collect: bool = True
    #: In 'http' mode with ``block=False``: the running server (``.url``, ``.stop()``).
    server: RunningServer | None = None
    #: In 'ray' mode: the devices reserved for the groups (a ``RayCluster``).
    cluster: ReservedDevices | None = None

    def group(self, name: str) -> DeviceGroup:
        for group in self.groups:
            if group.name == name:
                return group
        raise one_of('device group', name, [g.name for g in self.groups])


_current = Runtime()


def get_runtime() -> Runtime:
    """The runtime the last ``initialize`` set up (single-process 'local' before any)."""
    return _current


def set_runtime(runtime: Runtime) -> Runtime:
    """Make ``runtime`` the current one (what components built from now on consult); return it."""
    global _current
    _current = runtime
    return runtime


def release_runtime() -> None:
    """Give back what the current runtime reserved (a ray-mode runtime's devices: its components'
    actors end) and fall back to the default single-process runtime."""
    runtime = get_runtime()
    if runtime.cluster is not None:
        runtime.cluster.release()
        runtime.cluster = None
    set_runtime(Runtime())


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def start_local(runtime: Runtime) -> Runtime:
    """Start ``runtime`` in this process and make it current: what each torchrun process runs first.

    Gives back what the previous runtime reserved, seeds (``runtime.seed``, None: leave the
    generators), checks ``runtime.global_device_mesh`` against torchrun's processes and, for more
    than one, starts the process group. Under torchrun without a mesh, the processes are plain
    data parallel: ``dp_size=WORLD_SIZE``.
    """
    release_runtime()
    if runtime.seed is not None:
        seed_everything(runtime.seed)
    runtime.global_device_mesh = _start_process_group(runtime.global_device_mesh)
    return set_runtime(runtime)


def _check_local(mesh: DeviceMesh | None) -> None:
    """A mesh must match the processes torchrun started (``WORLD_SIZE``; 1 without torchrun)."""
    world = int(os.environ.get('WORLD_SIZE', '1'))
    if mesh is not None and mesh.world_size != world:
        raise ConfigurationError(
            f'global_device_mesh has world_size {mesh.world_size} but {world} process(es) run this script; '
            f'launch it with torchrun --nproc_per_node={mesh.world_size} (WORLD_SIZE={world})'
        )


def _start_process_group(mesh: DeviceMesh | None) -> DeviceMesh | None:
    from twinkle.infra import distributed

    _check_local(mesh)
    world = int(os.environ.get('WORLD_SIZE', '1'))
    if mesh is None and world > 1:
        import torch

        mesh = DeviceMesh.from_sizes(dp_size=world, device_type='cuda' if torch.cuda.is_available() else 'cpu')
        logger.info(f'torchrun started {world} processes and no global_device_mesh was given: using {mesh!r}')
    if mesh is not None:
        distributed.init_process_group(mesh)
    return mesh


__all__ = [
    'MODES',
    'Mode',
    'ReservedDevices',
    'RunningServer',
    'Runtime',
    'get_runtime',
    'release_runtime',
    'seed_everything',
    'set_runtime',
    'start_local',
]
