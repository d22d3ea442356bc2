"""``RayRanks``: a model group's workers as Ray actors, on any nodes of a Ray cluster.

The config's ``ray`` section with ``ranks`` > 1 (``ray: {address: auto}``, ``ranks: 4``) puts
the group on the cluster: one placement-group bundle per rank (``twinkle.infra.ray.cluster``,
the devices of a ``DeviceGroup`` named after the model), in each an actor that becomes a
torchrun process (``RANK``, ``MASTER_ADDR`` of rank 0's node...) and builds the ``RankHost``,
exactly as a component built with ``remote_group=`` does in ray mode. The ranks then join over
torch.distributed across the nodes (gloo on CPUs, NCCL on GPUs), and the server calls them as
it calls its own processes (``MultiRankHost``). Checkpoints are written by rank 0's node: on
several machines ``data_dir`` must be a shared file system.
"""

from __future__ import annotations

from typing import Any, Literal

import ray
from ray.exceptions import RayActorError, RayTaskError

from twinkle.infra.mesh import DeviceGroup, DeviceMesh
from twinkle.infra.ray.cluster import RayCluster, torchrun_env
from twinkle.infra.ray.worker import ComponentWorker
from twinkle.server.config import ServerConfig
from twinkle.server.execution.host import Forwarded
from twinkle.server.execution.hosts.multi_rank import START_TIMEOUT_S, RankDescribed, RankDied, RankHost
from twinkle.server.execution.hosts.remote_host import join_ray, ray_error_cause

_Worker: Any = ray.remote(ComponentWorker)  # Ray's types cannot follow a class made an actor


class RayRanks:
    """The workers of a ``MultiRankHost`` as Ray actors, one per rank, placed by Ray."""

    def __init__(self, config: ServerConfig):
        join_ray(config)
        device_type = 'cuda' if (config.device or '').startswith('cuda') else 'cpu'
        self.ranks = config.ranks
        self._group = DeviceGroup(name=f'model:{config.base_model}', ranks=config.ranks, device_type=device_type)
        self._cluster = RayCluster.start([self._group])
        mesh = DeviceMesh.from_sizes(**config.mesh_sizes(), device_type=device_type)
        self._actors: list[Any] = []
        try:
            for rank in range(config.ranks):
                options = self._cluster.actor_options(self._group, rank)
                label = f'model rank {rank} of {config.ranks}'
                self._actors.append(_Worker.options(**options).remote(label, mesh.data_rank(rank), mesh.dp_world_size))
            places = self._gather([actor.placement.remote() for actor in self._actors], 'start-up')
            self.nodes: list[str] = [place.node_id for place in places]
            rank_config = config.model_copy(update={'device': None if device_type == 'cuda' else 'cpu'})
            builds = [
                actor.build.remote(RankHost, ((rank_config,), {}), env, None, mesh)[1]
                for actor, env in zip(self._actors, torchrun_env(device_type, places), strict=True)
            ]
            self._gather(builds, 'start-up')
            described = self._gather([self._call(actor, 'describe', ()) for actor in self._actors], 'start-up')
        except BaseException:
            self.stop(dead=True)
            raise
        self.described: RankDescribed = described[0]
        self.pids: list[int] = [d['pid'] for d in described]

    def run(self, name: Forwarded, args: tuple[object, ...]) -> object:
        return self._gather([self._call(actor, name, args) for actor in self._actors], name)[0]

    def stop(self, dead: bool) -> None:
        for actor in self._actors:
            ray.kill(actor)
        self._cluster.release()

    def _call(self, actor: Any, name: Forwarded | Literal['describe'], args: tuple[object, ...]) -> Any:
        """The object ref of ``name(*args)`` on ``actor``'s ``RankHost`` (Any: a Ray ``ObjectRef``)."""
        return actor.call.remote(name, (args, {}), False)[1]

    def _gather(self, refs: list[Any], what: str) -> list[Any]:
        """Every rank's value, in rank order: as soon as one rank's actor dies, ``RankDied`` (the
        others may be waiting for it in a collective); a rank's own error is raised as itself."""
        pending, errors = list(refs), {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=START_TIMEOUT_S if what == 'start-up' else None)
            if not ready:
                raise RankDied(f'the model workers did not answer {what} within {START_TIMEOUT_S:.0f} s')
            rank = refs.index(ready[0])
            try:
                ray.get(ready[0])
            except RayActorError:
                raise RankDied(f'model worker rank {rank} of {self.ranks} died (its Ray actor) during {what}') from None
            except RayTaskError as error:
                errors[rank] = ray_error_cause(error)
        if errors:
            raise errors[min(errors)]
        return ray.get(refs)


__all__ = ['RayRanks']
