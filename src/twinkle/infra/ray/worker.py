"""The actor that holds one rank of a remote component.

Every component runs in the same generic actor: it is created first (so rank 0 can report an
address for ``torch.distributed``), then ``build`` sets the torchrun-style environment and
constructs the component. Calls return two objects: a small status (``True``, or ``'stop'`` at
the end of an iteration) that the driver waits on, and the value, which stays in Ray's object
store until someone uses it. A ``Deferred`` argument is another call's result: the actor
fetches it from the object store itself, so it never passes through the driver.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import ray

from twinkle.errors import StateError
from twinkle.infra.mesh import DeviceMesh
from twinkle.infra.ray.dispatch import COLLECTS, slice_inputs
from twinkle.infra.runtime import Runtime, seed_everything, start_local

Payload = tuple[tuple[Any, ...], dict[str, Any]]
# What a call returns besides its value: it ran; or the component's iterator is exhausted.
DONE, STOP = True, 'stop'


@dataclass
class Deferred:
    """A result still in the object store: one ref per data shard, merged by ``collect``."""

    refs: list[Any]
    collect: str

    def resolve(self) -> Any:
        return COLLECTS[self.collect](ray.get(self.refs))


@dataclass
class Placement:
    """Where a worker runs: its node, that node's address, and a port free there now."""

    node_id: str
    ip: str
    free_port: int


class ComponentWorker:
    """One rank of a remote component (made a Ray actor by ``cluster.RayCluster.spawn``)."""

    def __init__(self, label: str, data_rank: int, dp_size: int):
        self.label = label
        self.data_rank, self.dp_size = data_rank, dp_size
        self.component: Any = None
        self._iterator: Iterator[Any] | None = None

    def __repr__(self) -> str:  # Ray shows it in log prefixes and error messages
        return self.label

    def placement(self) -> Placement:
        with socket.socket() as sock:
            sock.bind(('', 0))
            port = sock.getsockname()[1]
        # Ray leaves get_node_ip_address unannotated; it returns this node's address as a string.
        address = cast(Callable[[], str], ray.util.get_node_ip_address)()
        return Placement(ray.get_runtime_context().get_node_id(), address, port)

    @ray.method(num_returns=2)
    def build(
        self, cls: type, payload: Payload, env: dict[str, str], seed: int | None, mesh: DeviceMesh | None
    ) -> tuple[bool, None]:
        """Become a torchrun process, then build the component.

        With a ``mesh`` (a component that takes ``device_mesh``), this actor sets the environment
        torchrun would (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...) and runs what each torchrun
        process runs first, ``twinkle.initialize(mode='local', global_device_mesh=mesh)``: the
        ranks form a process group (gloo on CPU) and the component uses the mesh as in torchrun.
        Without one, it only seeds (each rank alike, as every process of a script would).
        """
        os.environ.update(env)
        if mesh is not None:
            start_local(Runtime('local', seed, global_device_mesh=mesh))
        elif seed is not None:
            seed_everything(seed)
        args, kwargs = _resolved(payload)
        self.component = cls(*args, **kwargs)
        return DONE, None

    @ray.method(num_returns=2)
    def call(self, name: str, payload: Payload, sliced: bool) -> tuple[bool, Any]:
        args, kwargs = self._inputs(payload, sliced)
        return DONE, getattr(self.component, name)(*args, **kwargs)

    @ray.method(num_returns=2)
    def execute(self, fn: Any, payload: Payload, sliced: bool) -> tuple[bool, Any]:
        args, kwargs = self._inputs(payload, sliced)
        return DONE, fn(self.component, *args, **kwargs)

    @ray.method(num_returns=2)
    def get_attr(self, name: str) -> tuple[bool, Any]:
        return DONE, getattr(self.component, name)

    @ray.method(num_returns=2)
    def set_attr(self, name: str, value: Any) -> tuple[bool, None]:
        setattr(self.component, name, value)
        return DONE, None

    @ray.method(num_returns=2)
    def start_iter(self) -> tuple[bool, None]:
        self._iterator = iter(self.component)
        return DONE, None

    @ray.method(num_returns=2)
    def next_item(self) -> tuple[bool | str, Any]:
        if self._iterator is None:
            raise StateError(f'{self.label}: next_item before start_iter (the proxy starts iterating first)')
        try:
            return DONE, next(self._iterator)
        except StopIteration:
            return STOP, None

    def _inputs(self, payload: Payload, sliced: bool) -> Payload:
        args, kwargs = _resolved(payload)
        if sliced:
            return slice_inputs(args, kwargs, data_rank=self.data_rank, dp_size=self.dp_size)
        return args, kwargs


def _resolved(payload: Payload) -> Payload:
    args, kwargs = payload
    args = tuple(a.resolve() if isinstance(a, Deferred) else a for a in args)
    return args, {k: v.resolve() if isinstance(v, Deferred) else v for k, v in kwargs.items()}
