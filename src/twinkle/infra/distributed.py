"""The torchrun process group: who this process is, and the few collectives twinkle needs.

``twinkle.initialize(mode='local', global_device_mesh=mesh)`` calls ``init_process_group``
under ``torchrun`` (``WORLD_SIZE > 1``): gloo for a CPU mesh, nccl for CUDA (each process on
``cuda:LOCAL_RANK``), hccl for NPU. Every other helper also works without a process group: one
process is rank 0 of 1, and the collectives return their input, so code written for torchrun
runs unchanged in a single process.

>>> rank(), world_size(), is_main()
(0, 1, True)
>>> all_reduce_sum(torch.tensor([2.0, 3.0]))
tensor([2., 3.])
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from twinkle.errors import ConfigurationError, StateError
from twinkle.infra.mesh import DeviceMesh, _env_int

# The collective backend for each mesh device type.
BACKENDS: dict[str, str] = {'cuda': 'nccl', 'cpu': 'gloo', 'npu': 'hccl'}
T = TypeVar('T')


def is_initialized() -> bool:
    """Whether a default process group is up (torchrun, after ``initialize``)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank: the process group's, else torchrun's ``RANK``, else 0."""
    return dist.get_rank() if is_initialized() else _env_int('RANK', 0)


def world_size() -> int:
    """How many processes run the script: the process group's size, else ``WORLD_SIZE``, else 1."""
    return dist.get_world_size() if is_initialized() else _env_int('WORLD_SIZE', 1)


def local_rank() -> int:
    """This process's index on its node (torchrun's ``LOCAL_RANK``): which device it drives."""
    return _env_int('LOCAL_RANK', rank())


def is_main() -> bool:
    """Rank 0: the process that writes checkpoints and logs for all."""
    return rank() == 0


def data_rank(mesh: DeviceMesh) -> int:
    """Which data shard this process reads under ``mesh`` (0 when the mesh has one shard).

    The mesh must describe the processes that run: its world size must be ``world_size()``."""
    if mesh.dp_world_size == 1:
        return 0
    if mesh.world_size != world_size():
        raise ConfigurationError(
            f'{mesh!r} spans {mesh.world_size} processes but {world_size()} run this script; launch it with '
            f'torchrun --nproc_per_node={mesh.world_size} and twinkle.initialize(global_device_mesh=mesh)'
        )
    return mesh.data_rank(rank())


def device(mesh: DeviceMesh) -> torch.device:
    """The device this process drives under ``mesh``: ``cuda:LOCAL_RANK`` (or npu), or the CPU."""
    kind = mesh.device_type
    if kind == 'cpu':
        return torch.device('cpu')
    backend = getattr(torch, kind, None)
    count = backend.device_count() if backend is not None and backend.is_available() else 0
    if local_rank() >= count:
        raise ConfigurationError(
            f'{mesh!r} asks for device_type={kind!r}, but local rank {local_rank()} has no {kind} device '
            f'({count} visible); build the mesh with device_type="cpu" to run on the CPU'
        )
    return torch.device(kind, local_rank())


def init_process_group(mesh: DeviceMesh) -> bool:
    """Start the default process group of a torchrun launch of ``mesh``; True if this call started it.

    Nothing to do for one process (``WORLD_SIZE`` unset or 1) or when a group is already up (its
    size must be the mesh's)."""
    if world_size() != mesh.world_size:
        raise ConfigurationError(
            f'{mesh!r} spans {mesh.world_size} processes but {world_size()} run this script; '
            f'launch it with torchrun --nproc_per_node={mesh.world_size}'
        )
    if mesh.world_size == 1 or is_initialized():
        return False
    target = device(mesh)
    if target.type == 'cuda':
        torch.cuda.set_device(target)
    dist.init_process_group(backend=BACKENDS[mesh.device_type])
    atexit.register(_destroy)
    return True


def _destroy() -> None:
    """At exit: destroy the process group, and let its C++ worker threads end while Python runs.

    ``destroy_process_group`` drops only torch's own references to the groups. A torch device
    mesh keeps its groups too (``_pg_registry``), and FSDP2's meshes outlive the model: DTensor's
    sharding caches hold them. The gloo group, with its worker threads, then lived on into
    interpreter finalization, where a worker that frees a finished collective's tensor takes the
    GIL, is ended by CPython, and aborts the process ("terminate called without an active
    exception", pytorch#190489). Dropping the meshes' references frees the group here: its
    destructor waits for the work in flight and joins its threads. (Also when the script
    destroyed the group itself: the meshes hold it all the same.)"""
    if is_initialized():
        dist.destroy_process_group()
    gc.collect()  # cyclic garbage (a model built in a function) that still holds a mesh
    _release_mesh_groups()


def _release_mesh_groups() -> None:
    """Clear the process groups every live torch device mesh holds (the process is exiting)."""
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    for obj in gc.get_objects():
        registry = getattr(obj, '_pg_registry', None) if isinstance(obj, TorchDeviceMesh) else None
        if isinstance(registry, dict):
            registry.clear()


def barrier() -> None:
    """Wait until every process gets here (nothing to wait for in one process)."""
    if is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Replace ``tensor`` by its sum over every process, in place, and return it."""
    if is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_object(obj: T) -> list[T]:
    """Every process's ``obj`` (picklable, device-free), in rank order."""
    if not is_initialized() or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_tensors(tensors: Iterable[torch.Tensor], src: int = 0) -> None:
    """Overwrite each tensor, in place, with rank ``src``'s copy."""
    if not is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor.data, src=src)


def run_on_main(fn: Callable[[], T]) -> T | None:
    """Run ``fn`` on rank 0 while the others wait; returns its result on rank 0, None elsewhere.

    Also the barrier: no process returns before rank 0 is done. If ``fn`` fails, rank 0 raises
    its error and every other rank raises a ``StateError`` that quotes it, instead of hanging."""
    if not is_initialized() or dist.get_world_size() == 1:
        return fn()
    result, error = None, None
    if is_main():
        try:
            result = fn()
        except BaseException as exc:  # reported to the other ranks, then re-raised
            error = exc
    message = [None if error is None else f'{type(error).__name__}: {error}']
    dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[0] is not None:
        raise StateError(f'rank 0 failed while the other ranks waited for it: {message[0]}')
    return result


__all__ = [
    'BACKENDS',
    'all_gather_object',
    'all_reduce_sum',
    'barrier',
    'broadcast_tensors',
    'data_rank',
    'device',
    'init_process_group',
    'is_initialized',
    'is_main',
    'local_rank',
    'rank',
    'run_on_main',
    'world_size',
]
