"""Connecting to Ray, and reserving each device group's devices on it.

``RayCluster.start(groups)`` connects (``connect``), checks that the cluster has the devices the
groups ask for, then reserves them: one placement group per device group, one bundle per worker
(``{'GPU': gpus_per_worker}``, ``{'CPU': ...}``, ``{'NPU': ...}``). Each component built on the
group later puts rank ``r``'s actor in bundle ``r``, asking for a small share of it, so several
components (a model and its data loader) share the group's devices as the seed scripts do.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from twinkle.errors import ConfigurationError, StateError
from twinkle.infra.mesh import DeviceGroup
from twinkle.infra.ray.worker import Placement
from twinkle.utils.logger import get_logger

logger = get_logger()
# Ray's resource name for each device type of a DeviceGroup.
RESOURCE_NAMES: dict[str, str] = {'cpu': 'CPU', 'cuda': 'GPU', 'npu': 'NPU'}
# The share of a bundle one component's actor asks for: up to 100 components can share a rank.
COMPONENT_SHARE = 0.01
# How long to wait for a group's devices to be reserved before saying who holds them.
RESERVE_TIMEOUT_S = 60.0
_NOT_RUNNING = 'Could not find any running Ray instance'


#: Settings of a Ray instance this process starts itself. Ray runs its workers at niceness 15,
#: below every ordinary process; here the workers are the training, so on a host busy with other
#: work they would get almost no CPU. They run at the driver's priority instead.
LOCAL_SYSTEM_CONFIG = {'worker_niceness': 0}


def connect() -> None:
    """Join Ray: the cluster ``RAY_ADDRESS`` names; else one already running on this machine
    (``ray start --head``); else a new single-node one on 127.0.0.1, without the dashboard.
    Nothing happens when this process is connected already (say, by ``ray.init``)."""
    if ray.is_initialized():
        return
    address = os.environ.get('RAY_ADDRESS')
    try:
        if address:
            ray.init()
            return
        try:
            ray.init(address='auto')
            return
        except ConnectionError as exc:
            if _NOT_RUNNING not in str(exc):
                raise
        start_local()
        logger.info('started a local Ray instance (no cluster was running and RAY_ADDRESS is not set)')
    except ConnectionError as exc:
        raise ConfigurationError(_connect_hint(address, exc)) from exc


def start_local(num_cpus: int | None = None) -> None:
    """Start a single-node Ray on 127.0.0.1 for this process, without the dashboard, its
    workers at the driver's priority (``LOCAL_SYSTEM_CONFIG``); ``num_cpus`` logical CPUs (None:
    the machine's cores)."""
    ray.init(
        address='local',
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address='127.0.0.1',
        _system_config=LOCAL_SYSTEM_CONFIG,
    )


def _connect_hint(address: str | None, exc: Exception) -> str:
    where = f'RAY_ADDRESS={address!r}' if address else 'the Ray cluster running on this machine'
    hint = f'could not connect to {where}: {exc}'
    if 'auth' in repr(exc.__cause__).lower() and not os.environ.get('RAY_AUTH_MODE'):
        hint += (
            '; the cluster asks for a token: set RAY_AUTH_MODE=token (and RAY_AUTH_TOKEN, or the token '
            'in ~/.ray/auth_token) as for any Ray driver'
        )
    return hint


def check_resources(groups: Sequence[DeviceGroup], total: Mapping[str, float]) -> None:
    """Every device group's devices, added up by type, must exist in the cluster (``total``)."""
    by_resource: dict[str, list[DeviceGroup]] = {}
    for group in groups:
        by_resource.setdefault(RESOURCE_NAMES[group.device_type], []).append(group)
    for resource, members in by_resource.items():
        wanted, have = sum(g.num_devices for g in members), int(total.get(resource, 0))
        if wanted > have:
            per_group = ', '.join(f'{g.name!r}: {g.num_devices}' for g in members)
            flag = {'CPU': '--num-cpus', 'GPU': '--num-gpus'}.get(resource, f'--resources=\'{{"{resource}": N}}\'')
            raise ConfigurationError(
                f'the device groups need {wanted} {resource} ({per_group}) but the Ray cluster has {have}; '
                f'give the groups fewer ranks, or add {resource}s to the cluster (ray start {flag}=...)'
            )


@dataclass
class RayCluster:
    """The devices this runtime reserved: one placement group per device group."""

    groups: dict[str, DeviceGroup]
    placement_groups: dict[str, PlacementGroup] = field(default_factory=dict)
    seed: int | None = None

    @classmethod
    def start(cls, groups: Sequence[DeviceGroup], seed: int | None = None) -> RayCluster:
        connect()
        # Ray leaves cluster_resources unannotated; it returns each resource's total by name.
        check_resources(groups, cast(Callable[[], dict[str, float]], ray.cluster_resources)())
        cluster = cls({g.name: g for g in groups}, seed=seed)
        try:
            for group in groups:
                cluster.placement_groups[group.name] = _reserve(group)
        except BaseException:
            cluster.release()
            raise
        return cluster

    def actor_options(self, group: DeviceGroup, rank: int) -> dict[str, Any]:
        """Ray options that put rank ``rank`` of a component in bundle ``rank`` of ``group``."""
        amount = COMPONENT_SHARE if group.gpus_per_worker == 1 else group.gpus_per_worker
        resource = RESOURCE_NAMES[group.device_type]
        options: dict[str, Any] = {'num_cpus': amount if resource == 'CPU' else 0}
        if resource == 'GPU':
            options['num_gpus'] = amount
        elif resource != 'CPU':
            options['resources'] = {resource: amount}
        pg = self.placement_groups[group.name]
        options['scheduling_strategy'] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
        return options

    def release(self) -> None:
        """Give the devices back; the actors placed on them end."""
        for pg in self.placement_groups.values():
            if ray.is_initialized():
                remove_placement_group(pg)
        self.placement_groups.clear()


def _reserve(group: DeviceGroup) -> PlacementGroup:
    bundle = {RESOURCE_NAMES[group.device_type]: group.gpus_per_worker}
    pg: PlacementGroup = placement_group([dict(bundle) for _ in range(group.world_size)], strategy='PACK')
    try:
        ray.get(pg.ready(), timeout=RESERVE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise StateError(
            f'Ray could not reserve {group.world_size} x {bundle} for device group {group.name!r} within '
            f'{RESERVE_TIMEOUT_S:.0f} s: the cluster has them, but other jobs hold them now (see `ray status`)'
        ) from None
    return pg


def torchrun_env(device_type: str, places: Sequence[Placement]) -> list[dict[str, str]]:
    """Each rank's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT``, as torchrun would set them; the master is rank 0's node and a port free there.

    On a GPU (or NPU) group Ray shows each actor only its own devices, so its device is number 0:
    ``LOCAL_RANK`` is 0. On CPU it is the rank's place among the group's ranks on its node.
    """
    master, envs = places[0], []
    for rank, place in enumerate(places):
        peers = [r for r, p in enumerate(places) if p.node_id == place.node_id]
        local_rank, local_size = (peers.index(rank), len(peers)) if device_type == 'cpu' else (0, 1)
        envs.append(
            {
                'RANK': str(rank),
                'WORLD_SIZE': str(len(places)),
                'LOCAL_RANK': str(local_rank),
                'LOCAL_WORLD_SIZE': str(local_size),
                'MASTER_ADDR': master.ip,
                'MASTER_PORT': str(master.free_port),
            }
        )
    return envs
