"""The driver's side of a remote component: ``RemoteComponent`` (one actor per rank) and
``LazyResult`` (a call's result, left in Ray's object store until used).

A method call on a ``RemoteComponent`` sends every rank its arguments as the method's
``Dispatch`` says, then merges the ranks' results with its ``collect``. With
``lazy_collect=True`` the call returns at once with a ``LazyResult``: using it (iterating,
indexing, ``float()``, an attribute, ``.get()``) fetches and merges; passing it to another
component's method hands the actors the object-store references, so a batch goes from the
actors that made it to the actors that use it without passing through the driver.

Failures: an exception raised by the component comes back as itself (Ray's error type is also
the original's); an actor that dies comes back as ``WorkerError`` naming the component, rank and
device group, as soon as that rank's result is due, without waiting for the other ranks. A lazy
result dropped unused still has its failure raised, at the next call on the same component.
"""

from __future__ import annotations

import inspect
import types
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from twinkle.errors import ConfigurationError, StateError, WorkerError
from twinkle.infra.mesh import DeviceGroup, DeviceMesh
from twinkle.infra.ray.cluster import RayCluster, torchrun_env
from twinkle.infra.ray.dispatch import COLLECTS, Dispatch
from twinkle.infra.ray.handle import RemoteHandle, accepts_argument, method_dispatch
from twinkle.infra.ray.worker import STOP, ComponentWorker, Deferred, Payload
from twinkle.infra.runtime import Runtime

# Ray's types cannot follow a class made an actor (its methods gain .remote, their results are refs).
_Worker: Any = ray.remote(ComponentWorker)
_SCALARS = (type(None), bool, int, float, str, Deferred)


