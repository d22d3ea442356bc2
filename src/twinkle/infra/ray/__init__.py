"""Ray mode: components built with ``remote_group=`` run as one Ray actor per rank of that group.

- ``hook.py``: ``remote_class(cls, {method: (dispatch, collect)})``, the one line that lets a
  component class take ``remote_group=`` and declares how its methods split and merge;
- ``dispatch.py``: the dispatch and collect rules themselves (pure functions);
- ``handle.py``: what ``remote_class`` records on a class, and ``RemoteHandle``, what ``proxy`` reads;
- ``cluster.py``: connecting to Ray, checking and reserving the device groups' devices;
- ``worker.py``: the actor that holds one rank of a component (a torchrun process in all but name);
- ``proxy.py``: ``RemoteComponent`` and ``LazyResult``, the driver's side.

Importing this package does not import Ray; only ``twinkle.initialize(mode='ray')`` (or the
names from ``proxy``/``cluster``) does.
"""

from typing import Any

from twinkle.infra.ray.dispatch import COLLECTS, DISPATCHES, Dispatch
from twinkle.infra.ray.handle import RemoteHandle
from twinkle.infra.ray.hook import remote_class

_LAZY = {'RemoteComponent': 'proxy', 'LazyResult': 'proxy', 'RayCluster': 'cluster'}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f'twinkle.infra.ray.{_LAZY[name]}'), name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = [
    'COLLECTS',
    'DISPATCHES',
    'Dispatch',
    'LazyResult',
    'RayCluster',
    'RemoteComponent',
    'RemoteHandle',
    'remote_class',
]
