"""``remote_class``: lets a component class be built with ``remote_group=`` (and run as Ray actors).

>>> class Counter:
...     def __init__(self, start: int = 0):
...         self.total = start
...     def add(self, values: list[int]) -> int:
...         self.total += sum(values)
...         return self.total
>>> _ = remote_class(Counter, {'add': ('slice_dp', 'list')})
>>> Counter(5, remote_group='model').add([1, 2])  # not in ray mode: built here, remote_group ignored
8

In ray mode (``twinkle.initialize(mode='ray', groups=...)``) ``Counter(5, remote_group='model')``
returns a ``RemoteComponent`` instead: one actor per rank of the group 'model', each holding a
``Counter(5)``; ``add`` then sends each rank its data shard of ``values`` and returns the list of
their results. Without ``remote_group`` the object is built in this process in every mode, so
one script runs under torchrun and Ray alike.

This module imports no Ray: the classes it decorates stay importable without it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, TypeVar

from twinkle.errors import ConfigurationError, UnknownNameError
from twinkle.infra.ray.dispatch import Dispatch
from twinkle.infra.ray.handle import INIT_ATTR, METHODS_ATTR
from twinkle.infra.runtime import get_runtime

T = TypeVar('T', bound=type)


def remote_class(cls: T, methods: Mapping[str, Dispatch | tuple[str, str]] | None = None) -> T:
    """Let ``cls`` take ``remote_group=`` and declare, once, how its methods dispatch and collect.

    ``methods`` maps a method name to ``(dispatch, collect)`` (see ``dispatch.py``); a method not
    listed runs on every rank and returns rank 0's result. The key ``'__iter__'`` says how the items
    of iterating the component are collected. Returns ``cls`` itself, changed in place.
    """
    if not isinstance(cls, type):
        raise ConfigurationError(f'remote_class decorates a class; got {cls!r}')
    if METHODS_ATTR in cls.__dict__:
        raise ConfigurationError(f'{cls.__name__} is already a remote class')
    table = {}
    for name, spec in (methods or {}).items():
        if not callable(getattr(cls, name, None)):
            raise UnknownNameError(f'method of {cls.__name__}', name, _public_methods(cls))
        table[name] = Dispatch.parse(spec)
    patched: Any = cls  # its constructor is replaced below, which the type checker cannot follow
    original_init, original_new = patched.__init__, patched.__new__

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, remote_group: str | None = None, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)

    def __new__(klass: type, *args: Any, remote_group: str | None = None, **kwargs: Any) -> Any:
        if remote_group is not None:
            runtime = get_runtime()
            if runtime.mode == 'ray':
                from twinkle.infra.ray.proxy import build_remote

                return build_remote(klass, runtime, remote_group, args, kwargs)
        if original_new is object.__new__:
            return object.__new__(klass)
        return original_new(klass, *args, **kwargs)

    patched.__init__ = __init__
    patched.__new__ = staticmethod(__new__)
    setattr(cls, METHODS_ATTR, table)
    setattr(cls, INIT_ATTR, original_init)
    return cls


def _public_methods(cls: type) -> list[str]:
    return [name for name in dir(cls) if not name.startswith('_') and callable(getattr(cls, name, None))]


__all__ = ['remote_class']
