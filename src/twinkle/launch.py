"""``twinkle.initialize``: the one line that picks where a script runs.

>>> import twinkle
>>> runtime = twinkle.initialize(mode='local', seed=7)
>>> runtime.mode, twinkle.get_runtime() is runtime
('local', True)

Modes:

- ``'local'``: this process (one device, or one rank of ``torchrun`` with ``global_device_mesh``);
- ``'http'``: serve the training service (``twinkle-server`` from Python). ``groups`` says where
  the model lives: the group named ``'model'`` (or the only group) gives its device, or its N
  worker processes (``ranks``); a group named ``'sampler'`` gives it a sampler group of its own;
- ``'ray'``: components built with ``remote_group=`` become actors on those groups (see
  ``twinkle.infra.ray``): this process joins the Ray cluster ``RAY_ADDRESS`` names, else one
  running on this machine, else starts one, and reserves each group's devices there.

The runtime is one object, returned and also kept as the process's current runtime
(``get_runtime()``), which components built later consult.

This module sits above both ``twinkle.infra`` (where code runs) and ``twinkle.server`` (what it
launches). It imports the server and Ray only inside ``initialize``, for the mode that needs
them, so ``import twinkle`` (a client process does it) imports neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from twinkle.errors import ConfigurationError, one_of
from twinkle.infra.mesh import DeviceGroup, DeviceMesh
from twinkle.infra.runtime import (
    MODES,
    Mode,
    RunningServer,
    Runtime,
    release_runtime,
    seed_everything,
    set_runtime,
    start_local,
)
from twinkle.utils.logger import get_logger

if TYPE_CHECKING:
    from twinkle.server.config import ServerConfig

logger = get_logger()


def initialize(
    mode: Mode = 'local',
    *,
    nproc_per_node: int | None = None,
    seed: int | None = 42,
    groups: DeviceGroup | Sequence[DeviceGroup] | None = None,
    global_device_mesh: DeviceMesh | None = None,
    lazy_collect: bool = True,
    config: str | None = None,
    block: bool = True,
    **server_options: Any,
) -> Runtime:
    """Set up the runtime for ``mode`` and make it current.

    ``seed`` seeds Python, NumPy and torch (None: leave them). In 'http' mode, ``config`` is a
    server config file and ``server_options`` are its fields (``base_model``, ``port``,
    ``data_dir``, ``limits``, ...; they win over the file's); ``block=True`` serves until
    interrupted, ``block=False`` returns at once with ``runtime.server`` running in a thread.

    In 'ray' mode, ``lazy_collect=True`` leaves remote results in Ray's object store until used
    (``LazyResult``); ``nproc_per_node`` is not needed (Ray knows each node's devices). A new
    ``initialize`` gives back the devices the previous ray-mode runtime reserved.
    """
    if mode not in MODES:
        raise one_of('mode', mode, MODES)
    if server_options and mode != 'http':
        raise ConfigurationError(f'{sorted(server_options)} are server settings; they apply only to mode="http"')
    group_list = _group_list(groups)
    runtime = Runtime(mode, seed, group_list, global_device_mesh, nproc_per_node, lazy_collect)
    if mode == 'local':
        return start_local(runtime)
    release_runtime()
    if seed is not None:
        seed_everything(seed)
    if mode == 'ray':
        from twinkle.infra.ray.cluster import RayCluster

        runtime.cluster = RayCluster.start(group_list, seed=seed)
        return set_runtime(runtime)
    server_config = _server_config(group_list, config, server_options)
    set_runtime(runtime)
    runtime.server = _serve(server_config, block)
    return runtime


def _group_list(groups: DeviceGroup | Sequence[DeviceGroup] | None) -> list[DeviceGroup]:
    group_list = [groups] if isinstance(groups, DeviceGroup) else list(groups or [])
    for group in group_list:
        if not isinstance(group, DeviceGroup):
            raise ConfigurationError(f'groups must be DeviceGroup objects; got {group!r}')
    names = [g.name for g in group_list]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigurationError(f'device group names must be unique; repeated: {duplicates}')
    return group_list


def _server_config(groups: list[DeviceGroup], config: str | None, options: dict[str, Any]) -> ServerConfig:
    from twinkle.server.config import ServerConfig

    for key, value in _model_placement(groups).items():
        options.setdefault(key, value)
    return ServerConfig.load(config, **options) if config else ServerConfig.build(**options)


def _serve(server_config: ServerConfig, block: bool) -> RunningServer | None:
    """Serve until interrupted (``block``; None), or start a server on a thread and return it."""
    from twinkle.server.cli import BackgroundServer, serve

    if block:
        serve(server_config)
        return None
    server = BackgroundServer(server_config)
    server.start()
    return server


def _model_placement(groups: list[DeviceGroup]) -> dict[str, Any]:
    """Where the service's model runs: the group named 'model' (or the only group). One rank:
    its device; N ranks: N worker processes (``ranks``), data parallel unless the options give
    an ``fsdp_size``. A group named 'sampler' is the model's sampler group (``sampler``)."""
    if not groups:
        return {}
    model = next((g for g in groups if g.name == 'model'), groups[0] if len(groups) == 1 else None)
    if model is None:
        raise ConfigurationError(
            f"the service places its model on the group named 'model'; groups: {[g.name for g in groups]}"
        )
    if model.gpus_per_worker > 1:
        raise ConfigurationError(
            f'the service runs one device per model worker; group {model.name!r} has gpus_per_worker='
            f'{model.gpus_per_worker}: give each rank one device'
        )
    placement: dict[str, Any] = {'device': _device_of(model)}
    if model.world_size > 1:
        placement['ranks'] = model.world_size
    sampler = next((g for g in groups if g.name == 'sampler'), None)
    if sampler is not None:
        placement['sampler'] = {'ranks': sampler.world_size, 'device': _device_of(sampler)}
    unused = [g.name for g in groups if g is not model and g is not sampler]
    if unused:
        logger.info(f'the service places its model on "model" and its sampler on "sampler"; {unused} stay unused')
    return placement


def _device_of(group: DeviceGroup) -> str:
    """A group's device in the server config: 'cpu', or its GPUs by index ('cuda:2', 'cuda:2,3':
    one per rank, so a model group and its sampler group never share one)."""
    if group.device_type == 'cpu':
        return 'cpu'
    return f'{group.device_type}:{",".join(str(index) for index in group.ranks)}'


__all__ = ['initialize']