def build_remote(
    cls: type, runtime: Runtime, group_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> RemoteComponent:
    """``cls(*args, **kwargs)`` on every rank of device group ``group_name`` (called by the
    ``remote_class`` hook when a component is built with ``remote_group=`` in ray mode)."""
    group, cluster = _group(runtime, group_name), _cluster(runtime)
    mesh = _mesh(cls, group, kwargs.get('device_mesh'))
    # A component that takes a mesh runs on it as under torchrun; another one only gets its data shards.
    mesh_aware = accepts_argument(cls, 'device_mesh')
    if not mesh_aware:
        kwargs = {k: v for k, v in kwargs.items() if k != 'device_mesh'}
    actors = [
        _Worker.options(**cluster.actor_options(group, rank)).remote(
            f'{cls.__name__} rank {rank} of group {group.name!r}', mesh.data_rank(rank), mesh.dp_world_size
        )
        for rank in range(mesh.world_size)
    ]
    handle = RemoteComponent(cls, group, mesh, actors, lazy=runtime.lazy_collect)
    try:
        ranks = list(range(len(actors)))
        places = _fetch(handle, 'start-up', ranks, [actor.placement.remote() for actor in actors])
        payload = _encode(args, kwargs)
        envs = torchrun_env(group.device_type, places)
        seed, component_mesh = cluster.seed, mesh if mesh_aware else None
        pairs = [a.build.remote(cls, payload, env, seed, component_mesh) for a, env in zip(actors, envs, strict=True)]
        _Call(handle, '__init__', ranks, [s for s, _ in pairs], [v for _, v in pairs], 'first').check()
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        raise
    return handle


def _cluster(runtime: Runtime) -> RayCluster:
    if not isinstance(runtime.cluster, RayCluster):
        raise StateError(
            "a remote component runs on the devices twinkle.initialize(mode='ray') reserves; "
            f'the current {runtime.mode!r} runtime has reserved none'
        )
    return runtime.cluster


def _group(runtime: Runtime, name: str) -> DeviceGroup:
    if not runtime.groups:
        raise ConfigurationError(
            f"remote_group={name!r}, but twinkle.initialize(mode='ray') was given no device groups; pass "
            f'groups=[DeviceGroup(name={name!r}, ranks=..., device_type=...)]'
        )
    return runtime.group(name)


def _mesh(cls: type, group: DeviceGroup, mesh: DeviceMesh | None) -> DeviceMesh:
    """The user's mesh, or (without one) every worker of the group its own data shard."""
    if mesh is None:
        return DeviceMesh.from_sizes(dp_size=group.world_size, device_type=group.device_type)
    if not isinstance(mesh, DeviceMesh):
        raise ConfigurationError(f'device_mesh must be a DeviceMesh; got {type(mesh).__name__}')
    if mesh.world_size > group.world_size:
        raise ConfigurationError(
            f'{cls.__name__}: device_mesh has world_size {mesh.world_size} but device group {group.name!r} has '
            f'{group.world_size} worker(s) (ranks={group.ranks}, gpus_per_worker={group.gpus_per_worker})'
        )
    return mesh


# ---- one call on the actors ---------------------------------------------------------------------
@dataclass(eq=False)
class _Call:
    """The refs one call returned: a status and a value per rank; and what the collect keeps."""

    owner: RemoteComponent
    what: str
    ranks: list[int]
    statuses: list[Any]
    values: list[Any]
    collect: str
    checked: list[Any] | None = None
    fetched: bool = False
    value: Any = None
    # Indices (into ranks) of the results the collect sees: one per data shard for mean/flatten.
    keep: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.keep = self.owner._kept(self.collect, self.ranks)

    def check(self) -> list[Any]:
        """Wait for every rank; raise the first failure. Returns the statuses."""
        if self.checked is None:
            self.checked = _fetch(self.owner, self.what, self.ranks, self.statuses)
        return self.checked

    def get(self) -> Any:
        if not self.fetched:
            if self.checked is None and len(self.ranks) == 1:  # one round trip for status and value
                status, value = _get(self.owner, self.what, self.ranks[0], [self.statuses[0], self.values[0]])
                self.checked, kept = [status], [value]
            else:
                self.check()  # every rank is done: its values are ready
                ranks = [self.ranks[i] for i in self.keep]
                kept = _get(self.owner, self.what, ranks, [self.values[i] for i in self.keep])
            self.value, self.fetched = COLLECTS[self.collect](kept), True
        return self.value

    def deferred(self) -> Deferred:
        return Deferred([self.values[i] for i in self.keep], self.collect)

    def finished(self) -> bool:
        ready, _ = ray.wait(self.statuses, num_returns=len(self.statuses), timeout=0)
        return len(ready) == len(self.statuses)


def _fetch(owner: RemoteComponent, what: str, ranks: list[int], refs: list[Any]) -> list[Any]:
    """``ray.get`` of each rank's ref, in rank order, raising as soon as any rank fails."""
    if len(refs) == 1:
        return [_get(owner, what, ranks[0], refs[0])]
    results, pending = {}, list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        index = refs.index(ready[0])
        results[index] = _get(owner, what, ranks[index], ready[0])
    return [results[i] for i in range(len(refs))]


def _get(owner: RemoteComponent, what: str, rank: int | list[int], ref: Any) -> Any:
    """``ray.get(ref)`` (one ref, or a list), a dead actor reported as ``WorkerError``."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as exc:
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        who = f'rank {rank}' if isinstance(rank, int) else f'one of ranks {rank}'
        raise WorkerError(
            f'{owner.remote_class.__name__} {who} (device group {owner.remote_group!r}) died during {what}: {cause}'
        ) from exc


def _worth_one_put(payload: Payload) -> bool:
    """Whether arguments are worth one ``ray.put`` rather than a copy per rank: anything but
    a few scalars (a ``put`` costs about as much as the round trip of a small call)."""
    args, kwargs = payload
    return any(not isinstance(v, _SCALARS) for v in (*args, *kwargs.values()))


def _encode(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Payload:
    """Lazy results become ``Deferred``: the actors fetch them from the object store themselves."""

    def encode(value: Any) -> Any:
        return value._call.deferred() if isinstance(value, LazyResult) else value

    return tuple(encode(a) for a in args), {k: encode(v) for k, v in kwargs.items()}


# ---- the handles --------------------------------------------------------------------------------
class RemoteComponent(RemoteHandle):
    """A component built with ``remote_group=`` in ray mode: one actor per rank of its mesh.

    Its methods are the component's (``model.forward_backward(...)``); a public attribute is
    read from rank 0 and assigned on every rank. ``remote_execute(fn, ...)`` runs a function on
    the component in each actor. ``remote_actors`` are the Ray actor handles, rank order.
    """

    def __init__(self, cls: type, group: DeviceGroup, mesh: DeviceMesh, actors: list[Any], *, lazy: bool):
        for name, value in {
            'remote_class': cls,
            'remote_group': group.name,
            'remote_mesh': mesh,
            'remote_actors': actors,
            '_lazy': lazy,
            '_dropped': [],
        }.items():
            object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return (
            f'RemoteComponent({self.remote_class.__name__} on device group {self.remote_group!r}, '
            f'{len(self.remote_actors)} rank(s))'
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith('_'):
            raise AttributeError(name)
        static = inspect.getattr_static(self.remote_class, name, None)
        if isinstance(static, (types.FunctionType, staticmethod, classmethod)):
            return RemoteMethod(self, name)
        return self._submit('get_attr', (name,), dispatch='rank0').get()

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith('_'):
            raise AttributeError(f'{self!r}: private attribute {name!r} cannot be set remotely')
        self._submit('set_attr', (name, value), what=f'setting {name}').check()

    def __len__(self) -> int:
        self._require('__len__', 'len()')
        length: int = self._submit('call', ('__len__',), ((), {}), dispatch='rank0', what='__len__').get()
        return length

    def __iter__(self) -> Iterator[Any]:
        self._require('__iter__', 'iterable')
        return RemoteIterator(self)

    def remote_execute(
        self,
        fn: Any,
        *args: Any,
        dispatch: str = 'all',
        collect: str = 'first',
        lazy: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """``fn(component, *args, **kwargs)`` on the ranks ``dispatch`` names, merged by ``collect``;
        ``lazy`` (default: the runtime's ``lazy_collect``) returns a ``LazyResult``."""
        Dispatch(dispatch, collect)  # an unknown name fails here, with the valid ones
        what = getattr(fn, '__name__', repr(fn))
        call = self._submit('execute', (fn,), (args, kwargs), dispatch=dispatch, collect=collect, what=what)
        return self._result(call, lazy)

    # ---- internals ------------------------------------------------------------------------------
    def _require(self, special: str, what: str) -> None:
        if getattr(self.remote_class, special, None) is None:
            raise TypeError(f'{self.remote_class.__name__} has no {special}: a remote one is not {what} either')

    def _submit(
        self,
        actor_method: str,
        head: tuple[Any, ...],
        payload: Payload | None = None,
        *,
        dispatch: str = 'all',
        collect: str = 'first',
        what: str | None = None,
    ) -> _Call:
        self._raise_dropped()
        ranks = [0] if dispatch == 'rank0' else list(range(len(self.remote_actors)))
        args = head
        if payload is not None:
            encoded: Any = _encode(*payload)
            if len(ranks) > 1 and _worth_one_put(encoded):
                encoded = ray.put(encoded)  # serialised once, whatever the number of ranks
            args = (*head, encoded, dispatch == 'slice_dp')
        pairs = [getattr(self.remote_actors[r], actor_method).remote(*args) for r in ranks]
        what = what or (head[0] if head and isinstance(head[0], str) else actor_method)
        return _Call(self, what, ranks, [s for s, _ in pairs], [v for _, v in pairs], collect)

    def _result(self, call: _Call, lazy: bool | None = None) -> Any:
        if not (self._lazy if lazy is None else lazy):
            return call.get()
        result = LazyResult(call)
        weakref.finalize(result, self._dropped.append, call)
        return result

    def _kept(self, collect: str, ranks: list[int]) -> list[int]:
        if collect == 'first':
            return [0]
        if collect == 'list':
            return list(range(len(ranks)))
        by_shard: dict[int, int] = {}
        for index, rank in enumerate(ranks):
            by_shard.setdefault(self.remote_mesh.data_rank(rank), index)
        return [by_shard[shard] for shard in sorted(by_shard)]

    def _raise_dropped(self) -> None:
        """Raise the failure of a finished call whose lazy result was dropped unused."""
        if not self._dropped:
            return
        pending = [call for call in self._dropped if call.checked is None]
        self._dropped.clear()
        for index, call in enumerate(pending):
            if call.finished():
                try:
                    call.check()
                except BaseException:
                    self._dropped.extend(c for c in pending[index + 1 :])
                    raise
            else:
                self._dropped.append(call)


class RemoteMethod:
    """A method of a remote component, dispatched and collected as its class declared."""

    def __init__(self, owner: RemoteComponent, name: str):
        self._owner, self._name = owner, name
        self._spec = method_dispatch(owner.remote_class, name)

    def __repr__(self) -> str:
        spec = self._spec
        return f'<remote method {self._owner.remote_class.__name__}.{self._name} ({spec.dispatch}, {spec.collect})>'

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        spec = self._spec
        call = self._owner._submit('call', (self._name,), (args, kwargs), dispatch=spec.dispatch, collect=spec.collect)
        return self._owner._result(call)


class RemoteIterator:
    """Iterating a remote component: each rank iterates its own; each step's items are merged as
    the class declared for ``'__iter__'`` (a data loader's shards are flattened into the batch)."""

    def __init__(self, owner: RemoteComponent):
        self._owner = owner
        self._collect = method_dispatch(owner.remote_class, '__iter__').collect
        owner._submit('start_iter', (), what='iter()').check()

    def __iter__(self) -> RemoteIterator:
        return self

    def __next__(self) -> Any:
        call = self._owner._submit('next_item', (), collect=self._collect, what='next()')
        stopped = [rank for rank, status in zip(call.ranks, call.check(), strict=True) if status == STOP]
        if len(stopped) == len(call.ranks):
            raise StopIteration
        if stopped:
            raise StateError(
                f'{self._owner.remote_class.__name__} ranks {stopped} ran out of items while the others had more; '
                'every rank must yield the same number of items'
            )
        return self._owner._result(call)


class LazyResult(Sequence[Any]):
    """A remote call's result, fetched (and merged) the first time it is used.

    It behaves as its value for iteration, ``len``, indexing, attributes, numbers, ``str`` and ``==``;
    ``get()`` returns the value itself. Passed to a remote component's method, it is not fetched
    here: the actors read it from Ray's object store.
    """

    def __init__(self, call: _Call):
        self._call = call

    def get(self) -> Any:
        """The merged value (fetched once; raises the call's failure)."""
        return self._call.get()

    def done(self) -> bool:
        """Whether every rank has finished (without waiting or fetching)."""
        return self._call.finished()

    def __getattr__(self, name: str) -> Any:
        if name.startswith('_'):
            raise AttributeError(name)
        return getattr(self.get(), name)

    def __len__(self) -> int:
        return len(self.get())

    def __getitem__(self, index: Any) -> Any:
        return self.get()[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.get())

    def __contains__(self, item: object) -> bool:
        return item in self.get()

    def __bool__(self) -> bool:
        return bool(self.get())

    def __float__(self) -> float:
        return float(self.get())

    def __int__(self) -> int:
        return int(self.get())

    def __eq__(self, other: object) -> bool:
        equal: bool = self.get() == (other.get() if isinstance(other, LazyResult) else other)
        return equal

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Any) -> Any:
        return self.get() + other

    def __radd__(self, other: Any) -> Any:
        return other + self.get()

    def __mul__(self, other: Any) -> Any:
        return self.get() * other

    def __rmul__(self, other: Any) -> Any:
        return other * self.get()

    def __format__(self, spec: str) -> str:
        return format(self.get(), spec)

    def __repr__(self) -> str:
        return repr(self.get())

    def __str__(self) -> str:  # logger.info(model.get_train_configs()) prints the text, not its repr
        return str(self.get())

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled (say, nested inside another argument), a lazy result travels as its value.
        return _identity, (self.get(),)


def _identity(value: Any) -> Any:
    return value


__all__ = ['LazyResult', 'RemoteComponent', 'RemoteIterator', 'RemoteMethod', 'build_remote']
