"""``get_device_placement``: the topology as text (device groups, meshes, this process).

>>> print(get_device_placement(groups=[DeviceGroup('model', 2)]))
Device groups
  name   device  ranks  workers  gpus/worker
  model  cuda    0, 1   2        1
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from twinkle.errors import ConfigurationError
from twinkle.infra.mesh import GRID_DIMS, DeviceGroup, DeviceMesh, _env_int
from twinkle.infra.runtime import get_runtime


def get_device_placement(
    groups: Sequence[DeviceGroup] | None = None, meshes: Mapping[str, DeviceMesh] | None = None
) -> str:
    """The topology as text: a table of ``groups`` and, for each named mesh, every rank's coordinates.

    With neither argument it describes the current runtime (``twinkle.initialize``): its device
    groups and global mesh, then the local process (``WORLD_SIZE``/``RANK`` as torchrun sets
    them, and the device torch sees).

    >>> print(get_device_placement(groups=[DeviceGroup('model', 2)]))
    Device groups
      name   device  ranks  workers  gpus/worker
      model  cuda    0, 1   2        1
    """
    if groups is None and meshes is None:
        runtime = get_runtime()
        mesh = runtime.global_device_mesh
        lines = _groups_section(runtime.groups) if runtime.groups else []
        lines += _mesh_section('global', mesh) if mesh is not None else []
        return '\n'.join([*lines, *_local_section()])
    if meshes is not None and not isinstance(meshes, Mapping):
        raise ConfigurationError(
            f'meshes must map a name to a DeviceMesh (e.g. {{"model": mesh}}), got {type(meshes).__name__}'
        )
    lines = _groups_section(groups) if groups else []
    for name, mesh in (meshes or {}).items():
        lines += _mesh_section(name, mesh)
    return '\n'.join(lines)


def _groups_section(groups: Sequence[DeviceGroup]) -> list[str]:
    rows = []
    for group in groups:
        if not isinstance(group, DeviceGroup):
            raise ConfigurationError(f'groups must hold DeviceGroup objects, got {type(group).__name__}')
        device = group.device_type
        if group.requested_device_type != device:
            device += f' ({group.requested_device_type})'
        ranks = ', '.join(map(str, group.ranks))
        rows.append([group.name, device, ranks, str(group.world_size), str(group.gpus_per_worker)])
    return ['Device groups', *_table(['name', 'device', 'ranks', 'workers', 'gpus/worker'], rows)]


def _mesh_section(name: str, mesh: DeviceMesh) -> list[str]:
    if not isinstance(mesh, DeviceMesh):
        raise ConfigurationError(f'mesh {name!r} must be a DeviceMesh, got {type(mesh).__name__}')
    shown = [dim for dim in GRID_DIMS if getattr(mesh, f'{dim}_size') > 1]
    rows = []
    for rank in range(mesh.world_size):
        coords = mesh.coords(rank)
        rows.append([str(rank), *(str(coords[dim]) for dim in shown), str(mesh.data_rank(rank))])
    title = f'Device mesh {name!r}: {mesh!r}, {mesh.dp_world_size} data shards'
    return [title, *_table(['rank', *shown, 'data_rank'], rows)]


def _local_section() -> list[str]:
    world_size, rank = _env_int('WORLD_SIZE', 1), _env_int('RANK', 0)
    local_rank = _env_int('LOCAL_RANK', rank)
    row = [str(world_size), str(rank), str(local_rank), _local_device(local_rank)]
    return ['Local process', *_table(['world_size', 'rank', 'local_rank', 'device'], [row])]


def _local_device(local_rank: int) -> str:
    """The device this process would use: its CUDA (or NPU) device by local rank, else the CPU."""
    import torch

    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        return f'cuda:{index} ({torch.cuda.get_device_name(index)})'
    npu = getattr(torch, 'npu', None)
    if npu is not None and npu.is_available():
        return f'npu:{local_rank % npu.device_count()}'
    return 'cpu'


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns two spaces apart, indented by two."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        '  ' + '  '.join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]
    ]


__all__ = ['get_device_placement']
